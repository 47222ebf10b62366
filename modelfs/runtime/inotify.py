"""Wake-ups when a store's names may have changed, from inotify, for whoever rescans on change.

inotify sees what this host's kernel does to the store, nothing a remote NFS client does, so
a store on a network filesystem still needs polling; `StoreWatch.remote` tells which. The
watch covers what `store.watch.store_signature` fingerprints: the store root (a manifests or
blobs dir appearing), each manifests tree down to the model dirs, whose entries are the tag
files, and the blobs dir. A wake-up only says "look again": the caller still compares
signatures, so a spurious or coalesced event costs one cheap fingerprint, never a wrong view.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import struct

import trio

from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_ISDIR = 0x40000000

# Entries coming and going, and files written in place (a manifest rewritten by `ollama cp`).
# Not IN_MODIFY: a blob being downloaded would wake us on every write.
DIR_EVENTS = (
    IN_CREATE
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CLOSE_WRITE
    | IN_ATTRIB
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
ADD_FLAGS = IN_ONLYDIR | IN_DONT_FOLLOW
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
MANIFEST_DEPTH = 3  # top/host/namespace/model: the deepest dir, its entries are tags

# statfs f_type of filesystems whose changes may come from another host, unseen by inotify.
REMOTE_MAGIC = {
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smbfs",
    0x65735546: "fuse",
    0x00C36400: "ceph",
    0x01021997: "9p",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x6B414653: "afs",
    0x5346414F: "afs",
    0x013111A8: "ibrix",
    0x73757245: "coda",
    0x564C: "ncp",
    0xAAD7AAEA: "panfs",
    0x19830326: "fhgfs/beegfs",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
}


class WatchError(Exception):
    """inotify is unavailable here (no instances or watches left, an old kernel)."""


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]


def filesystem_kind(path: str | os.PathLike[str]) -> str | None:
    """The network filesystem `path` lives on ("nfs", "fuse", …), or None for a local one."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return REMOTE_MAGIC.get(buf.f_type & 0xFFFFFFFF)


class StoreWatch:
    """An inotify instance over one store; `changed()` returns once something may have moved."""

    def __init__(self, layout: Layout, *, max_watches: int | None = None) -> None:
        self.layout = layout
        self.remote = filesystem_kind(layout.root)
        self._max = max_watches
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise WatchError(f"inotify: {os.strerror(err)}")
        self._dirs: dict[int, tuple[str, int]] = {}  # wd -> (path, depth below its top; -1 root)
        try:
            if not self._add(str(layout.root), -1):
                raise WatchError(f"inotify: {layout.root} is missing")
            self._add(str(layout.blobs), -1)
            for top in (layout.manifests, layout.manifests_v2):
                self._add_tree(str(top), 0)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> StoreWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def watches(self) -> int:
        return len(self._dirs)

    def _add(self, path: str, depth: int) -> bool:
        """Watch one dir; False when it is not there (it may appear later)."""
        if self._max is not None and len(self._dirs) >= self._max:
            raise WatchError(f"inotify: more than {self._max} dirs to watch")
        # The store, its blobs dir and its manifests trees may be links (to another disk),
        # which the scan follows; below them, a link is not a model dir.
        flags = DIR_EVENTS | (IN_ONLYDIR if depth <= 0 else ADD_FLAGS)
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(path), flags)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return False
            if err == errno.ENOSPC:
                raise WatchError(
                    "inotify: the limit of watches is reached (sysctl fs.inotify.max_user_watches)"
                )
            raise WatchError(f"inotify: {path}: {os.strerror(err)}")
        self._dirs[wd] = (path, depth)
        return True

    def _add_tree(self, top: str, depth: int) -> None:
        stack = [(top, depth)]
        while stack:
            path, d = stack.pop()
            if not self._add(path, d) or d >= MANIFEST_DEPTH:
                continue
            try:
                with os.scandir(path) as it:
                    for de in it:
                        if de.is_dir(follow_symlinks=False):
                            stack.append((de.path, d + 1))
            except OSError:
                continue

    def _drain(self) -> bool:
        """Read every queued event, watch new dirs; True if any event was read."""
        seen = False
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return seen
            seen = True
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = EVENT.unpack_from(data, offset)
                name = data[offset + EVENT.size : offset + EVENT.size + length].rstrip(b"\0")
                offset += EVENT.size + length
                self._apply(wd, mask, os.fsdecode(name))

    def _apply(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            # Events were lost, dirs created meanwhile among them: watch everything again.
            for top in (self.layout.manifests, self.layout.manifests_v2):
                self._add_tree(str(top), 0)
            return
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        where = self._dirs.get(wd)
        if where is None:
            return
        path, depth = where
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and path == str(self.layout.root):
            # Every watch now follows the old dir; a new one at the path would go unseen.
            raise WatchError(f"inotify: {path} was moved or deleted")
        if not (mask & IN_ISDIR) or not (mask & (IN_CREATE | IN_MOVED_TO)):
            return
        child = os.path.join(path, name)
        if depth == -1:
            # A manifests tree or blobs dir made (or moved in) whole after the watch began.
            if child in (str(self.layout.manifests), str(self.layout.manifests_v2)):
                self._add_tree(child, 0)
            elif child == str(self.layout.blobs):
                self._add(child, -1)
        elif depth < MANIFEST_DEPTH:
            self._add_tree(child, depth + 1)

    async def changed(self, settle: float = 0.05, longest: float = 0.5) -> None:
        """Return after the next events, once they pause for `settle` seconds: a pull or an
        `ollama rm` touches several files, and one look after the burst is enough. Never
        later than `longest` after the first: a download that keeps touching its part files
        must not hold back a tag written beside it."""
        while True:
            await trio.lowlevel.wait_readable(self._fd)
            if self._drain():
                break
        with trio.move_on_after(longest):
            while True:
                await trio.sleep(settle)
                if not self._drain():
                    return
