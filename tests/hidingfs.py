"""A passthrough FUSE filesystem that caches like a network filesystem's client, for tests.

    python -m tests.hidingfs SOURCE MOUNTPOINT --hide SECONDS

prints `ready` once mounted and serves until SIGTERM or SIGINT (then unmounts).

What it models is an NFS or sshfs client's directory and attribute caches (sshfs: 20 s by
default; NFS: acdirmin/acdirmax), seen from one host while other hosts write the shared
directory (here: write SOURCE directly):

- a directory's listing is cached for `hide` seconds from when it was read: names that appear
  in SOURCE after that are missing from `readdir` and `lookup` (ENOENT) until the cache
  expires, whether or not the directory is opened again. Names removed from SOURCE disappear
  at once (the stale-positive case only makes a GC refuse, which its own tests cover);
- a file's attributes (mtime, ctime, size) are cached per file for `hide` seconds, except
  that opening the file fetches them afresh, as NFS's close-to-open consistency does;
- what is done through this mount (create, mkdir, rename, link, unlink, utime) is seen by
  this mount at once, as a client sees its own changes.

Kernel caches are off (entry and attribute timeouts 0), so every look reaches this process.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from os import fsdecode, fsencode
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import EntryAttributes, FileInfo, FUSEError, InodeT, RequestContext

T = TypeVar("T")

_ATTRS = (
    "st_mode",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_rdev",
    "st_size",
    "st_atime_ns",
    "st_mtime_ns",
    "st_ctime_ns",
)


@dataclass
class _Listing:
    at: float
    names: set[str] = field(default_factory=set)


def _errno(exc: OSError) -> FUSEError:
    return FUSEError(exc.errno or errno.EIO)


def _do(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args)` with an OSError passed on to the kernel as its errno."""
    try:
        return fn(*args, **kwargs)
    except OSError as exc:
        raise _errno(exc) from None


_TYPE_SHIFT = 47
_REAL_MASK = (1 << _TYPE_SHIFT) - 1


class HidingFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, source: str, hide: float) -> None:
        super().__init__()
        self.source = os.path.realpath(source)
        self.hide = hide
        self.root_ino = os.lstat(self.source).st_ino
        # Both keyed by node id (real inode and type), never by the real inode alone: the
        # real filesystem gives a deleted file's number to the next file made, of any type,
        # and an NFS client's cache is per file handle, which a new file never shares.
        # Keyed by number, a new v2 link was served under the old node's path, or with the
        # cached attributes of the directory or file that had its number before (a link
        # seen as a directory; EIO where the kernel met one node id with two types).
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: self.source}  # node id -> a path
        self.listings: dict[str, _Listing] = {}
        self.attrs: dict[int, tuple[float, os.stat_result]] = {}  # node id -> (when, attrs)
        self.fds: dict[int, int] = {}  # fh -> node id

    # -- inodes and paths ---------------------------------------------------------------------
    # A node id carries the file's type beside its real inode number: the real filesystem
    # reuses a deleted symlink's number for a new regular file, and a kernel that meets one
    # node id with two types marks the old inode bad (EIO for whoever still walks it).
    def _fuse(self, real: int, mode: int) -> InodeT:
        if real == self.root_ino:
            return InodeT(pyfuse3.ROOT_INODE)
        assert real <= _REAL_MASK
        return InodeT(real | (stat.S_IFMT(mode) << _TYPE_SHIFT))

    def _path(self, inode: int) -> str:
        try:
            return self.paths[inode]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._path(parent), fsdecode(name))

    # -- the caches ---------------------------------------------------------------------------
    def _visible(self, directory: str) -> set[str]:
        now = time.monotonic()
        listing = self.listings.get(directory)
        try:
            current = set(os.listdir(directory))
        except OSError as exc:
            raise _errno(exc) from None
        if listing is None or now - listing.at >= self.hide:
            listing = self.listings[directory] = _Listing(now, current)
        return listing.names & current

    def _seen(self, path: str) -> None:
        """A change made through this mount: this mount sees it at once."""
        listing = self.listings.get(os.path.dirname(path))
        if listing is not None:
            listing.names.add(os.path.basename(path))

    def _made(self, path: str) -> EntryAttributes:
        self._seen(path)
        return self._entry(path, fresh=True)

    def _stat(self, path: str, *, fresh: bool = False) -> os.stat_result:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise _errno(exc) from None
        node = self._fuse(st.st_ino, st.st_mode)
        cached = self.attrs.get(node)
        if not fresh and cached is not None and time.monotonic() - cached[0] < self.hide:
            return cached[1]
        self.attrs[node] = (time.monotonic(), st)
        return st

    def _entry(self, path: str, *, fresh: bool = False) -> EntryAttributes:
        st = self._stat(path, fresh=fresh)
        node = self._fuse(st.st_ino, st.st_mode)
        self.paths[node] = path
        entry = EntryAttributes()
        for name in _ATTRS:
            setattr(entry, name, getattr(st, name))
        entry.st_ino = node
        entry.generation = 0
        entry.entry_timeout = 0
        entry.attr_timeout = 0
        entry.st_blksize = 4096
        entry.st_blocks = (st.st_size + 511) // 512
        return entry

    # -- looking ------------------------------------------------------------------------------
    async def lookup(
        self, parent_inode: InodeT, name: bytes, ctx: RequestContext
    ) -> EntryAttributes:
        directory = self._path(parent_inode)
        if fsdecode(name) not in self._visible(directory):
            raise FUSEError(errno.ENOENT)
        return self._entry(os.path.join(directory, fsdecode(name)))

    async def getattr(self, inode: InodeT, ctx: RequestContext | None = None) -> EntryAttributes:
        return self._entry(self._path(inode))

    async def readlink(self, inode: InodeT, ctx: RequestContext) -> bytes:
        return fsencode(_do(os.readlink, self._path(inode)))

    async def opendir(self, inode: InodeT, ctx: RequestContext) -> pyfuse3.FileHandleT:
        return pyfuse3.FileHandleT(inode)

    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        directory = self._path(fh)
        names = sorted(self._visible(directory))
        for i, name in enumerate(names[start_id:], start_id):
            try:
                entry = self._entry(os.path.join(directory, name))
            except FUSEError:
                continue  # gone meanwhile
            if not pyfuse3.readdir_reply(token, fsencode(name), entry, i + 1):
                break

    async def statfs(self, ctx: RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.source)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):  # fmt: skip
            setattr(out, name, getattr(st, name))
        return out

    # -- files --------------------------------------------------------------------------------
    async def open(self, inode: InodeT, flags: int, ctx: RequestContext) -> FileInfo:
        path = self._path(inode)
        try:
            fd = os.open(path, flags & ~os.O_CREAT)
        except OSError as exc:
            raise _errno(exc) from None
        self._stat(path, fresh=True)  # close-to-open: an open revalidates the attributes
        self.fds[fd] = inode
        return FileInfo(fh=pyfuse3.FileHandleT(fd))

    async def create(
        self, parent_inode: InodeT, name: bytes, mode: int, flags: int, ctx: RequestContext
    ) -> tuple[FileInfo, EntryAttributes]:
        path = self._child(parent_inode, name)
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, mode)
        except OSError as exc:
            raise _errno(exc) from None
        self._seen(path)
        entry = self._entry(path, fresh=True)
        self.fds[fd] = entry.st_ino
        return FileInfo(fh=pyfuse3.FileHandleT(fd)), entry

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        n = os.pwrite(fh, buf, off)
        self.attrs.pop(self.fds.get(fh, -1), None)
        return n

    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        pass

    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        os.fsync(fh)

    async def fsyncdir(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        pass

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        self.fds.pop(fh, None)
        os.close(fh)

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        pass

    async def setattr(
        self,
        inode: InodeT,
        attr: EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: pyfuse3.FileHandleT | None,
        ctx: RequestContext,
    ) -> EntryAttributes:
        path = self._path(inode)
        try:
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode), follow_symlinks=False)
            if fields.update_uid or fields.update_gid:
                uid = attr.st_uid if fields.update_uid else -1
                gid = attr.st_gid if fields.update_gid else -1
                os.chown(path, uid, gid, follow_symlinks=False)
            if fields.update_atime or fields.update_mtime:
                old = os.lstat(path)
                atime = attr.st_atime_ns if fields.update_atime else old.st_atime_ns
                mtime = attr.st_mtime_ns if fields.update_mtime else old.st_mtime_ns
                os.utime(path, ns=(atime, mtime), follow_symlinks=False)
        except OSError as exc:
            raise _errno(exc) from None
        return self._entry(path, fresh=True)

    # -- the namespace ------------------------------------------------------------------------
    async def mkdir(
        self, parent_inode: InodeT, name: bytes, mode: int, ctx: RequestContext
    ) -> EntryAttributes:
        path = self._child(parent_inode, name)
        _do(os.mkdir, path, mode)
        return self._made(path)

    async def symlink(
        self, parent_inode: InodeT, name: bytes, target: bytes, ctx: RequestContext
    ) -> EntryAttributes:
        path = self._child(parent_inode, name)
        _do(os.symlink, fsdecode(target), path)
        return self._made(path)

    async def link(
        self, inode: InodeT, new_parent_inode: InodeT, new_name: bytes, ctx: RequestContext
    ) -> EntryAttributes:
        path = self._child(new_parent_inode, new_name)
        _do(os.link, self._path(inode), path, follow_symlinks=False)
        return self._made(path)

    async def unlink(self, parent_inode: InodeT, name: bytes, ctx: RequestContext) -> None:
        _do(os.unlink, self._child(parent_inode, name))

    async def rmdir(self, parent_inode: InodeT, name: bytes, ctx: RequestContext) -> None:
        _do(os.rmdir, self._child(parent_inode, name))

    async def rename(
        self,
        parent_inode_old: InodeT,
        name_old: bytes,
        parent_inode_new: InodeT,
        name_new: bytes,
        flags: int,
        ctx: RequestContext,
    ) -> None:
        if flags:
            raise FUSEError(errno.EINVAL)
        old, new = self._child(parent_inode_old, name_old), self._child(parent_inode_new, name_new)
        try:
            os.rename(old, new)
            st = os.lstat(new)
        except OSError as exc:
            raise _errno(exc) from None
        self._seen(new)
        node = self._fuse(st.st_ino, st.st_mode)
        self.paths[node] = new
        self.attrs.pop(node, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hidingfs")
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--hide", type=float, required=True, help="seconds new entries stay hidden")
    args = ap.parse_args(argv)
    fs = HidingFS(args.source, args.hide)
    options = set(pyfuse3.default_options)
    options.add("fsname=hidingfs")
    options.discard("default_permissions")
    pyfuse3.init(fs, args.mountpoint, options)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:

            async def fuse_main() -> None:
                await pyfuse3.main()  # returns when unmounted from outside
                nursery.cancel_scope.cancel()

            nursery.start_soon(fuse_main)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                print("ready", flush=True)
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
