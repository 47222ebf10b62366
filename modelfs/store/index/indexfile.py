"""The files of the store's indexes under `.modelfs/` (the scan's, scancache; GC's reach,
reachcache): how they are read, trusted, written, and how a stamp is judged.

A file is marshal data (no code runs on loading it, and it loads 4x faster than pickle,
measured on 9,000 manifests) behind a magic line and a header of its format version, length
and CRC-32. It is used only when it is a regular file owned by us and writable by no one
else: anything else (unreadable, corrupt, truncated, another version, someone else's) is one
log line by the caller and a full read, whose result replaces it. It is written to a temp
name beside it and renamed over: two writers (a mount and an `ls`, or two hosts on NFS) each
leave a whole file, the last rename wins, and every use checks it against the store anyway.
A store we cannot write to (read-only, someone else's) is read without saving.

A stamp is only as fine as the filesystem's clock: two writes within one tick of it can leave
the same stamp. So what changed within RACY_NS of the read that saw it is not kept (it is read
again next time, as git treats a "racily clean" index entry); the margin also covers a network
filesystem's server clock running a little behind ours.
"""

from __future__ import annotations

import errno
import marshal
import os
import stat
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from modelfs.store.disk.owner import write_atomic

Stamp = tuple[int, int, int, int]  # (inode, size, mtime_ns, ctime_ns)

RACY_NS = 2_000_000_000
_HEADER = struct.Struct("<IIQ")  # version, crc32 of the payload, payload length


def stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def started() -> int:
    """The wall clock a read compares stamps with (`racy`); taken before it reads anything."""
    return time.time_ns()


def racy(ctime_ns: int, since_ns: int) -> bool:
    """Whether a change at `ctime_ns` is too close to a read begun at `since_ns` to tell from
    a later one by its stamp."""
    return ctime_ns >= since_ns - RACY_NS


DirKey = tuple[int, int, int]


def dir_key(st: os.stat_result, since_ns: int) -> DirKey | None:
    """What a directory's listing (blobs/) is known by while it stays: its (inode, mtime_ns,
    ctime_ns). A name comes or goes only by a create, rename or unlink in it, each of which
    moves both; the ctime too, as `rsync -a` and `tar -x` put a directory's mtime back. Not
    st_dev: each NFS client numbers it its own way. None within the racy margin of a listing
    begun at `since_ns` (a change then could leave the same key)."""
    if racy(max(st.st_mtime_ns, st.st_ctime_ns), since_ns):
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def store_is_ours(root: str | os.PathLike[str]) -> bool:
    """Whether the store at `root` belongs to this user: only then is an index of it read or
    written. Root working in a user's store (Ollama's service user's) would otherwise leave
    a file of root's there, or load one its user wrote: marshal is no format to read from
    someone else."""
    try:
        return os.stat(root).st_uid == os.geteuid()
    except OSError:
        return False


def read_index(
    path: Path, magic: bytes, version: int, root: str | os.PathLike[str]
) -> tuple[Any, str | None]:
    """The object saved at `path`, and None; or None and why it cannot be used; (None, None)
    when there is no file, or the store `root` is not ours (see store_is_ours)."""
    if not store_is_ours(root):
        return None, None
    try:
        # Never waiting: a FIFO put there would hold the open until a writer came (for ever).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None, "not written by this user alone, so not trusted"
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    head = len(magic) + _HEADER.size
    if len(data) < head or not data.startswith(magic):
        return None, "not an index of this kind"
    saved, crc, length = _HEADER.unpack_from(data, len(magic))
    if saved != version:
        return None, f"format {saved}, not {version}"
    body = memoryview(data)[head:]
    if len(body) != length or zlib.crc32(body) != crc:
        return None, "corrupt (length or checksum)"
    try:
        return marshal.loads(body), None
    except (ValueError, EOFError, TypeError) as exc:
        return None, f"corrupt ({type(exc).__name__})"


def write_index(
    path: Path, magic: bytes, version: int, obj: Any, root: str | os.PathLike[str]
) -> None:
    """Replace `path` with `obj` (raises OSError: the caller decides that it does not matter;
    PermissionError when the store `root` is not ours)."""
    if not store_is_ours(root):
        raise PermissionError(errno.EPERM, "the store belongs to another user")
    body = marshal.dumps(obj)
    header = magic + _HEADER.pack(version, zlib.crc32(body), len(body))
    # A cache: lost, it is rebuilt from the store, so no fsync of 15 MB at every change.
    write_atomic(path, header + body, root, sync=False)
