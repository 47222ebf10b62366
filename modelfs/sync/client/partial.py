"""A blob being fetched: its temp file, the sidecar of finished byte ranges, and its lock.

For one digest, three files live in `<store>/.modelfs/tmp/` (never in `blobs/`, where Ollama's
prune and readers look), all named from the digest so a later run finds them:

    pull-sha256-<hex>.partial   the blob's bytes, preallocated to full size, written with pwrite
    pull-sha256-<hex>.json      {"digest", "size", "done": [[start, end], ...]}: byte ranges
                                 known to be in the .partial file (fdatasync'd before listing)
    pull-sha256-<hex>.lock      who is fetching it now: a store.lockfile.LockFile, stale when
                                 that pid is gone (same host) or its heartbeat is older than
                                 LOCK_STALE seconds

A run that is killed (kill -9 included) leaves the .partial and .json behind; the next run
takes over the stale lock and fetches only what the sidecar does not list. The sidecar claims
only bytes that were fdatasync'd before it was written, so a power cut cannot make it claim
bytes the file lost. It is a hint, not a proof: the whole blob is hashed again from byte 0
before it is renamed into `blobs/`.

Writes go through `PartialBlob.write`: O_DIRECT for the block-aligned part (from the
page-aligned buffers of an `AlignedPool`), an ordinary pwrite for the rest, or everything
where the filesystem refuses O_DIRECT (tmpfs).

Nothing here imports trio or httpx; the fast path in sync.fastpath drives it from threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from modelfs.store.digest import Digest
from modelfs.store.disk.owner import adopt, make_dirs, write_atomic
from modelfs.store.errors import LockBusyError
from modelfs.store.layout import Layout
from modelfs.store.lockfile import LockFile

log = logging.getLogger(__name__)

SIDECAR_VERSION = 1
LOCK_STALE = 120.0  # seconds without a heartbeat after which another host may take over


class Stopped(Exception):
    """A transfer was asked to stop (cancellation, or a sibling failed)."""


class BlobBusyError(Exception):
    """Another live process is fetching this blob into the same store."""

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.owner = owner


# -- byte ranges ------------------------------------------------------------------------------
class RangeSet:
    """Disjoint, sorted, merged half-open byte ranges. Not thread-safe; callers lock."""

    def __init__(self, ranges: Iterable[Sequence[int]] | None = None) -> None:
        self._r: list[list[int]] = []
        for start, end in ranges or ():
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        out: list[list[int]] = []
        placed = False
        for a, b in self._r:
            if b < start:
                out.append([a, b])
            elif end < a:
                if not placed:
                    out.append([start, end])
                    placed = True
                out.append([a, b])
            else:
                start, end = min(a, start), max(b, end)
        if not placed:
            out.append([start, end])
        self._r = out

    def prefix(self) -> int:
        """How many bytes from offset 0 are covered without a gap."""
        if self._r and self._r[0][0] == 0:
            return self._r[0][1]
        return 0

    def total(self) -> int:
        return sum(b - a for a, b in self._r)

    def end_of(self, pos: int) -> int | None:
        """The end of the range that holds byte `pos`, or None."""
        for a, b in self._r:
            if a <= pos < b:
                return b
            if a > pos:
                break
        return None

    def missing(self, size: int) -> list[tuple[int, int]]:
        """The gaps in [0, size)."""
        gaps, pos = [], 0
        for a, b in self._r:
            if a > pos:
                gaps.append((pos, min(a, size)))
            pos = max(pos, b)
        if pos < size:
            gaps.append((pos, size))
        return [(a, b) for a, b in gaps if b > a]

    def as_list(self) -> list[list[int]]:
        return [list(r) for r in self._r]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and self._r == other._r

    def __repr__(self) -> str:
        return f"RangeSet({self._r})"


def split(ranges: list[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """Cut ranges into pieces of at most `chunk` bytes, in order."""
    out = []
    for a, b in ranges:
        while a < b:
            out.append((a, min(b, a + chunk)))
            a += chunk
    return out


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this


class AlignedPool:
    """A fixed number of page-aligned buffers (anonymous mmaps), handed out and returned.

    The count bounds the memory of a transfer; `get` blocks (polling `stop`) while all are
    out. Buffers are reused for the life of the pool, so their pages are touched once.
    """

    def __init__(self, count: int, size: int) -> None:
        self.size = -(-size // ALIGN) * ALIGN
        self._free = [mmap.mmap(-1, self.size) for _ in range(count)]
        self._cond = threading.Condition()

    def get(self, stop: threading.Event, *, last: Callable[[], bool] | None = None) -> mmap.mmap:
        """A free buffer. The last free one only goes to a caller for whom `last()` is true
        (the receiver the hash is waiting on), so receivers running ahead cannot take every
        buffer and starve the one whose bytes would free them."""
        with self._cond:
            while not (len(self._free) > 1 or (self._free and (last is None or last()))):
                if stop.is_set():
                    raise Stopped()
                self._cond.wait(0.05)
            return self._free.pop()

    def grow(self, count: int) -> None:
        with self._cond:
            self._free.extend(mmap.mmap(-1, self.size) for _ in range(count))
            self._cond.notify(count)

    def put(self, buf: mmap.mmap) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


# -- writeback hint ---------------------------------------------------------------------------
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Callable[..., int] | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _sync_file_range.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux
    _sync_file_range = None


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages now, without waiting for them.

    Without it a 1 GiB blob sits dirty in the page cache until the final fsync, which then
    takes as long again as the transfer did.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


# -- the partial blob -------------------------------------------------------------------------
class PartialBlob:
    """The temp file, sidecar and lock of one blob being fetched. Use `open()`."""

    def __init__(self, layout: Layout, digest: Digest, size: int) -> None:
        self.layout = layout
        self.digest = digest
        self.size = size
        stem = f"pull-{digest.blob_name}"
        self.path = layout.tmp / f"{stem}.partial"
        self.sidecar = layout.tmp / f"{stem}.json"
        self.lock_path = layout.tmp / f"{stem}.lock"
        self.lock = LockFile(self.lock_path, stale_after=LOCK_STALE, store=layout.root)
        self.fd = -1
        self.dfd = -1  # the same file opened O_DIRECT, where the filesystem allows it
        self.done = RangeSet()
        self.resumed = 0  # bytes found finished at open
        self._saved = RangeSet()
        self._io = threading.Lock()  # sidecar writes

    # -- the lock -----------------------------------------------------------------------------
    def _lock(self) -> None:
        try:
            self.lock.acquire()
        except LockBusyError as exc:
            raise BlobBusyError(str(exc)) from None

    def heartbeat(self) -> None:
        """Touch the lock; LockLostError when another process took it over (it judged us
        dead): from then on the temp file is theirs, and nothing we wrote may be trusted."""
        with contextlib.suppress(OSError):
            self.lock.refresh()

    # -- open / resume --------------------------------------------------------------------------
    @classmethod
    def open(cls, layout: Layout, digest: Digest, size: int) -> PartialBlob:
        """Lock the blob and open (or resume) its temp file; BlobBusyError if someone else
        is fetching it, OSError (ENOSPC, …) if the space cannot be reserved."""
        make_dirs(layout.tmp, layout.root)
        p = cls(layout, digest, size)
        p._lock()
        try:
            p._open_file()
        except BaseException:
            p.release()
            raise
        return p

    def _load_sidecar(self) -> RangeSet | None:
        try:
            obj = json.loads(self.sidecar.read_bytes())
            if (
                obj.get("version") != SIDECAR_VERSION
                or obj.get("digest") != str(self.digest)
                or obj.get("size") != self.size
            ):
                return None
            ranges = RangeSet()
            for a, b in obj.get("done", []):
                if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= self.size):
                    return None
                ranges.add(a, b)
            return ranges
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def _open_file(self) -> None:
        done = self._load_sidecar()
        if done is not None:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                done = None
            else:
                if os.fstat(fd).st_size == self.size:
                    self.fd, self.done, self._saved = fd, done, RangeSet(done.as_list())
                    self.resumed = done.total()
                    self._open_direct()
                    log.debug(
                        "resuming %s: %d of %d bytes on disk", self.digest, self.resumed, self.size
                    )
                    return
                os.close(fd)
        # Fresh: a new file, with the space reserved now, so a full disk fails before any
        # byte is fetched rather than in the middle.
        with contextlib.suppress(FileNotFoundError):
            self.sidecar.unlink()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        # An interrupted fetch is resumed by whoever runs next (the daemon as the store's
        # owner, after root's `modelfs pull`): the file must be theirs to open.
        adopt(self.path, self.layout.root)
        try:
            if self.size:
                try:
                    os.posix_fallocate(fd, 0, self.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            raise
        self.fd = fd
        self.done, self._saved, self.resumed = RangeSet(), RangeSet(), 0
        self._open_direct()

    def _open_direct(self) -> None:
        # O_DIRECT: the bytes go from our receive buffer to the disk, with no page-cache
        # pages to allocate, fill and later write back (on this project's VM, buffered
        # writes of a fresh GiB cost 0.2-3.5 s of CPU, direct ones ~0.05 s). tmpfs and some
        # network filesystems refuse it; then every write is an ordinary one.
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return
        try:
            self.dfd = os.open(self.path, os.O_WRONLY | flag)
        except OSError:
            self.dfd = -1

    def write(self, view: memoryview, offset: int) -> None:
        """Write `view` at `offset`: O_DIRECT for the block-aligned part when `view` starts
        a page-aligned buffer (see `AlignedPool`), an ordinary pwrite for the rest."""
        if self.dfd >= 0 and offset % ALIGN == 0:
            aligned = len(view) - len(view) % ALIGN
            if aligned:
                try:
                    _pwrite_all(self.dfd, view[:aligned], offset)
                    view, offset = view[aligned:], offset + aligned
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # A buffer or device the kernel will not do direct I/O with: stop trying.
                    os.close(self.dfd)
                    self.dfd = -1
        _pwrite_all(self.fd, view, offset)

    # -- progress on disk -----------------------------------------------------------------------
    def checkpoint(self, done: RangeSet) -> None:
        """Make `done` (a snapshot taken after those bytes were written) durable: fdatasync
        the data, then replace the sidecar. Called from a thread, never concurrently."""
        with self._io:
            if done == self._saved:
                self.heartbeat()
                return
            os.fdatasync(self.fd)
            body = json.dumps(
                {
                    "version": SIDECAR_VERSION,
                    "digest": str(self.digest),
                    "size": self.size,
                    "done": done.as_list(),
                }
            ).encode()
            write_atomic(self.sidecar, body, self.layout.root)
            self._saved = RangeSet(done.as_list())
            self.heartbeat()

    def chunks(self, start: int, end: int, buf: bytearray) -> Iterator[memoryview]:
        """Read [start, end) of the file back, in pieces of len(buf), into `buf`."""
        view = memoryview(buf)
        pos = start
        while pos < end:
            n = os.preadv(self.fd, [view[: min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"short read from {self.path} at {pos}")
            yield view[:n]
            pos += n

    def discard(self) -> None:
        """Delete the file and sidecar: the next open starts from zero (the lock is kept)."""
        for path in (self.sidecar, self.path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.done, self._saved, self.resumed = RangeSet(), RangeSet(), 0

    def restart(self) -> None:
        """Throw the bytes away and start again with a new, empty file (lock kept)."""
        self.close()
        self.discard()
        self._open_file()

    def close(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        self.close()
        self.lock.release()
