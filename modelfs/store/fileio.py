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
from typing import BinaryIO

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


def open_fd(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A read-only fd of the regular file at `path` (its final symlink followed unless
    `follow` is False); NotRegularFileError for anything else, never a blocking open."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket (or a device that is not)
            mode = (os.stat if follow else os.lstat)(path).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(path, mode) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: str | os.PathLike[str], *, follow: bool = True) -> io.BufferedReader:
    """`open(path, "rb")` by the same rule."""
    return os.fdopen(open_fd(path, follow=follow), "rb")


def read_open(f: BinaryIO, limit: int) -> bytes:
    """At most `limit` + 1 bytes of an open regular file (one more than the limit tells the
    caller it was too large), without a limit-sized buffer for a small file."""
    size = os.fstat(f.fileno()).st_size
    return f.read(limit + 1 if size > limit or size == 0 else -1)


def read_file(path: str | os.PathLike[str] | Path, limit: int, *, follow: bool = True) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path`."""
    with open_binary(path, follow=follow) as f:
        return read_open(f, limit)
