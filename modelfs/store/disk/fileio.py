"""The one way modelfs opens a file it reads from a store (manifests, v2 links and their
targets, blobs, leases, locks, history, decisions, caches) or beside it (config, token and
key files).

A store is a shared directory that other tools and hosts write into, so what sits at a path
may be anything: a FIFO (whose open blocks until a writer comes, forever), a character device
(`/dev/zero` never ends), a socket, a directory, a link loop. Every open here is made with
`O_NONBLOCK` (which changes nothing for a regular file's reads), checked with `fstat`, and
refused unless it is a regular file; reads stop at the caller's limit. A refusal is an
`OSError` like any other unreadable file, whose message names the kind, so every caller that
reports an unreadable file reports these too, and nothing hangs or fills memory.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file is, in words: "a regular file", "a FIFO", "a character device", …"""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, words in _KINDS:
        if test(mode):
            return words
    return "not a regular file"


class NotRegularFileError(OSError):
    """A path that holds something other than a regular file."""

    def __init__(self, path: str | os.PathLike[str], mode: int) -> None:
        super().__init__(errno.EINVAL, kind_of(mode), os.fspath(path))
        self.kind = kind_of(mode)


def open_stat(
    path: str | os.PathLike[str], *, follow: bool = True, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """A read-only fd of the regular file at `path` (its final symlink followed unless
    `follow` is False; relative to the directory `dir_fd` when given) and the fstat that
    proved it one; NotRegularFileError for anything else, never a blocking open."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket (or a device that is not)
            mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(path, mode) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_fd(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """`open_stat`'s fd alone."""
    return open_stat(path, follow=follow)[0]


def open_binary(path: str | os.PathLike[str], *, follow: bool = True) -> io.BufferedReader:
    """`open(path, "rb")` by the same rule."""
    return os.fdopen(open_fd(path, follow=follow), "rb")


_MORE = 1 << 20  # what each further read asks for, past the size fstat gave


def read_fd(fd: int, size: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes of an open regular file whose fstat gave `size` (one more
    than the limit tells the caller it was too large), without a limit-sized buffer for a
    small file. A scan reads thousands of small files: one os.read each, and no buffered
    file object (whose setup costs three more system calls than the read)."""
    cap = limit + 1
    data = os.read(fd, min(size + 1, cap) if size else cap)
    if len(data) == size or not data or len(data) >= cap:
        return data  # the whole file as fstat sized it (asked for one byte more), or EOF
    # Shorter than fstat said (a network or FUSE file may answer in pieces), or longer
    # (written to since): read on to the end or the limit.
    parts, got = [data], len(data)
    while got < cap and (more := os.read(fd, min(cap - got, _MORE))):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_file_stat(
    path: str | os.PathLike[str], limit: int, *, follow: bool = True, dir_fd: int | None = None
) -> tuple[bytes, os.stat_result]:
    """At most `limit` + 1 bytes of the regular file at `path`, and its fstat."""
    fd, st = open_stat(path, follow=follow, dir_fd=dir_fd)
    try:
        return read_fd(fd, st.st_size, limit), st
    finally:
        os.close(fd)


def read_file(
    path: str | os.PathLike[str] | Path,
    limit: int,
    *,
    follow: bool = True,
    dir_fd: int | None = None,
) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path`."""
    return read_file_stat(path, limit, follow=follow, dir_fd=dir_fd)[0]
