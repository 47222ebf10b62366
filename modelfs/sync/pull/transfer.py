"""Fetching one blob from a pull's sources: whole when small, through the fast path when large.

    BlobFetcher(layout, options).fetch(name, digest, size, peers, result, live)

Small blobs (under `small_max`, 8 MiB) are fetched whole, through httpx, hashed in memory,
written to a temp file in `.modelfs/tmp/`, fsynced and renamed into `blobs/`
(`BlobStore.put_bytes`). Larger ones go through `sync.partial.PartialBlob` (a preallocated
temp file, a sidecar of finished byte ranges, a lock) and `sync.fastpath.attempt`, one peer at
a time, as `sync.sources.Sources` hands them out. When the sha256 matches, the file is renamed
into `blobs/` with a fresh mtime; when it does not, the temp file is deleted (any byte of it
may be the bad one) and that peer is named a liar. After an interruption (kill -9 included)
the next run resumes: only ranges the sidecar does not list are fetched, with `Range`, and
what is on disk is hashed again from byte 0. A blob already in `blobs/` with another size
counts as missing, and its replacement is renamed over it (never written in place).

A full disk, a read-only store or a permission error is a `LocalWriteError` naming the
store; the temp file is removed (if nothing of it is worth keeping) or left resumable, and
nothing is promoted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable

import trio

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.names import Name
from modelfs.sync.client.partial import AlignedPool, BlobBusyError, PartialBlob
from modelfs.sync.client.peer import PeerClient
from modelfs.sync.errors import LocalWriteError, PeerLiedError, SyncError, local_error
from modelfs.sync.pull.fastpath import Transfer, attempt
from modelfs.sync.pull.options import ModelResult, PullOptions
from modelfs.sync.pull.sources import Sources, one_error

log = logging.getLogger(__name__)


def blob_ok(layout: Layout, digest: Digest, size: int) -> bool:
    """True if `blobs/` holds `digest` as a regular file of `size` bytes."""
    try:
        st = os.stat(layout.blob(digest), follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


async def open_partial(layout: Layout, digest: Digest, size: int) -> PartialBlob | None:
    """Lock and open the blob's temp file (`.modelfs/tmp/pull-<blob>.partial`); None if
    another process (a pull, a mirror) finished the blob while we waited for its lock."""
    said = False
    while True:
        try:
            partial = await trio.to_thread.run_sync(PartialBlob.open, layout, digest, size)
        except BlobBusyError as exc:
            if not said:
                log.info("%s is being fetched by %s; waiting", digest, exc.owner)
                said = True
        except OSError as exc:
            raise local_error(exc, layout, f"blob {digest} ({size} bytes)") from None
        else:
            # The lock may have been freed by a holder that just finished the blob: then
            # the fresh temp file is not needed. A plain call, not a thread hop: a
            # checkpoint here could be cancelled and leak the lock we just took.
            if not blob_ok(layout, digest, size):
                return partial
            partial.discard()
            partial.release()
            return None
        if await trio.to_thread.run_sync(blob_ok, layout, digest, size):
            return None
        await trio.sleep(0.5)


def promote(layout: Layout, partial: PartialBlob) -> None:
    """Rename a temp file whose bytes were hashed to its digest (and fsynced) into `blobs/`."""
    if not partial.lock.holds():
        # Another process took the blob over while we fetched: the file at the path may
        # hold its bytes as well as ours, whatever we hashed. Let the holder finish it.
        raise LocalWriteError(
            f"blob {partial.digest}: another process took over its temp file; not installed"
        )
    try:
        partial.close()
        BlobStore(layout).install(partial.path, partial.digest)
    except OSError as exc:
        raise local_error(exc, layout, f"blob {partial.digest}") from None
    with contextlib.suppress(FileNotFoundError):
        partial.sidecar.unlink()


class BlobFetcher:
    """Fetches single blobs of a store from the peers, verified and renamed into `blobs/`."""

    def __init__(self, layout: Layout, options: PullOptions) -> None:
        self.layout = layout
        self.store = BlobStore(layout)
        self.options = options

    async def fetch(
        self,
        name: Name,
        digest: Digest,
        size: int,
        peers: list[PeerClient],
        result: ModelResult,
        live: dict[Digest, Callable[[], int]],
    ) -> None:
        sources = Sources(peers, self.options.rounds)
        t0 = time.monotonic()
        if size < self.options.small_max:
            await self._fetch_small(name, digest, size, sources, result)
        else:
            await self._fetch_large(name, digest, size, sources, result, live)
        dt = time.monotonic() - t0
        result.fetched += 1
        result.fetched_bytes += size
        log.debug("fetched %s (%d bytes) in %.2f s", digest, size, dt)

    async def _fetch_small(
        self, name: Name, digest: Digest, size: int, sources: Sources, result: ModelResult
    ) -> None:
        while (peer := sources.next()) is not None:
            try:
                data = await peer.blob(name, digest, size)
            except SyncError as exc:
                sources.avoid(peer, exc, result.avoided, digest)
                continue
            peer.session.got(peer.url, len(data))
            await trio.to_thread.run_sync(self._install_bytes, digest, data)
            return
        raise one_error(sources.errors, f"blob {digest}")

    def _install_bytes(self, digest: Digest, data: bytes) -> None:
        # `data` was verified against `digest` on arrival; put_bytes writes, fsyncs, renames.
        try:
            self.store.put_bytes(data)
        except OSError as exc:
            raise local_error(exc, self.layout, f"blob {digest}") from None

    async def _fetch_large(
        self,
        name: Name,
        digest: Digest,
        size: int,
        sources: Sources,
        result: ModelResult,
        live: dict[Digest, Callable[[], int]],
    ) -> None:
        partial = await open_partial(self.layout, digest, size)
        if partial is None:
            return
        opts = self.options
        workers = opts.workers if size >= opts.parallel_min else 1
        pool = AlignedPool(4, min(opts.chunk, size))
        retried_clean = False
        try:
            while (peer := sources.next()) is not None:
                # Bytes already here came from an earlier run, or from a source that failed
                # before this one: if the whole does not hash, this source is not to blame.
                before = partial.done.total()
                gaps = partial.done.missing(size)
                # One GET for each gap; a connection that joins later takes the far end of
                # one, cut in chunk-sized ranges (`fastpath.Transfer.make_room`).
                transfer = Transfer(partial, gaps, pool)
                live[digest] = transfer.completed
                try:
                    with peer.session.receiving(peer.url, transfer.received):
                        got = await attempt(self.layout, opts, name, peer, transfer, workers)
                except SyncError as exc:
                    if isinstance(exc, LocalWriteError):
                        raise
                    sources.avoid(peer, exc, result.avoided, digest)
                    continue
                finally:
                    live.pop(digest, None)
                if got == digest.hex:
                    await trio.to_thread.run_sync(promote, self.layout, partial)
                    return
                # Wrong bytes. Delete them all: any byte may be the bad one.
                await trio.to_thread.run_sync(self._restart, partial)
                if before and not retried_clean:
                    # Part of it came from before this source; that part may be what was wrong.
                    retried_clean = True
                    log.warning(
                        "blob %s hashed to %s with %d bytes that were here before %s sent the "
                        "rest; fetching it whole again",
                        digest,
                        got,
                        before,
                        peer.url,
                    )
                    continue
                lie = PeerLiedError(f"{peer.url}: blob {digest} arrived with sha256 {got}")
                sources.avoid(peer, lie, result.avoided, digest)
            raise one_error(sources.errors, f"blob {digest}")
        finally:
            if partial.done.total() == 0:
                # Not a byte worth resuming from (refused, 401, a digest mismatch): no file.
                partial.close()
                partial.discard()
            partial.release()

    def _restart(self, partial: PartialBlob) -> None:
        try:
            partial.restart()
        except OSError as exc:
            raise local_error(exc, self.layout, f"blob {partial.digest}") from None
