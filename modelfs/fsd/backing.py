"""FUSE passthrough's backing files: which blob inode the kernel reads from which backing id.

With passthrough the kernel reads a blob-backed file (read, splice, mmap) straight from the
blob, in the blob's own page cache. It takes a pyfuse3 built by scripts/build-passthrough, a
kernel >= 6.9 and CAP_SYS_ADMIN; short of that, reads come through the daemon.

The kernel runs an inode either through its own page cache or passthrough to one backing file
while any of its files is open (mmaps included): an open that would mix the two, or bring a
second backing id, fails with EIO. So the opens of an inode share one id while any is open,
an inode with opens the daemon serves gets none until they close, and an id outlives its last
close by a moment, for the loader that opens a model again right after closing it.
"""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable
from typing import Protocol

import pyfuse3
import trio

log = logging.getLogger(__name__)

PASSTHROUGH_API = hasattr(pyfuse3, "backing_open")
# What turns it on for the environment this modelfs runs in (a venv, pipx, a system Python).
BUILD_COMMAND = f"{sys.executable} -m modelfs build-passthrough"


class BackingFiles(Protocol):
    """Who registers backing files with the kernel: pyfuse3 itself (a mount holding
    CAP_SYS_ADMIN), or the systemd mount's helper (modelfs/fsd/privhelper.py)."""

    def backing_open(self, fd: int) -> int: ...
    def backing_close(self, backing_id: int) -> None: ...


class BackingIds:
    """The backing ids of one mount's blob inodes, and the inodes whose reads it serves."""

    def __init__(self, files: Callable[[], BackingFiles]) -> None:
        self._files = files  # asked at each call: tests stand in for the kernel by patching
        self.enabled = False  # granted at INIT; off for good once a backing open gets EPERM
        self.in_use: dict[int, list[int]] = {}  # inode -> [backing id, opens using it]
        self.idle: dict[int, float] = {}  # inode -> when its unused id is closed
        self.served: dict[int, int] = {}  # inode -> its opens the daemon serves

    def has(self, inode: int) -> bool:
        return inode in self.in_use

    def share(self, inode: int) -> int:
        """The id an open of `inode` shares with its other opens; 0 when it has none."""
        shared = self.in_use.get(inode)
        if shared is None:
            return 0
        shared[1] += 1
        self.idle.pop(inode, None)
        return shared[0]

    def open(self, inode: int, fd: int) -> int:
        """A new backing id for `inode` from the blob open as `fd`, or 0: its reads are then
        served by the daemon (and counted, so no open of it gets an id until they close)."""
        backing_id = self._register(inode, fd) if self.enabled and not self.served.get(inode) else 0
        if backing_id:
            self.in_use[inode] = [backing_id, 1]
        else:
            self.served[inode] = self.served.get(inode, 0) + 1
        return backing_id

    def _register(self, inode: int, fd: int) -> int:
        try:
            return self._files().backing_open(fd)
        except OSError as exc:
            if exc.errno == errno.EPERM:
                self.enabled = False
                log.info(
                    "FUSE passthrough off (%s; it takes CAP_SYS_ADMIN): "
                    "the mount serves reads itself",
                    exc.strerror,
                )
            else:  # e.g. ELOOP: a blob on a stacked filesystem deeper than allowed
                log.debug("no passthrough for inode %d: %s", inode, exc)
            return 0

    def closed(self, inode: int, *, backing_id: int, linger: float) -> None:
        """One open of `inode` closed: by its backing id, or (0) one the daemon served. An id
        no open uses any more is closed `linger` seconds later."""
        if backing_id:
            shared = self.in_use[inode]
            shared[1] -= 1
            if not shared[1]:
                self.idle[inode] = trio.current_time() + linger
        else:
            left = self.served.pop(inode) - 1
            if left:
                self.served[inode] = left

    def close_idle(self, *, all_of_them: bool = False) -> None:
        """Let go of the ids whose moment has passed (all idle ones: the store changed, and
        the next open of such an inode opens its blob again, with its checks)."""
        if not self.idle:
            return
        now = trio.current_time()
        for inode, due in list(self.idle.items()):
            if due <= now or all_of_them:
                del self.idle[inode]
                backing_id = self.in_use.pop(inode)[0]
                try:
                    self._files().backing_close(backing_id)
                except OSError as exc:
                    log.warning("closing backing id %d: %s", backing_id, exc.strerror)
