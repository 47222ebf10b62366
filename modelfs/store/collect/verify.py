"""Checking blobs against their names: hashing, the verify cache, quarantine (README,
"Checking the store").

    check_blob(path, cached, quick=...) -> BlobCheck      one blob, in one pass over its bytes
    VerifyCache.load(layout) / .save()                     `<store>/.modelfs/verify/cache.json`
    quarantine_blob(layout, name, key) -> Path             out of `blobs/`, by rename

A full check reads a blob once and feeds every chunk to sha256 and to xxh3-128; the xxh3 is
recorded in the cache under the blob's name with the file's inode, size and mtime. A quick
check of a blob whose (inode, size, mtime) still match its cache entry computes xxh3 alone
(tens of GB/s against sha256's one or two) and compares it with the recorded one; a mismatch
is confirmed with sha256 before the blob is called corrupt. So a blob zeroed in place, even with
its mtime put back, is caught by a quick check: every byte is still read.

Everything here is synchronous and thread-safe per call: `sync.verify` runs one `check_blob`
per worker thread (hashlib and xxhash release the GIL while they hash).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from modelfs.store.digest import is_blob_name
from modelfs.store.disk.fileio import open_stat
from modelfs.store.disk.owner import make_dirs, write_atomic
from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

# Small enough that the buffer a read fills stays in a core's L2 cache (1 MiB here) while
# the hashes read it back: an xxh3 pass is as fast as the copy out of the page cache, and a
# 4 MiB buffer spilling to L3 made --quick 10 % slower; big enough that the ~1 us of each
# read call is lost in its ~30 us of copying.
CHUNK = 256 << 10
CACHE_VERSION = 1


class Interrupted(Exception):
    """`stop()` said to give up (the caller was cancelled)."""


@dataclass(frozen=True, slots=True)
class FileKey:
    """What must not change for a cached xxh3 to still describe the file."""

    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileKey:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    key: FileKey
    xxh3: str  # hex of xxh3-128 over the whole file, taken with a sha256 that matched its name
    verified_at: float  # Unix time of that full check

    def as_json(self) -> dict[str, object]:
        return {
            "ino": self.key.ino,
            "size": self.key.size,
            "mtime_ns": self.key.mtime_ns,
            "xxh3": self.xxh3,
            "verified_at": self.verified_at,
        }

    @classmethod
    def from_json(cls, obj: object) -> CacheEntry:
        if not isinstance(obj, dict):
            raise ValueError("entry is not an object")
        ino, size, mtime_ns = obj["ino"], obj["size"], obj["mtime_ns"]
        xxh3, verified_at = obj["xxh3"], obj["verified_at"]
        if not all(type(v) is int for v in (ino, size, mtime_ns)):
            raise ValueError("ino, size and mtime_ns must be integers")
        if not isinstance(xxh3, str) or len(xxh3) != 32:
            raise ValueError("xxh3 must be 32 hex digits")
        int(xxh3, 16)
        if not isinstance(verified_at, int | float):
            raise ValueError("verified_at must be a number")
        return cls(FileKey(ino, size, mtime_ns), xxh3, float(verified_at))


# -- hashing ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Hashes:
    sha256: str | None  # hex; None when only xxh3 was asked for
    xxh3: str
    size: int  # bytes read


def hash_fd(
    fd: int, *, sha256: bool, chunk: int = CHUNK, stop: Callable[[], bool] | None = None
) -> Hashes:
    """xxh3-128, and sha256 when asked, of everything `fd` holds from offset 0, in one pass."""
    sha = hashlib.sha256() if sha256 else None
    xxh = xxhash.xxh3_128()
    view = memoryview(_buffer(chunk))
    buffers = [view]
    pos = 0
    try:
        while n := os.preadv(fd, buffers, pos):
            # A large blob is thousands of chunks: no slice of the buffer for a full one.
            piece = view if n == chunk else view[:n]
            if sha is not None:
                sha.update(piece)
            xxh.update(piece)
            if piece is not view:
                piece.release()
            pos += n
            if stop is not None and stop():
                raise Interrupted()
    finally:
        view.release()
    return Hashes(sha.hexdigest() if sha is not None else None, xxh.hexdigest(), pos)


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
    EIO, EACCES, …); `changed` (replaced or modified while it was read: not judged).
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
    against its name; never raises for an unreadable file."""
    name = os.path.basename(path)
    want = name.removeprefix("sha256-")
    try:
        fd, st = open_stat(path, follow=False, dir_fd=dir_fd)
    except OSError as exc:
        return BlobCheck(name, "unreadable", 0, error=_why(exc))
    try:
        key = FileKey.of(st)
        check = BlobCheck(name, "ok", st.st_size, key=key)
        try:
            if st.st_size > CHUNK:
                with contextlib.suppress(OSError):
                    # One sequential pass: a larger readahead window, and no cache pollution
                    # worth keeping (these bytes are read again only by the next verify). A
                    # blob read in one chunk has no use for it, and a store has thousands.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if quick and cached is not None and cached.key == key:
                hashes = hash_fd(fd, sha256=False, stop=stop)
                check.bytes_read += hashes.size
                if hashes.xxh3 == cached.xxh3 and hashes.size == key.size:
                    check.xxh3_only = True
                    check.entry = cached
                    return _settled(check, fd, path, dir_fd)
                log.info("%s: xxh3 differs from the last full check; confirming with sha256", name)
            hashes = hash_fd(fd, sha256=True, stop=stop)
            check.bytes_read += hashes.size
            check.sha256_done = True
        except OSError as exc:
            check.status, check.error = "unreadable", _why(exc)
            return check
        if hashes.sha256 != want:
            check.status, check.actual = "corrupt", hashes.sha256
        else:
            check.entry = CacheEntry(key, hashes.xxh3, now())
        return _settled(check, fd, path, dir_fd)
    finally:
        os.close(fd)


def _settled(
    check: BlobCheck, fd: int, path: str | os.PathLike[str], dir_fd: int | None
) -> BlobCheck:
    """`changed` if the file was modified, or its name given to another file, while we read."""
    try:
        after = FileKey.of(os.fstat(fd))
        now = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        after, now = None, None
    if after is None or now is None or after != check.key or now.st_ino != after.ino:
        check.status, check.entry, check.actual = "changed", None, None
    return check


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


# -- the cache ---------------------------------------------------------------------------------
class VerifyCache:
    """`<store>/.modelfs/verify/cache.json`: blob name -> CacheEntry. A file that cannot be
    read or parsed is ignored with one warning (every blob then gets a full check)."""

    def __init__(self, layout: Layout, entries: dict[str, CacheEntry] | None = None) -> None:
        self.layout = layout
        self.entries: dict[str, CacheEntry] = entries or {}

    @staticmethod
    def path_for(layout: Layout) -> Path:
        return layout.state / "verify" / "cache.json"

    @property
    def path(self) -> Path:
        return self.path_for(self.layout)

    @classmethod
    def load(cls, layout: Layout) -> VerifyCache:
        path = cls.path_for(layout)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(layout)
        except OSError as exc:
            log.warning("verify cache %s unreadable (%s); ignoring it", path, _why(exc))
            return cls(layout)
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
                raise ValueError(f"not a version {CACHE_VERSION} cache")
            blobs = doc["blobs"]
            if not isinstance(blobs, dict):
                raise ValueError("`blobs` is not an object")
            entries = {
                name: CacheEntry.from_json(obj) for name, obj in blobs.items() if is_blob_name(name)
            }
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("verify cache %s is damaged (%s); ignoring it", path, exc)
            return cls(layout)
        return cls(layout, entries)

    def save(self) -> bool:
        """Write atomically (temp file in the same directory, fsync, rename); False, with a
        warning, where the store cannot be written (a read-only store can still be verified)."""
        path = self.path
        doc = {
            "version": CACHE_VERSION,
            "blobs": {name: e.as_json() for name, e in sorted(self.entries.items())},
        }
        data = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        try:
            write_atomic(path, data, self.layout.root)
        except OSError as exc:
            log.warning("cannot write the verify cache %s: %s", path, _why(exc))
            return False
        return True


# -- quarantine --------------------------------------------------------------------------------
def quarantine_blob(layout: Layout, name: str, key: FileKey | None = None) -> Path:
    """Move `blobs/<name>` to `.modelfs/quarantine/<name>` by rename (same filesystem, so no
    byte is copied and no reader of the old file is disturbed). A file already there under that
    name is kept: the new one gets a `.<UTC time>[-N]` suffix. With `ino`, the blob is moved
    only if it is still that file, unchanged (not a good copy renamed over it or restored into
    it since it was checked).
    Raises OSError (read-only store, EXDEV, …) and FileNotFoundError (it is gone)."""
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
