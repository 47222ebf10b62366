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
import platform
import stat
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from modelfs.fsd import privhelper
from modelfs.fsd.backing import BUILD_COMMAND, PASSTHROUGH_API, BackingFiles, BackingIds
from modelfs.fsd.builder import NameTree
from modelfs.fsd.loop import handing_off
from modelfs.fsd.nodes import (
    ROOT_INODE,
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
from modelfs.store.disk.fileio import open_fd
from modelfs.store.errors import StoreError
from modelfs.store.formats.gguf import read_gguf_header_path

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
_DOTS = 2  # every listing starts with `.` and `..`

USER_NAMESPACE = "user."
XATTR_PREFIX = "user.modelfs."
GGUF_XATTRS = (
    "user.modelfs.gguf.architecture",
    "user.modelfs.gguf.parameter_count",
    "user.modelfs.gguf.file_type",
)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

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


# Served reads land in the FUSE file's page cache; the blob's own pages that the daemon read to
# serve them would be a second copy (1 GiB read cached as 2). A read that had to go to the disk
# starts a stream whose blob pages are dropped once copied, for as far as the blob's read-ahead
# may have brought pages in; pages that were cached before (another reader's) are kept, and
# mapped ones are never dropped (POSIX_FADV_DONTNEED skips them). The blob's page cache holds
# folios of up to 2 MiB, and DONTNEED drops only folios wholly inside its range: so whole 2 MiB
# steps, behind the reads.
DROP_AHEAD = 32 << 20
DROP_STEP = 2 << 20


def _read_blob(handle: _Handle, off: int, size: int) -> bytes:
    fd = handle.fd
    if off >= handle.drop_until and size > 0:
        try:
            # Its last byte is cached: the read costs no disk I/O (a miss raises EAGAIN).
            os.preadv(fd, [bytearray(1)], off + size - 1, os.RWF_NOWAIT)
        except BlockingIOError:
            handle.drop_until = off + size
            handle.dropped_to = off - off % DROP_STEP
        except OSError:
            pass  # RWF_NOWAIT unsupported here (EOPNOTSUPP): keep the blob's pages
    # A pread of page-cached data is faster than a thread hop, and FUSE reads are at most
    # 1 MiB, so this stalls other requests only briefly.
    data = os.pread(fd, size, off)
    if off < handle.drop_until and data:
        end = off + len(data)
        handle.drop_until = max(handle.drop_until, end + DROP_AHEAD)
        end -= end % DROP_STEP
        if end > handle.dropped_to:
            os.posix_fadvise(fd, handle.dropped_to, end - handle.dropped_to, os.POSIX_FADV_DONTNEED)
            handle.dropped_to = end
    return data


@dataclass
class _Handle:
    node: Node
    fd: int = -1
    fds: dict[Path, int] = field(default_factory=dict)
    digests: tuple[Digest, ...] = ()  # held in the mount's lease while open
    backing_id: int = 0  # > 0: the kernel reads the blob itself (passthrough)
    served: bool = False  # a blob file whose reads the daemon serves
    drop_until: int = 0  # served reads below this offset leave the blob's page cache
    dropped_to: int = 0  # up to where they have left it


async def _prepared(node: DirNode) -> None:
    """Do the slow part of filling a directory (see DirNode.prepare) in a worker thread, so
    that other requests go on meanwhile."""
    if node.needs_prepare:
        await trio.to_thread.run_sync(node.prepare)


def _link_count(node: Node) -> int:
    if isinstance(node, DirNode):
        return node.nlink
    if isinstance(node, BlobNode):
        return node.count_links()
    return node.links


async def _counted(nodes: Sequence[Node]) -> None:
    """Work out the link counts still pending in a worker thread: a model directory not filled
    yet may read its GGUF's header (whether it gets a `llama.cpp/` view), a blob lays out the
    repositories holding it in other tools' layouts (fsd.tool_dirs)."""
    pending = [
        n
        for n in nodes
        if (isinstance(n, DirNode) and n.nlink_pending)
        or (isinstance(n, BlobNode) and n.links_pending)
    ]
    if pending:
        await trio.to_thread.run_sync(lambda: [_link_count(n) for n in pending])


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
        # Held while a node made outside the request loop is placed, and while trees are swapped.
        self._placing = threading.Lock()
        tree.attach(self)  # what its lazy directories make shows up in self.nodes
        self.uid = uid
        self.gid = gid
        self.statfs_path = statfs_path
        self._handles: dict[int, _Handle] = {}
        self._dir_handles: dict[int, tuple[DirNode, list[tuple[str, Node]]]] = {}
        # The directory each directory inode was last handed out from, for its `..` entry.
        self._parents: dict[int, int] = {}
        self._next_fh = itertools.count(1)
        self._gguf_xattrs: dict[int, dict[str, bytes]] = {}
        self.lease = lease
        self.backing = BackingIds(lambda: self.backing_files)
        self.helper: BackingFiles | None = None  # set by the mount when its helper is up

    @property
    def passthrough(self) -> bool:
        """Granted at INIT; off for good once a backing open gets EPERM."""
        return self.backing.enabled

    @passthrough.setter
    def passthrough(self, on: bool) -> None:
        self.backing.enabled = on

    @property
    def backing_files(self) -> BackingFiles:
        # Looked up at each call: tests stand in for the kernel by patching pyfuse3.
        return self.helper or cast(BackingFiles, pyfuse3)

    def init(self) -> None:
        why = self.passthrough_off()
        self.passthrough = not why
        if self.passthrough:
            via = " (backing files registered by the helper)" if self.helper else ""
            log.info("FUSE passthrough: the kernel reads blob files itself%s", via)
        else:
            log.info("FUSE passthrough off, the mount serves reads itself: %s", why)

    def passthrough_off(self) -> str:
        """Why this mount cannot use FUSE passthrough, in words for its log; "" if it can."""
        if not PASSTHROUGH_API:
            return (
                f"pyfuse3 {pyfuse3.__version__} cannot ask for it; "
                f"to turn it on for this environment: {BUILD_COMMAND}"
            )
        if not pyfuse3.passthrough_negotiated():  # type: ignore[attr-defined]
            return (
                f"the kernel (Linux {platform.release()}) did not offer it at INIT "
                "(it takes Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH)"
            )
        has_cap = privhelper.effective_capabilities() & (1 << privhelper.CAP_SYS_ADMIN)
        if self.helper is None and not has_cap:
            return (
                "backing files take CAP_SYS_ADMIN, which this mount does not hold "
                "(as root it does; systemd/modelfs-mount.service gives it to a helper)"
            )
        return ""

    def swap(self, tree: NameTree) -> None:
        # Old inodes the kernel still holds (open files, cached dentries) stay resolvable, and
        # their content is unchanged by definition; the others go, with their inode numbers.
        with self._placing:  # a worker thread of the old tree may be placing a node
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
        self.backing.close_idle(all_of_them=True)

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
        a.st_nlink = max(_link_count(node), 1)
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
        node = self._node(inode)
        await _counted((node,))  # a rebuild's directories may not have counted theirs yet
        return self._attrs(node)

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
        await _counted((child,))
        immutable = bool(parent.path) and parent.path[0] in IMMUTABLE_DIRS
        attrs = self._attrs(child, ATTR_TIMEOUT if immutable else NAME_TIMEOUT)
        self._handed_out(child.inode)
        if isinstance(child, DirNode):
            self._parents[child.inode] = parent_inode
        return attrs

    def place(self, node: Node, current: Callable[[], bool]) -> None:
        """A node made by filling a lazy directory (see fsd.nodes.NodeSink)."""
        with self._placing:
            if current():
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
            self._parents.pop(inode, None)
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
        # `..` is the directory it was looked up from; the kernel asks for no other's listing.
        parent = self.nodes.get(self._parents.get(inode, ROOT_INODE), node)
        # A listing is a snapshot, so a tree swap mid-listing cannot skip or repeat names.
        entries = sorted(node.children.items())
        await _counted([child for _, child in entries])
        self._dir_handles[fh] = (node, [(".", node), ("..", parent), *entries])
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
            if i < _DOTS:
                continue  # the kernel takes no reference for `.` and `..` (fuse_direntplus_link)
            self._handed_out(child.inode)  # readdirplus counts as a lookup
            if isinstance(child, DirNode):
                self._parents[child.inode] = node.inode

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
        self.backing.close_idle()
        if not self.backing.has(inode):
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
            if self.backing.has(inode) and not self.tree.has_blob(node.digest):
                # Another open still reads the blob it had open; a new one may not, once the
                # store no longer has it (a quarantined blob is never served anew).
                self._close(handle)
                raise pyfuse3.FUSEError(errno.ENOENT)
            # Shared: the kernel reads this inode from its backing file, the daemon needs no fd.
            handle.backing_id = self.backing.share(inode)
            if not handle.backing_id:
                handle.backing_id = self.backing.open(inode, handle.fd)
                handle.served = not handle.backing_id
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

    def _open_files(self, node: Node, handle: _Handle) -> None:
        if isinstance(node, BlobNode):
            handle.fd = self._open_blob(node.path, node.size)
        elif isinstance(node, CompatNode):
            handle.fd = self._open_blob(node.path, None)
        elif isinstance(node, MergedNode):
            if node.check is not None:
                node.check()
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
                return _read_blob(handle, off, size)
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
        if handle.backing_id or handle.served:
            self.backing.closed(handle.node.inode, backing_id=handle.backing_id, linger=LINGER)
        if handle.fd >= 0:
            os.close(handle.fd)
        for fd in handle.fds.values():
            os.close(fd)
        self.backing.close_idle()

    async def linger(self) -> None:
        """Close idle backing files on time, also when no open or release comes by."""
        while True:
            await trio.sleep(LINGER)
            self.backing.close_idle()

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
