"""pyfuse3 operations: translate kernel requests into NameTree look-ups and blob reads.

Handlers raise only FUSEError; every store-side failure is turned into an errno in
`_errno_for`, the one place where that mapping lives.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import stat
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from modelfs.fsd.builder import NameTree
from modelfs.fsd.loop import handing_off
from modelfs.fsd.nodes import (
    BlobNode,
    BytesNode,
    CompatNode,
    DirNode,
    MergedNode,
    Node,
    SymlinkNode,
)
from modelfs.runtime.leasing import LiveLease
from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.fileio import open_fd
from modelfs.store.gguf import read_gguf_header_path

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# Names resolve to new content when a tag moves, so the kernel may cache a name only briefly;
# what an inode holds never changes, so its attributes may be cached for long.
NAME_TIMEOUT = 1.0
ATTR_TIMEOUT = 300.0
# What a closed file leaves behind for this long: its blobs' hold in the lease and, with
# passthrough, its backing file. Loaders open a model again right after closing it (a GGUF
# header read, then the mmap); such an open then costs one round trip, not a fsynced lease
# write, a thread hop and a backing open (2.7 ms, as long as mapping 1 GiB warm).
LINGER = 1.0
IMMUTABLE_DIRS = (".blobs", ".by-digest")

USER_NAMESPACE = "user."
XATTR_PREFIX = "user.modelfs."
GGUF_XATTRS = (
    "user.modelfs.gguf.architecture",
    "user.modelfs.gguf.parameter_count",
    "user.modelfs.gguf.file_type",
)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

# FUSE passthrough: the kernel reads a blob-backed file (read, splice, mmap) straight from the
# blob, in the blob's own page cache. It takes a pyfuse3 built by scripts/build-passthrough, a
# kernel >= 6.9 and CAP_SYS_ADMIN; short of that, reads come through the daemon as before.
PASSTHROUGH_API = hasattr(pyfuse3, "backing_open")
# The `type: ignore[attr-defined]`/`[call-arg]` below are for a stock pyfuse3, whose stubs lack
# that build's additions; pyproject.toml lets them go unused where the patched stubs are in.


def _errno_for(exc: BaseException) -> int:
    if isinstance(exc, FileNotFoundError):
        # The blob was collected after its tag moved, and the kernel still holds the old name.
        # ESTALE makes the VFS redo the lookup, which finds the new tree's file.
        return errno.ESTALE
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    if isinstance(exc, StoreError):
        return errno.EIO
    return errno.EIO


def _guarded(
    handler: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Turn anything but FUSEError into EIO plus a log line: pyfuse3 ends its main loop on any
    other exception, and a dead daemon is worse than one failed request."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handing_off(handler(*args, **kwargs))
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            log.error("%s: %s", handler.__name__, exc)
            raise pyfuse3.FUSEError(_errno_for(exc)) from None
        except Exception:
            log.exception("%s failed", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


@dataclass
class _Handle:
    node: Node
    fd: int = -1
    fds: dict[Path, int] = field(default_factory=dict)
    digests: tuple[Digest, ...] = ()  # held in the mount's lease while open
    backing_id: int = 0  # > 0: the kernel reads the blob itself (passthrough)
    served: bool = False  # a blob file whose reads the daemon serves


async def _prepared(node: DirNode) -> None:
    """Do the slow part of filling a directory (see DirNode.prepare) in a worker thread, so
    that other requests go on meanwhile."""
    if node.needs_prepare:
        await trio.to_thread.run_sync(node.prepare)


def _blobs_read(node: Node) -> tuple[Digest, ...]:
    """The blobs a file's reads come from."""
    if isinstance(node, BlobNode):
        return (node.digest,)
    if isinstance(node, MergedNode):
        return node.digests
    if isinstance(node, CompatNode):
        return (node.digest,)
    return ()


class ModelOperations(pyfuse3.Operations):
    """A read-only view of a NameTree; `swap` installs a new tree from the store watcher.

    Every blob a file open through the mount reads from is held in `lease` (the mount's),
    so a GC on any host leaves it alone until the last such file is closed. Files shown as
    symlinks (`--data symlink`) are opened in the store itself, unseen and unleased.
    """

    enable_writeback_cache = False
    # Asked for at INIT by a pyfuse3 with passthrough (others ignore these). Depth 1: blobs may
    # sit on overlayfs (a container's disk); the mount cannot be a layer of an overlayfs.
    enable_passthrough = True
    passthrough_stack_depth = 1

    def __init__(
        self,
        tree: NameTree,
        uid: int,
        gid: int,
        statfs_path: Path,
        lease: LiveLease | None = None,
    ) -> None:
        super().__init__()
        self.tree = tree
        self.nodes: dict[int, Node] = dict(tree.nodes)
        # The kernel's lookup count of each inode it was handed (lookup, readdirplus), so the
        # nodes of replaced trees are let go once it forgets them.
        self._lookups: dict[int, int] = {}
        self._old: set[int] = set()  # inodes kept only because the kernel still knows them
        tree.attach(self)  # what its lazy directories make shows up in self.nodes
        self.uid = uid
        self.gid = gid
        self.statfs_path = statfs_path
        self._handles: dict[int, _Handle] = {}
        self._dir_handles: dict[int, tuple[DirNode, list[tuple[str, Node]]]] = {}
        self._next_fh = itertools.count(1)
        self._gguf_xattrs: dict[int, dict[str, bytes]] = {}
        self.lease = lease
        self.passthrough = False  # granted at INIT; off for good once a backing open gets EPERM
        self._backing: dict[int, list[int]] = {}  # inode -> [backing id, opens using it]
        self._idle_backing: dict[int, float] = {}  # inode -> when its unused id is closed
        self._served: dict[int, int] = {}  # blob file inode -> its opens the daemon serves

    def init(self) -> None:
        self.passthrough = PASSTHROUGH_API and pyfuse3.passthrough_negotiated()  # type: ignore[attr-defined]
        if self.passthrough:
            log.info("FUSE passthrough: the kernel reads blob files itself")
        else:
            log.info("no FUSE passthrough here: the mount serves reads itself")

    def swap(self, tree: NameTree) -> None:
        # Old inodes the kernel still holds (open files, cached dentries) stay resolvable, and
        # their content is unchanged by definition; the others go, with their inode numbers.
        self.tree.retire()
        self.tree = tree
        nodes = dict(tree.nodes)
        old: set[int] = set()
        for inode in self._lookups:
            if inode not in nodes and (node := self.nodes.get(inode)) is not None:
                nodes[inode] = node
                old.add(inode)
        self.nodes, self._old = nodes, old
        for inode in [i for i in self._gguf_xattrs if i not in nodes]:
            del self._gguf_xattrs[inode]
        tree.attach(self)
        tree.retain_inodes(self.nodes)
        # The store changed, a blob may be gone (GC, a quarantine): the next open of an idle
        # inode opens its blob again, with the checks that come with it.
        self._close_idle_backing(all_of_them=True)

    # -- attributes ----------------------------------------------------------------------
    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attrs(self, node: Node, timeout: float = NAME_TIMEOUT) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = timeout
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        # A lazy directory knows its link count unfilled; listing its parent must not fill it.
        a.st_nlink = node.nlink if isinstance(node, DirNode) else max(node.links, 1)
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_rdev = 0
        a.st_size = node.size
        a.st_blksize = 1 << 17
        a.st_blocks = (node.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        return a

    @_guarded
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    @_guarded
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        if not isinstance(parent, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        text = os.fsdecode(name)
        await _prepared(parent)
        child = parent.children.get(text)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        immutable = bool(parent.path) and parent.path[0] in IMMUTABLE_DIRS
        attrs = self._attrs(child, ATTR_TIMEOUT if immutable else NAME_TIMEOUT)
        self._handed_out(child.inode)
        return attrs

    def place(self, node: Node, current: bool) -> None:
        """A node made by filling a lazy directory (see fsd.nodes.NodeSink)."""
        if current:
            self.nodes[node.inode] = node
            self._old.discard(node.inode)
        elif node.inode not in self.nodes:
            self.nodes[node.inode] = node
            self._old.add(node.inode)

    def _handed_out(self, inode: int) -> None:
        self._lookups[inode] = self._lookups.get(inode, 0) + 1

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        # Must not raise (pyfuse3 cannot answer a forget). A node of the served tree stays; one
        # kept only for the kernel goes with its last reference.
        for inode, count in inode_list:
            left = self._lookups.get(inode, 0) - count
            if left > 0:
                self._lookups[inode] = left
                continue
            self._lookups.pop(inode, None)
            if inode in self._old:
                self._old.discard(inode)
                self.nodes.pop(inode, None)
                self._gguf_xattrs.pop(inode, None)

    # -- directories ---------------------------------------------------------------------
    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self._node(inode)
        if not isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        await _prepared(node)
        fh = next(self._next_fh)
        # A listing is a snapshot, so a tree swap mid-listing cannot skip or repeat names.
        self._dir_handles[fh] = (node, sorted(node.children.items()))
        return fh

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node, entries = self._dir_handles[fh]
        immutable = bool(node.path) and node.path[0] in IMMUTABLE_DIRS
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            attrs = self._attrs(child, ATTR_TIMEOUT if immutable else NAME_TIMEOUT)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                return
            self._handed_out(child.inode)  # readdirplus counts as a lookup

    @_guarded
    async def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- files ---------------------------------------------------------------------------
    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self._node(inode)
        if isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        handle = _Handle(node)
        if self.lease is not None and (digests := _blobs_read(node)):
            # On disk before the blob is opened: a GC that starts (on any host) once this
            # open has returned sees it.
            await self.lease.hold(digests)
            handle.digests = digests
        self._close_idle_backing()
        if inode not in self._backing:
            try:
                # In a thread: on a hung NFS store an open blocks, and must not block the mount.
                await trio.to_thread.run_sync(self._open_files, node, handle)
            except OSError as exc:
                self._close(handle)
                log.error("open %s: %s", getattr(node, "path", node.inode), exc)
                raise pyfuse3.FUSEError(_errno_for(exc)) from None
        # No await from here to the reply: an open of the same inode that ran alongside this
        # one (eight ranks loading one model) has settled its way, and this one follows it.
        if isinstance(node, BlobNode):
            shared = self._backing.get(inode)
            if shared is not None and not self.tree.has_blob(node.digest):
                # Another open still reads the blob it had open; a new one may not, once the
                # store no longer has it (a quarantined blob is never served anew).
                self._close(handle)
                raise pyfuse3.FUSEError(errno.ENOENT)
            if shared is not None:
                # The kernel reads this inode from its backing file; the daemon needs no fd.
                shared[1] += 1
                self._idle_backing.pop(inode, None)
                handle.backing_id = shared[0]
            else:
                handle.backing_id = self._backing_for(inode, handle.fd)
                if not handle.backing_id:
                    handle.served = True
                    self._served[inode] = self._served.get(inode, 0) + 1
            if handle.backing_id and handle.fd >= 0:
                os.close(handle.fd)  # the backing id holds the blob open now
                handle.fd = -1
        fh = next(self._next_fh)
        self._handles[fh] = handle
        if handle.backing_id:
            # Reads never reach the mount's page cache, so it need not keep anything.
            return pyfuse3.FileInfo(  # type: ignore[call-arg]
                fh=fh, keep_cache=False, backing_id=handle.backing_id
            )
        # Blob-backed content never changes under an inode, so the page cache may keep it
        # across opens; that is what makes a second read run at memory speed.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    def _backing_for(self, inode: int, fd: int) -> int:
        """The backing id for a new open of a blob file, or 0 to serve its reads here.

        The kernel runs an inode either through its own page cache or passthrough to one
        backing file while any of its files is open (mmaps included): an open that would mix
        the two, or bring a second backing id, fails with EIO. So opens of an inode share one
        id while any is open, and an inode with opens served here gets none until they close.
        """
        if not self.passthrough or self._served.get(inode):
            return 0
        try:
            backing_id: int = pyfuse3.backing_open(fd)  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno == errno.EPERM:
                self.passthrough = False
                log.info(
                    "FUSE passthrough off (%s; it takes CAP_SYS_ADMIN): "
                    "the mount serves reads itself",
                    exc.strerror,
                )
            else:  # e.g. ELOOP: a blob on a stacked filesystem deeper than allowed
                log.debug("no passthrough for inode %d: %s", inode, exc)
            return 0
        self._backing[inode] = [backing_id, 1]
        return backing_id

    def _open_files(self, node: Node, handle: _Handle) -> None:
        if isinstance(node, BlobNode):
            handle.fd = self._open_blob(node.path, node.size)
        elif isinstance(node, CompatNode):
            handle.fd = self._open_blob(node.path, None)
        elif isinstance(node, MergedNode):
            assert node.merged is not None
            for seg in node.merged.segments:
                if seg.path not in handle.fds:
                    handle.fds[seg.path] = self._open_blob(seg.path, None)

    @staticmethod
    def _open_blob(path: Path, size: int | None) -> int:
        fd = open_fd(path, follow=False)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
            os.close(fd)
            raise OSError(errno.EIO, f"{path} changed size or type")
        return fd

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        node = handle.node
        try:
            if isinstance(node, BlobNode):
                # A pread of page-cached data is faster than a thread hop, and FUSE reads are
                # at most 1 MiB, so this stalls other requests only briefly.
                return os.pread(handle.fd, size, off)
            if isinstance(node, BytesNode):
                return node.data[off : off + size]
            if isinstance(node, MergedNode):
                return node.read(handle.fds, off, size)
            if isinstance(node, CompatNode):
                if node.touches_compute(off, size):
                    # A computed tensor is made (or read from its cache file) off the loop.
                    return await trio.to_thread.run_sync(node.read, handle.fd, off, size)
                return node.read(handle.fd, off, size)
        except OSError as exc:
            log.error("read %s at %d: %s", getattr(node, "path", node.inode), off, exc)
            raise pyfuse3.FUSEError(_errno_for(exc)) from None
        raise pyfuse3.FUSEError(errno.EINVAL)

    @_guarded
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None:
            self._close(handle)

    def _close(self, handle: _Handle) -> None:
        if handle.digests and self.lease is not None:
            # Written lazily, and later still: a late drop only keeps more.
            self.lease.drop(handle.digests, linger=LINGER)
        inode = handle.node.inode
        if handle.backing_id:
            shared = self._backing[inode]
            shared[1] -= 1
            if not shared[1]:
                self._idle_backing[inode] = trio.current_time() + LINGER
        elif handle.served:
            left = self._served.pop(inode) - 1
            if left:
                self._served[inode] = left
        if handle.fd >= 0:
            os.close(handle.fd)
        for fd in handle.fds.values():
            os.close(fd)
        self._close_idle_backing()

    def _close_idle_backing(self, *, all_of_them: bool = False) -> None:
        """Let go of backing files no open has used for LINGER seconds."""
        if not self._idle_backing:
            return
        now = trio.current_time()
        for inode, due in list(self._idle_backing.items()):
            if due <= now or all_of_them:
                del self._idle_backing[inode]
                backing_id = self._backing.pop(inode)[0]
                try:
                    pyfuse3.backing_close(backing_id)  # type: ignore[attr-defined]
                except OSError as exc:
                    log.warning("closing backing id %d: %s", backing_id, exc.strerror)

    async def linger(self) -> None:
        """Close idle backing files on time, also when no open or release comes by."""
        while True:
            await trio.sleep(LINGER)
            self._close_idle_backing()

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if not isinstance(node, SymlinkNode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    # -- extended attributes -------------------------------------------------------------
    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        key = os.fsdecode(name)
        if not key.startswith(USER_NAMESPACE):
            # No SELinux labels, no POSIX ACLs: the namespace is unsupported, as on a
            # filesystem mounted without them. `ls -l` remembers that answer per device, so
            # it asks once instead of three times an entry: 60,000 fewer round trips of
            # `ls -lR` over 5,000 models (ENODATA would be asked again for every entry).
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        if not key.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        value = node.xattrs.get(key)
        if value is None and key in GGUF_XATTRS and isinstance(node, BlobNode) and node.gguf:
            value = (await self._gguf(node)).get(key)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        node = self._node(inode)
        names = list(node.xattrs)
        if isinstance(node, BlobNode) and node.gguf:
            names += [k for k in GGUF_XATTRS if k in await self._gguf(node)]
        return [os.fsencode(k) for k in names]

    async def _gguf(self, node: BlobNode) -> dict[str, bytes]:
        """Header-derived attributes, parsed once per blob, off the request thread."""
        values = self._gguf_xattrs.get(node.inode)
        if values is None:
            values = await trio.to_thread.run_sync(_gguf_xattrs, node.path)
            self._gguf_xattrs[node.inode] = values
        return values

    # -- the filesystem ------------------------------------------------------------------
    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        try:
            st = await trio.to_thread.run_sync(os.statvfs, self.statfs_path)
        except OSError as exc:
            log.error("statfs %s: %s", self.statfs_path, exc.strerror)
            raise pyfuse3.FUSEError(errno.EIO) from None
        out = pyfuse3.StatvfsData()
        for attr in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_namemax",
        ):
            setattr(out, attr, getattr(st, attr))
        return out

    # -- everything that would write -----------------------------------------------------
    async def setattr(self, *args: object) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def _erofs(self, *args: object) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    create = write = setxattr = removexattr = _erofs  # type: ignore[assignment]


def _gguf_xattrs(path: Path) -> dict[str, bytes]:
    try:
        header = read_gguf_header_path(path)
    except (OSError, StoreError) as exc:
        log.warning("%s: %s", path, exc)
        return {}
    return {
        "user.modelfs.gguf.architecture": header.architecture.encode(),
        "user.modelfs.gguf.parameter_count": str(header.parameter_count).encode(),
        "user.modelfs.gguf.file_type": header.file_type_name.encode(),
    }
