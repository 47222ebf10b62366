"""Blobs as the registry server sends them: opened only when they may be served (`open_blob`),
read behind a mirror's fetch while it is still written (`open_growing`), streamed a chunk
ahead of the socket (`stream_blob`), cut short when the client hangs up
(`cancel_on_disconnect`), and compressed with zstd for text-like layers (`ZstdCache`)."""

from __future__ import annotations

import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
import zstandard

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_fd
from modelfs.store.errors import CorruptBlobError, MissingBlobError
from modelfs.store.layout import Layout
from modelfs.sync.registry.http import Receive, Send
from modelfs.sync.registry.view import View

if TYPE_CHECKING:
    from modelfs.sync.mirror.mirror import BlobFetch

log = logging.getLogger(__name__)

# One read and one ASGI message per chunk: big enough that per-message costs vanish against
# the copy, small enough that a page-cache miss does not stall the send for long.
CHUNK = 4 << 20
SMALL_BLOB = 256 << 10  # read whole while opening: one thread hop for a small layer
# zstd: only for text-like layers a client asks it for, small enough to compress in one go,
# and only when it saves a tenth; results are kept for the next client.
ZSTD_LEVEL = 3
ZSTD_MIN = 1024
ZSTD_MAX = 64 << 20
ZSTD_CACHE = 64 << 20


@dataclass(slots=True)
class OpenBlob:
    fd: int
    size: int
    data: bytes | None = None  # the whole blob, when small: read in the same thread hop
    growing: BlobFetch | None = None  # a mirror's fetch still writing it (sync.mirror)


def _same_file(st: os.stat_result, path: os.PathLike[str]) -> bool:
    try:
        other = os.lstat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def open_blob(layout: Layout, view: View, digest: Digest, *, read_small: bool) -> OpenBlob:
    """Open a blob that may be served: a regular file under its canonical name, not
    quarantined, and as long as every manifest that names it says."""
    path = layout.blob(digest)
    try:
        fd = open_fd(path, follow=False)
    except OSError as exc:
        # ELOOP: a symlink where a blob should be could point anywhere; never follow it.
        raise MissingBlobError(f"blob {digest} not found") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MissingBlobError(f"blob {digest} not found")
        # `modelfs verify` moves a corrupt blob out of blobs/ by rename, so what is here
        # now is another file: a good copy from `--repair-from` or `ollama pull`, to be
        # served. Only the same file in both places (a hardlink left by an interrupted or
        # hand-made quarantine) is the quarantined bytes.
        if _same_file(st, layout.quarantine / digest.blob_name):
            raise CorruptBlobError(f"blob {digest} is quarantined")
        sizes = view.blob_sizes.get(digest)
        if sizes and st.st_size not in sizes:
            log.warning(
                "blob %s is %d bytes, its manifests say %s: not served",
                digest,
                st.st_size,
                sorted(sizes),
            )
            raise CorruptBlobError(f"blob {digest} has the wrong size")
        data = None
        if read_small and st.st_size <= SMALL_BLOB:
            data = os.pread(fd, st.st_size, 0)
            if len(data) != st.st_size:
                raise CorruptBlobError(f"blob {digest} changed size while read")
    except BaseException:
        os.close(fd)
        raise
    return OpenBlob(fd, st.st_size, data)


def open_growing(fetch: BlobFetch | None, open_stored: Callable[[], OpenBlob]) -> OpenBlob:
    """A blob a mirror fetches: its temp file, read behind the writer; the stored blob once
    it landed."""
    if fetch is None or fetch.landed or fetch.path is None:
        return open_stored()
    try:
        fd = open_fd(fetch.path, follow=False)
    except FileNotFoundError:
        # Renamed into blobs/ between the look and the open: the rename comes before the
        # fetch is marked landed, so the store is asked whatever `landed` says yet (a fetch
        # that failed discarded its file, and the store then answers missing).
        return open_stored()
    return OpenBlob(fd, fetch.size, growing=fetch)


async def cancel_on_disconnect(
    receive: Receive, scope: trio.CancelScope, answered: Callable[[], bool]
) -> None:
    """Read the request's messages (dropping any body) until the client is gone; then cancel
    `scope`, unless the answer was complete (hypercorn says "disconnect" after every answer)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not answered():
                scope.cancel()
            return


async def stream_blob(
    fd: int, offset: int, length: int, send: Send, growing: BlobFetch | None = None
) -> None:
    """Send `length` bytes of `fd` from `offset` as ASGI body messages, where the server
    offers no zero-copy send (TLS, h2, another ASGI server) or the blob is one a mirror is
    still `growing`: then each byte once it is there (and the last once it is verified).

    A reader task preads the next chunk in a worker thread while the current one is being
    sent: the copy out of the page cache (or a disk read) overlaps the socket write, and the
    event loop never blocks on the disk.
    """
    end = offset + length
    chunks_in, chunks_out = trio.open_memory_channel[bytes](1)

    def read(at: int, limit: int) -> bytes:
        return os.pread(fd, min(CHUNK, limit - at), at)

    async def reader() -> None:
        async with chunks_in:
            at = offset
            while at < end:
                if growing is None:
                    chunk = await trio.to_thread.run_sync(read, at, end)
                else:
                    limit = await growing.ready(at, end)
                    recent = growing.cached(at, min(limit, at + CHUNK))
                    if recent is not None:
                        chunk = recent
                    else:
                        chunk = await trio.to_thread.run_sync(read, at, limit)
                if not chunk:
                    raise CorruptBlobError(f"blob ended early at byte {at}")
                at += len(chunk)
                await chunks_in.send(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        sent = 0
        async with chunks_out:
            async for chunk in chunks_out:
                sent += len(chunk)
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": sent < length}
                )


class ZstdCache:
    """Text-like blobs compressed with zstd, the newest ZSTD_CACHE bytes of them kept for the
    next client; cleared when the store changes."""

    def __init__(self) -> None:
        self._packed: OrderedDict[Digest, bytes | None] = OrderedDict()
        self._bytes = 0

    def clear(self) -> None:
        self._packed.clear()
        self._bytes = 0

    async def packed(self, blob: OpenBlob, digest: Digest) -> bytes | None:
        """The blob compressed, or None when that does not save a tenth."""
        if digest in self._packed:
            self._packed.move_to_end(digest)
            return self._packed[digest]

        def compress() -> bytes | None:
            raw = blob.data if blob.data is not None else os.pread(blob.fd, blob.size, 0)
            if len(raw) != blob.size:
                raise CorruptBlobError(f"blob {digest} changed size while read")
            packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
            return packed if len(packed) <= blob.size * 0.9 else None

        packed = await trio.to_thread.run_sync(compress)
        self._packed[digest] = packed
        self._bytes += len(packed or b"")
        while self._bytes > ZSTD_CACHE and self._packed:
            _, old = self._packed.popitem(last=False)
            self._bytes -= len(old or b"")
        return packed
