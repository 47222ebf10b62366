"""`modelfs mount`: wire the store scan, the name tree and pyfuse3 together, and keep the tree
in step with the store while mounted."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pyfuse3
import trio

from modelfs.fsd import heap, loop, privhelper
from modelfs.fsd.builder import NameTree, TreeBuilder
from modelfs.fsd.errors import MountError
from modelfs.fsd.nodes import DirNode, InodeTable
from modelfs.fsd.ops import ModelOperations
from modelfs.runtime.inotify import StoreWatch, WatchError
from modelfs.runtime.leasing import leased
from modelfs.runtime.notify import sd_notify
from modelfs.store.disk.fileio import read_file
from modelfs.store.index import indexfile
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper
from modelfs.store.scan import ScanCache, scan_store
from modelfs.store.units import counted
from modelfs.store.watch import Signature, changed_since, store_signature

log = logging.getLogger(__name__)

POLL_INTERVAL = 1.0  # with a 1 s name timeout, a change shows within 2 s
# A local store is watched by inotify; a look now and then all the same, in case an event
# was missed (a change made under another mount of the same filesystem is still seen).
SAFETY_INTERVAL = 30.0
READ_AHEAD_KB = 1024


def changed_entries(old: NameTree, new: NameTree) -> Iterable[tuple[int, str]]:
    """(parent inode, name) of every entry of `old` that vanished or points elsewhere in `new`.

    Only directories filled in `old` are walked: the kernel cannot have entries of a lazy
    directory nobody looked into. Their counterparts in `new` are filled to compare, so this
    belongs in the thread that built `new`, before it is served.
    """
    stack: list[tuple[DirNode, DirNode | None]] = [(old.root, new.root)]
    while stack:
        node, fresh = stack.pop()
        if not node.loaded:
            continue
        # One whose fill is slow (a huge merged header) is not filled here: its old names
        # are all invalidated instead, which only costs the kernel a lookup.
        fresh_children = fresh.children if fresh is not None and not fresh.needs_prepare else {}
        # A snapshot: the request loop may be filling directories of `old` meanwhile.
        for name, child in list(node._children.items()):
            other = fresh_children.get(name)
            if other is None or other.inode != child.inode:
                yield node.inode, name
            if isinstance(child, DirNode):
                stack.append((child, other if isinstance(other, DirNode) else None))


def _bdi_of(mountpoint: Path) -> str | None:
    """The backing-device name ("0:NN") of a mount, from /proc/self/mountinfo."""
    target = str(mountpoint)
    found = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == target:
                found = fields[2]  # the last mount on that point wins
    return found


def raise_read_ahead(mountpoint: Path) -> None:
    """FUSE reads arrive in read-ahead-sized requests; 1 MiB ones cut the per-request cost."""
    bdi = _bdi_of(mountpoint)
    if bdi is None:
        return
    path = Path("/sys/class/bdi") / bdi / "read_ahead_kb"
    try:
        path.write_text(str(READ_AHEAD_KB))
        log.debug("read_ahead_kb=%d on %s", READ_AHEAD_KB, bdi)
    except OSError as exc:
        log.debug("cannot raise read-ahead (%s): %s", path, exc.strerror)


class Mount:
    def __init__(
        self,
        root: Path,
        mountpoint: Path,
        *,
        prefer: tuple[str, ...],
        data: str = "fuse",
        allow_other: bool = False,
    ) -> None:
        self.layout = Layout(root)
        self.mountpoint = mountpoint.resolve()
        self.builder = TreeBuilder(InodeTable(), prefer=prefer, data=data)
        self.data = data
        self.allow_other = allow_other
        # The store as the served tree's scan saw it; None until the first look after a start
        # (`_scan(first=True)`), which takes none before its scan.
        self._signature: Signature | None = None
        self._scanned_at = 0  # when the start's scan began (wall clock, ns)
        self.watch: StoreWatch | None = None
        # The store's scan index: a start and each rescan re-read only the tag files that changed.
        self.scan_cache = ScanCache.open(self.layout)
        self._rescan_asked = False  # by SIGHUP
        self._waiting = trio.CancelScope()  # the watch loop's current wait, cut short by SIGHUP
        self.helper: privhelper.BackingHelper | None = None

    def _store_readable(self) -> bool:
        try:
            for d in (self.layout.root, self.layout.blobs):
                with os.scandir(d):
                    pass
        except OSError:
            return False
        return True

    def _scan(self, *, first: bool = False) -> NameTree:
        # Taken before the scan, so that a change made meanwhile is in the scan or moves it.
        # Not at a start (a tenth of one on 5,000 models): the first look after it tells by
        # the ctimes whether anything changed since the scan began (`_follow`).
        signature = None if first else store_signature(self.layout)
        self._scanned_at = indexfile.started()
        # A scan and a build make a few hundred thousand objects that all live on; the cyclic
        # collector would walk them again and again meanwhile, for nothing (`_settle` puts them
        # out of its reach once the tree is served).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            index = scan_store(self.layout, self.scan_cache)
            self._signature = signature
            self.models = len(index)
            for problem in index.problems:
                log.debug("problem: %s", problem)
            return self.builder.build(index)
        finally:
            if gc_was_enabled:
                # Out of the collector's reach before it is back: all of it sat in the youngest
                # generation, which the first allocation after `enable` would have walked
                # whole (0.2 s for 5,000 models, at every mount start).
                gc.freeze()
                gc.enable()

    @staticmethod
    def _settle() -> None:
        """Once a new tree is served and the one it replaced let go: collect, then freeze what
        is left, so that the cyclic collector never walks the tree again (a tree holds no
        reference cycles; when a newer one replaces it, reference counting frees it).

        The freeze is undone first. A freeze also takes whatever the request loop held at that
        moment (a request in flight, the exception of an open that failed while a blob was
        being removed, with its traceback, frames and nodes); once that becomes cyclic garbage
        the collector cannot reach it, as a cycle through a frozen object looks alive. Frozen
        for good, that was ~3 KB a store change in scripts/bench/mount-memory (a failed open
        of the removed blob, ~20 objects, at one change in four). Undone at each rebuild, it
        is kept until the next one at most. The collect then also walks what lives as long as
        the process (modules, classes): 15 ms more than the new tree alone for 200 models,
        60 ms more (190 -> 260 ms) for 5,000, whose rescan takes 1.3 s.

        Then what the replaced tree freed goes back to the kernel (fsd.heap).
        """
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        heap.trim()

    def run(self) -> None:
        if not self.mountpoint.exists():
            raise MountError(
                f"mount point {self.mountpoint} does not exist; make it first "
                f"(mkdir -p {shlex.quote(str(self.mountpoint))})"
            )
        if not self.mountpoint.is_dir():
            raise MountError(f"mount point {self.mountpoint} is not a directory")
        if os.path.ismount(self.mountpoint):
            raise MountError(f"{self.mountpoint} is already a mount point")
        heap.one_arena()  # before any thread starts
        # Before anything of the store is read: only the helper keeps CAP_SYS_ADMIN.
        self.helper = self._split_privileges()
        try:
            # Watch first, then scan: a change made meanwhile is in the scan or wakes the watch.
            self.watch = self._open_watch()
            try:
                self._mount_and_serve()
            finally:
                if self.watch is not None:
                    self.watch.close()
        finally:
            if self.helper is not None:
                self.helper.close()

    def _split_privileges(self) -> privhelper.BackingHelper | None:
        """A mount started as a plain user with CAP_SYS_ADMIN (systemd/modelfs-mount.service)
        leaves the capability to a helper that only registers backing files, and drops it."""
        if not privhelper.wants_helper():
            return None
        helper = None
        try:
            helper = privhelper.BackingHelper.spawn(self.layout.root)
        except OSError as exc:
            log.warning("cannot start the passthrough helper: %s", exc)
        try:
            privhelper.drop_capabilities()
        except OSError as exc:
            if helper is not None:
                helper.close()
            raise MountError(f"cannot drop CAP_SYS_ADMIN: {exc.strerror}") from None
        return helper

    def _attach_helper(self) -> None:
        if self.helper is None:
            return
        try:
            self.helper.attach(privhelper.fuse_device_fd())
        except OSError as exc:
            log.warning("passthrough helper: %s", exc.strerror)
            return
        self.ops.helper = self.helper

    def _mount_and_serve(self) -> None:
        st = os.stat(self.layout.root)
        # No local name for the tree: this frame lasts as long as the mount, and would keep
        # the first tree (and its scan) alive beside every later one.
        self.ops = ModelOperations(self._scan(first=True), st.st_uid, st.st_gid, self.layout.root)
        # No tree was replaced, so nothing to collect (`_settle` would walk every object of
        # the process for nothing, 0.2 s for 5,000 models): `_scan` froze it all.
        options = set(pyfuse3.default_options) | {"fsname=modelfs", "subtype=modelfs", "ro"}
        if self.allow_other:
            options.add("allow_other")
        try:
            pyfuse3.init(self.ops, str(self.mountpoint), options)
        except RuntimeError as exc:
            raise MountError(f"cannot mount on {self.mountpoint}: {exc}") from None
        self._attach_helper()  # before INIT, which asks whether passthrough can work
        clean = False
        try:
            trio.run(self._main)
            clean = True
        finally:
            self.ops.tree.save_decisions()
            # After a crash the mount is left in place: readers get "Transport endpoint is not
            # connected", never an empty directory that `rsync --delete` would mirror.
            pyfuse3.close(unmount=clean)

    async def _main(self) -> None:
        # The mount's lease: the blobs of files open through it (GC invariant 3 in
        # docs/architecture.md). A store where it cannot be written (read-only, someone
        # else's) is served all the same.
        async with leased(LeaseKeeper(self.layout, "mount"), strict=False) as lease:
            self.ops.lease = lease
            if self.data == "symlink":
                log.info(
                    "--data symlink: files read through their symlinks are opened in the "
                    "store itself; the mount cannot see them, and its lease does not hold them"
                )
            await self._serve()
        # Unmounted cleanly: the lease file is gone (after a kill -9 it expires by its TTL).

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._signals)
            nursery.start_soon(self._watch)
            nursery.start_soon(self.ops.linger)
            nursery.start_soon(self._make_views)
            nursery.start_soon(trio.to_thread.run_sync, raise_read_ahead, self.mountpoint)
            log.info(
                "mounted %s on %s (%s)",
                self.layout.root,
                self.mountpoint,
                counted(self.models, "model"),
            )
            sd_notify(f"READY=1\nSTATUS=serving {self.layout.root} at {self.mountpoint}")
            if os.environ.get("MODELFS_FUSE_LOOP", "fast") != "trio":  # for comparisons
                loop.install()
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    async def _make_views(self) -> None:
        # Views decided at an earlier mount are made here, off the request loop, so that a
        # first look into `llama.cpp/` does not stall every request while a header is read.
        tree = self.ops.tree
        made = await trio.to_thread.run_sync(tree.make_views)
        if made:
            log.debug("%s made", counted(made, "llama.cpp view"))

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._rescan_asked = True  # kept until a rescan starts, even mid-rescan
                    self._waiting.cancel()
                    continue
                log.info("%s: unmounting", signal.Signals(signum).name)
                sd_notify("STOPPING=1")
                pyfuse3.terminate()
                return

    def _open_watch(self) -> StoreWatch | None:
        try:
            watch = StoreWatch(self.layout)
        except WatchError as exc:
            log.warning("%s; looking for changes every %g s instead", exc, POLL_INTERVAL)
            return None
        if watch.remote:
            log.info(
                "store on %s: changes from other hosts are looked for every %g s",
                watch.remote,
                POLL_INTERVAL,
            )
        return watch

    async def _wait_for_change(self, watch: StoreWatch | None) -> StoreWatch | None:
        """Sleep until inotify reports something or the poll interval is up; returns the watch,
        or None once inotify gave out (then polling alone keeps the view in step)."""
        interval = POLL_INTERVAL if watch is None or watch.remote else SAFETY_INTERVAL
        if self._rescan_asked:  # a SIGHUP during the last rescan
            return watch
        with trio.move_on_after(interval) as self._waiting:
            if watch is None:
                await trio.sleep_forever()
            try:
                await watch.changed()
            except WatchError as exc:
                log.warning("%s; looking for changes every %g s instead", exc, POLL_INTERVAL)
                watch.close()
                return None
        return watch

    async def _watch(self) -> None:
        await self._follow(self.watch)

    async def _follow(self, watch: StoreWatch | None) -> None:
        while True:
            watch = await self._wait_for_change(watch)
            asked, self._rescan_asked = self._rescan_asked, False
            signature = await trio.to_thread.run_sync(store_signature, self.layout)
            if self._served_as(signature) and not asked:
                continue
            if not await trio.to_thread.run_sync(self._store_readable):
                # A store that vanished (unmounted NFS, a renamed dir) is not an empty store.
                if self._signature:
                    log.error(
                        "store %s is gone or unreadable; keeping the last view", self.layout.root
                    )
                self._signature = signature
                continue
            if not await self._rebuild():
                self._signature = signature
                continue
            # Not in `_rebuild`: its frame holds the replaced tree, which must be gone by now.
            self._settle()

    def _served_as(self, signature: Signature) -> bool:
        """Whether the served tree's scan saw the store as `signature` shows it. After a start,
        whose scan took no signature first, the first look answers by the ctimes."""
        if self._signature is None and not changed_since(signature, self._scanned_at):
            self._signature = signature
        return signature == self._signature

    async def _rebuild(self) -> bool:
        """Scan, build and serve a new tree; False (the last good tree kept) if that failed.
        The old tree is a local of this frame only: held across the wait for the next change,
        a mount would keep two trees."""
        old = self.ops.tree
        try:
            tree, stale = await trio.to_thread.run_sync(self._rescan, old)
        except Exception:
            # The view must survive any store state; keep serving the last good tree.
            log.exception("rescan failed; keeping the previous view")
            return False
        self.ops.swap(tree)
        for parent, name in stale:
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_entry_async(parent, os.fsencode(name), ignore_enoent=True)
        log.info("store changed: view rebuilt (%d entries invalidated)", len(stale))
        return True

    def _rescan(self, old: NameTree) -> tuple[NameTree, list[tuple[int, str]]]:
        tree = self._scan()
        return tree, list(changed_entries(old, tree))


MOUNTINFO = "/proc/self/mountinfo"
MAX_MOUNTINFO = 64 << 20


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str = MOUNTINFO) -> set[str]:
    """Every mount point in this process's mount namespace."""
    text = read_file(mountinfo, MAX_MOUNTINFO).decode("utf-8", "surrogateescape")
    return {_unescape(line.split(" ")[4]) for line in text.splitlines() if line.count(" ") >= 5}


def is_mount_point(path: Path) -> bool:
    """Is `path` a mount point? Asked of the kernel's mount table, not of a stat: a FUSE
    mount made without allow_other refuses every other user's lstat, root's too, so
    `os.path.ismount` says no to root of a mount it may unmount. Only the parent is resolved:
    the mount point itself may not answer (a dead daemon: ENOTCONN)."""
    absolute = Path(os.path.abspath(path))
    resolved = os.path.join(os.path.realpath(absolute.parent), absolute.name)
    return resolved in mount_points()


def unmount(mountpoint: Path) -> None:
    """`modelfs umount`: fusermount3 for one's own mount, umount(8) for root of anyone's."""
    if not is_mount_point(mountpoint):
        raise MountError(f"{mountpoint} is not a mount point")
    for cmd in (["fusermount3", "-u", str(mountpoint)], ["umount", str(mountpoint)]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            continue
        if done.returncode == 0:
            return
        last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        error = last[0]
    raise MountError(f"cannot unmount {mountpoint}: {error}")
