"""Checking blobs against their names: hashing, the verify cache, quarantine (README,
"Checking the store"; docs/gc.md says what --quick can and cannot catch).

    check_blob(path, cached, quick=...) -> BlobCheck      one blob, by the same rules as a batch
    check_batch(dir_fd, names, root, ...) -> Batch         many blobs, few Python objects each
    look_batch(dir_fd, look, root) -> Looked               --quick: stat many, compare stamps
    quarantine_blob(layout, name, key) -> Path             out of `blobs/`, by rename

A full check reads a blob once and hashes it with sha256. One that matches its name is recorded
in the verify cache (store.collect.verify_cache) with its stat stamp (inode, size, mtime,
ctime, all in ns) and, for a blob of SAMPLE_FROM bytes or more, the xxh3-128 of a sample of it
(SAMPLE_PIECES pieces spread from its start to its end, together at most a 16th of it); unless
its stamp after the read is not the one at the open, or its ctime is within indexfile.RACY_NS
of the check. A quick check trusts a blob whose stamp still matches its cache entry, after
comparing the xxh3 of the same sample for a large one; any other blob gets a full check. The
stamp holds ctime, which no program can set back: a blob written in place through the
filesystem, even with its mtime put back, no longer matches.
What a quick check cannot see is damage that does not go through the filesystem's write path
(a disk or a network server returning other bytes) outside the sample: a full check reads all.

Everything here is synchronous and holds no global state but a per-thread buffer:
`store.collect.workers` runs `check_batch` and `look_batch` in worker processes, one per core.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import xxhash

from modelfs.store.digest import is_blob_name
from modelfs.store.disk.fileio import open_stat
from modelfs.store.disk.owner import make_dirs
from modelfs.store.index.indexfile import racy
from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

# Small enough that the buffer a read fills stays in a core's L2 cache (1 MiB here) while
# the hash reads it back; big enough that the ~1 us of each read call is lost in its ~30 us
# of copying.
CHUNK = 256 << 10
CACHE_VERSION = 2
# --quick reads a sample of blobs this large or larger (a smaller one costs an open and a
# read whatever is sampled of it, as much as its full check: its stamp alone is compared).
SAMPLE_FROM = 1 << 20
SAMPLE_PIECES = 16
SAMPLE_PIECE = 64 << 10  # at most; and at most 1/256 of the blob, so a sample is <= 1/16 of it

Stamp = tuple[int, int, int, int]  # st_ino, st_size, st_mtime_ns, st_ctime_ns


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Interrupted(Exception):
    """`stop()` said to give up (the caller was cancelled)."""


@dataclass(frozen=True, slots=True)
class FileKey:
    """What must not change for a checked blob to still be the file that was checked (the
    quarantine's guard against moving a good copy put in its place)."""

    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileKey:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


class CacheEntry(NamedTuple):
    """A blob that passed a full check: a tuple, as a store has tens of thousands of them."""

    stamp: Stamp
    sample: str | None  # hex xxh3-128 of sample_pieces(size); None below SAMPLE_FROM
    verified_at: int  # Unix time (s) of that full check


# -- hashing ---------------------------------------------------------------------------------
def sample_pieces(size: int) -> list[tuple[int, int]]:
    """(offset, length) of what --quick reads of a blob of `size` bytes: nothing below
    SAMPLE_FROM, else SAMPLE_PIECES pieces, the first at 0, the last ending at the end."""
    if size < SAMPLE_FROM:
        return []
    piece = min(SAMPLE_PIECE, size // 256)
    step = (size - piece) // (SAMPLE_PIECES - 1)
    return [(i * step, piece) for i in range(SAMPLE_PIECES - 1)] + [(size - piece, piece)]


def sample_hash(fd: int, size: int) -> str | None:
    """xxh3-128 of the sample of a blob of `size` bytes; None if it is shorter than that."""
    xxh = xxhash.xxh3_128()
    view = memoryview(_buffer(CHUNK))
    try:
        for offset, length in sample_pieces(size):
            n = os.preadv(fd, [view[:length]], offset)
            if n != length:
                return None
            xxh.update(view[:n])
    finally:
        view.release()
    return xxh.hexdigest()


@dataclass(slots=True)
class Hashes:
    sha256: str
    size: int  # bytes read
    sample: str | None = None  # xxh3-128 of sample_pieces(size_hint), when asked for


def hash_fd(
    fd: int,
    *,
    size_hint: int = -1,
    sample: bool = False,
    stop: Callable[[], bool] | None = None,
) -> Hashes:
    """sha256 of everything `fd` holds from offset 0, and with `sample` the xxh3 of the
    pieces of it that --quick reads (the same bytes, taken in the same pass). `size_hint`:
    the size fstat gave; a read that returns the last of it and less than a chunk ends the
    pass (the caller's second fstat says whether the file grew meanwhile), which spares a
    small blob a read."""
    if 0 <= size_hint < CHUNK and not sample:
        # A small blob: one read, no buffer views (a store has tens of thousands of these).
        data = os.pread(fd, size_hint, 0)
        return Hashes(hashlib.sha256(data).hexdigest(), len(data))
    sha = hashlib.sha256()
    pieces = sample_pieces(size_hint) if sample else []
    xxh = xxhash.xxh3_128() if pieces else None
    k = 0
    view = memoryview(_buffer(CHUNK))
    buffers = [view]
    pos = 0
    try:
        while n := os.preadv(fd, buffers, pos):
            # A large blob is thousands of chunks: no slice of the buffer for a full one.
            if n == CHUNK:
                sha.update(view)
            else:
                with view[:n] as piece:
                    sha.update(piece)
            end = pos + n
            while k < len(pieces) and pieces[k][0] < end:
                start, length = pieces[k]
                a, b = max(start, pos), min(start + length, end)
                if xxh is not None and a < b:
                    with view[a - pos : b - pos] as part:
                        xxh.update(part)
                if start + length > end:
                    break  # the rest of this piece is in the next chunk
                k += 1
            pos = end
            if pos == size_hint and n < CHUNK:
                break
            if stop is not None and stop():
                raise Interrupted()
    finally:
        view.release()
    whole = xxh is not None and k == len(pieces)
    return Hashes(sha.hexdigest(), pos, xxh.hexdigest() if whole and xxh is not None else None)


_local = threading.local()


def _buffer(chunk: int) -> bytearray:
    """This thread's read buffer: allocating (and faulting in) a buffer per blob cost as much
    as hashing a store's thousands of small blobs."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) != chunk:
        buf = _local.buf = bytearray(chunk)
    return buf


@dataclass(slots=True)
class BlobCheck:
    """What checking one blob found.

    status: `ok`; `corrupt` (its sha256 is not its name); `unreadable` (open or read failed:
    EIO, EACCES, …); `changed` (bytes that do not match, read from a file replaced or
    modified meanwhile: not judged).
    A batch makes one only for a blob that is not `ok`, or on request (`check_blob`).
    """

    name: str
    status: str
    size: int
    key: FileKey | None = None
    actual: str | None = None  # the sha256 hex, when computed and not the name
    error: str | None = None
    sha256_done: bool = False  # a sha256 was computed (full check, or a quick one confirmed)
    xxh3_only: bool = False  # a quick check that needed no sha256
    bytes_read: int = 0
    entry: CacheEntry | None = None  # the cache entry to keep for this blob (None: drop it)
    quarantined: Path | None = None  # where a corrupt blob went, right after its check
    quarantine_error: str | None = None


@dataclass(slots=True)
class Batch:
    """What checking a list of blobs found, in columns by position in the list (a worker
    sends this to its parent: tuples of ints cost little to pickle, objects do):
    `stamps`: the stat stamp of each blob that passed, None for the others (in `problems`);
    `samples`: the sample xxh3 of each large one a full check passed; `kept`: those a quick
    check passed (whose cache entries stay as they were)."""

    stamps: list[Stamp | None] = field(default_factory=list)
    samples: dict[int, str] = field(default_factory=dict)
    kept: list[int] = field(default_factory=list)
    verified_at: int = 0
    problems: list[BlobCheck] = field(default_factory=list)
    bytes: int = 0
    bytes_read: int = 0
    sha256: int = 0
    xxh3_only: int = 0


def check_batch(
    dir_fd: int | None,
    names: list[str],
    root: str,
    cached: list[CacheEntry | None] | None = None,
    *,
    stop: Callable[[], bool] | None = None,
    now: Callable[[], float] = time.time,
) -> Batch:
    """Check `names` in blobs/ (open as `dir_fd`; by path under `root` when None): a full
    check of each, except a blob given a cache entry (`cached`, by position) whose stamp
    still matches, which gets the quick check. A corrupt blob goes to quarantine at once.
    Never raises for a blob that cannot be read; raises Interrupted when `stop()` says so."""
    out = Batch(verified_at=int(now()))
    stamps = out.stamps
    blobs_dir = f"{root}/blobs"
    for i, name in enumerate(names):
        if stop is not None and stop():
            raise Interrupted()
        path = name if dir_fd is not None else f"{blobs_dir}/{name}"
        try:
            fd, st = open_stat(path, follow=False, dir_fd=dir_fd)
        except OSError as exc:
            stamps.append(None)
            out.problems.append(BlobCheck(name, "unreadable", 0, error=_why(exc)))
            continue
        old = cached[i] if cached else None
        try:
            entry, problem = _check_open(
                fd, st, name, path, dir_fd, old, out.verified_at, out, stop
            )
        finally:
            os.close(fd)
        if entry is None:
            stamps.append(None)
        else:
            stamps.append(entry.stamp)
            if entry is old:
                out.kept.append(i)
            elif entry.sample is not None:
                out.samples[i] = entry.sample
        if problem is not None:
            if problem.status == "corrupt":
                _quarantine(Layout(Path(root)), problem)
            out.problems.append(problem)
    return out


def _check_open(
    fd: int,
    st: os.stat_result,
    name: str,
    path: str | os.PathLike[str],
    dir_fd: int | None,
    cached: CacheEntry | None,
    verified_at: int,
    out: Batch,
    stop: Callable[[], bool] | None,
) -> tuple[CacheEntry | None, BlobCheck | None]:
    """One open blob: its cache entry when it passed, or what is wrong with it."""
    size = st.st_size
    out.bytes += size
    stamp = stamp_of(st)
    try:
        if size > CHUNK:
            with contextlib.suppress(OSError):
                # One sequential pass: a larger readahead window. A blob read in one chunk
                # has no use for it, and a store has thousands.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if cached is not None and cached.stamp == stamp:
            if cached.sample is None:
                out.xxh3_only += 1
                return cached, None
            out.bytes_read += sum(n for _, n in sample_pieces(size))
            if sample_hash(fd, size) == cached.sample and stamp_of(os.fstat(fd)) == stamp:
                out.xxh3_only += 1
                return cached, None
            log.info("%s: its sample differs from the last full check; hashing it all", name)
        hashes = hash_fd(fd, size_hint=size, sample=size >= SAMPLE_FROM, stop=stop)
        out.bytes_read += hashes.size
        out.sha256 += 1
        after = os.fstat(fd)
        if hashes.sha256 == name[7:] and hashes.size == size:
            # Good bytes. A cache entry vouches for the file as it is now only if the stamp
            # taken after the read is the one taken at the open (no write meanwhile), and
            # if its ctime is older than RACY_NS: a write within the same ctime tick after
            # the read would leave the stamp as it is (git's "racily clean" rule, as the
            # scan index keeps it). Such a blob passes, and the next quick run hashes it.
            if stamp_of(after) != stamp or racy(after.st_ctime_ns, time.time_ns()):
                return None, None
            return CacheEntry(stamp, hashes.sample, verified_at), None
    except OSError as exc:
        return None, BlobCheck(name, "unreadable", size, error=_why(exc))
    if stamp_of(after) != stamp or hashes.size != size:
        return None, BlobCheck(name, "changed", size, key=FileKey.of(st))
    check = BlobCheck(name, "corrupt", size, key=FileKey.of(st), actual=hashes.sha256)
    check.sha256_done = True
    try:
        # A good copy renamed over it while it was read is not to be judged (nor moved).
        now = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        now = None
    if now is None or now.st_ino != st.st_ino or not stat.S_ISREG(now.st_mode):
        check.status, check.actual = "changed", None
    return None, check


NO_STAMP = (0, 0, 0, 0)  # the stamp of a name with no cache entry: no file has inode 0


class Look(NamedTuple):
    """A run of names as `blobs/` listed them, for a quick check: their cached stamps (4 ints
    a name, 0s for none) and the samples of those that have one, by position in the run."""

    names: list[str]
    cached: array.array[int]
    samples: dict[int, str]


@dataclass(slots=True)
class Looked:
    """What a quick look found of a Look's names, by position: `stamps` as lstat gives them
    now (0s for a name that is not a regular file under a blob name: the scan reports those);
    `changed`: the blobs whose stamp is not the cached one, for a full check; `sampled`: the
    check of those at `sampled_at` whose stamp matched and which have a sample."""

    stamps: array.array[int]
    changed: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # not regular files under blob names
    sampled_at: list[int] = field(default_factory=list)
    sampled: Batch | None = None
    blobs: int = 0  # regular files under blob names
    bytes: int = 0


def look_batch(
    dir_fd: int | None, look: Look, root: str, *, stop: Callable[[], bool] | None = None
) -> Looked:
    """Stat each name of `look` in blobs/ (open as `dir_fd`; by path under `root` when None)
    and compare the stamps with the cached ones: equal lists (the whole run unchanged since it
    was recorded) compare in C. A blob whose stamp matches and that has a sample gets the quick
    check of its sample here; one whose stamp differs is left for a full check."""
    names, cached = look.names, look.cached
    paths = names if dir_fd is not None else [f"{root}/blobs/{n}" for n in names]
    lstat = os.stat
    gone: list[int] = []  # positions lstat failed for (gone since the listing)
    try:
        sts: list[os.stat_result | None] = [
            lstat(p, dir_fd=dir_fd, follow_symlinks=False) for p in paths
        ]
    except OSError:
        sts = [_lstat(p, dir_fd) for p in paths]
        gone = [i for i, st in enumerate(sts) if st is None]
    now: array.array[int] = array.array("q")
    put = now.extend
    for st in sts:
        put(NO_STAMP if st is None else (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    out = Looked(now)
    if now != cached:
        out.changed = _differ(now, cached)
    if gone:  # a blob's full check says what became of it (its stamp may be 0s, as cached)
        out.changed = sorted(set(out.changed).union(gone))
    for i in out.changed:
        st = sts[i]
        if (st is not None and not stat.S_ISREG(st.st_mode)) or not is_blob_name(names[i]):
            out.left.append(i)
            now[4 * i : 4 * i + 4] = array.array("q", NO_STAMP)
    if out.left:
        left = set(out.left)
        out.changed = [i for i in out.changed if i not in left]
    out.blobs = len(names) - len(out.left)
    out.bytes = sum(now[1::4])
    if look.samples:
        # Not a blob whose stamp differs, nor a name that is no blob now (a FIFO, a link, a
        # directory where a large blob was: the scan reports it, as a full run's does).
        skip = set(out.changed).union(out.left)
        out.sampled_at = [i for i in look.samples if i not in skip]
        entries: list[CacheEntry | None] = [
            CacheEntry(_stamp_at(cached, i), look.samples[i], 0) for i in out.sampled_at
        ]
        out.sampled = check_batch(
            dir_fd, [names[i] for i in out.sampled_at], root, entries, stop=stop
        )
    return out


def _lstat(path: str, dir_fd: int | None) -> os.stat_result | None:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None  # gone since it was listed: its full check says so


def _stamp_at(flat: array.array[int], i: int) -> Stamp:
    a, b, c, d = flat[4 * i : 4 * i + 4]
    return (a, b, c, d)


def _differ(now: array.array[int], cached: array.array[int], block: int = 64) -> list[int]:
    """The positions whose stamps differ: blocks of stamps compared whole (in C), and only a
    block that differs looked into (a few changed blobs, or strays, among thousands)."""
    out = []
    step = 4 * block
    for start in range(0, len(now), step):
        a, b = now[start : start + step], cached[start : start + step]
        if a != b:
            out += [
                start // 4 + i
                for i in range(len(a) // 4)
                if a[4 * i : 4 * i + 4] != b[4 * i : 4 * i + 4]
            ]
    return out


def check_blob(
    path: str | os.PathLike[str],
    cached: CacheEntry | None,
    *,
    quick: bool,
    stop: Callable[[], bool] | None = None,
    now: Callable[[], float] = time.time,
    dir_fd: int | None = None,
) -> BlobCheck:
    """Check `blobs/sha256-<hex>` (`path`, relative to the directory `dir_fd` when given)
    against its name, by the rules of a batch; never raises for an unreadable file. The
    caller quarantines a corrupt one."""
    name = os.path.basename(path)
    try:
        fd, st = open_stat(path, follow=False, dir_fd=dir_fd)
    except OSError as exc:
        return BlobCheck(name, "unreadable", 0, error=_why(exc))
    out = Batch()
    try:
        entry, problem = _check_open(
            fd, st, name, path, dir_fd, cached if quick else None, int(now()), out, stop
        )
    finally:
        os.close(fd)
    check = problem or BlobCheck(name, "ok", st.st_size, key=FileKey.of(st), entry=entry)
    check.bytes_read = out.bytes_read
    check.sha256_done = out.sha256 > 0
    check.xxh3_only = out.xxh3_only > 0
    return check


def _quarantine(layout: Layout, check: BlobCheck) -> None:
    """A corrupt blob leaves blobs/ at once (not at the end of a run that may take hours,
    during which it would be served, and a good copy could be put in its place)."""
    try:
        check.quarantined = quarantine_blob(layout, check.name, check.key)
    except OSError as exc:
        check.quarantine_error = f"not quarantined: {exc.strerror or exc}"


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


# -- quarantine --------------------------------------------------------------------------------
def quarantine_blob(layout: Layout, name: str, key: FileKey | None = None) -> Path:
    """Move `blobs/<name>` to `.modelfs/quarantine/<name>` by rename (same filesystem, so no
    byte is copied and no reader of the old file is disturbed). A file already there under that
    name is kept: the new one gets a `.<UTC time>[-N]` suffix. With `ino`, the blob is moved
    only if it is still that file, unchanged (not a good copy renamed over it or restored into
    it since it was checked).
    Raises OSError (read-only store, EXDEV, …) and FileNotFoundError (it is gone)."""
    if not is_blob_name(name):  # never a path out of blobs/, whatever a caller was told
        raise OSError(errno.EINVAL, f"{name!r} is not a blob's name; not moved")
    src = layout.blobs / name
    if key is not None and FileKey.of(os.lstat(src)) != key:
        raise FileNotFoundError(f"{src} was replaced or rewritten since it was checked")
    make_dirs(layout.quarantine, layout.root)
    dst = layout.quarantine / name
    n = 0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    while os.path.lexists(dst):
        n += 1
        dst = layout.quarantine / (f"{name}.{stamp}" + (f"-{n}" if n > 1 else ""))
    os.rename(src, dst)
    with contextlib.suppress(OSError):
        for d in (layout.blobs, layout.quarantine):
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    return dst


def quarantined(layout: Layout) -> list[tuple[str, int]]:
    """(file name, size) of everything in quarantine, sorted by name."""
    out: list[tuple[str, int]] = []
    try:
        with os.scandir(layout.quarantine) as it:
            for de in it:
                with contextlib.suppress(OSError):
                    out.append((de.name, de.stat(follow_symlinks=False).st_size))
    except OSError:
        return []
    return sorted(out)


def drop_quarantined(layout: Layout, blob_name: str) -> list[str]:
    """Delete the quarantined copies of `blob_name` (once a verified copy is back in blobs/);
    returns the names removed."""
    removed = []
    for name, _ in quarantined(layout):
        if name == blob_name or name.startswith(blob_name + "."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(layout.quarantine / name)
                removed.append(name)
    return removed
