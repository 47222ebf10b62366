"""A lock file that works on NFS: created with O_EXCL, kept alive by its mtime, taken over
when stale. Used for one GC at a time across hosts and for one fetcher per blob.

`flock` is not used: on NFS it may silently lock nothing. The file holds JSON
{"host", "pid", "token", "since", ...}; its mtime is the heartbeat (on NFS the server's clock
sets it, the same clock every host's lock is measured by).

A lock is stale when its process is gone (same host id, pid not running) or when its heartbeat
is older than `stale_after`. A stale lock is moved aside under a name of our own before a new
one is created, and the moved file is checked to be the one judged stale: two hosts racing to
take over the same stale lock cannot both end up holding it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfs.store.disk.fileio import open_binary
from modelfs.store.disk.owner import adopt, make_dirs
from modelfs.store.errors import LockBusyError, LockLostError


def host_id() -> str:
    """This host's name in locks and leases: $MODELFS_HOST_ID, else the hostname."""
    return os.environ.get("MODELFS_HOST_ID", "").strip() or socket.gethostname()


def incarnation() -> str:
    """This boot and pid namespace: two containers (or cloned VMs) may share a hostname, and
    a pid is only meaningful where both match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) holds nothing.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lock, as its file says."""

    host: str | None
    pid: int | None
    token: str | None
    heartbeat: float  # the file's mtime
    info: dict[str, Any]

    def describe(self, now: float | None = None) -> str:
        age = (now if now is not None else time.time()) - self.heartbeat
        who = f"pid {self.pid} on {self.host}" if self.host else "an unknown process"
        return f"{who} (heartbeat {max(age, 0):.0f}s ago)"


def read_holder(path: Path) -> Holder | None:
    """The lock's holder; None when there is no lock. An unreadable body gives a Holder with
    no host, which goes stale by its heartbeat alone."""
    try:
        with open_binary(path) as f:
            st = os.fstat(f.fileno())
            body = f.read(64 << 10)
    except FileNotFoundError:
        return None
    try:
        info = json.loads(body)
        if not isinstance(info, dict):
            raise ValueError("not an object")
    except ValueError:
        info = {}
    host, pid, token = info.get("host"), info.get("pid"), info.get("token")
    return Holder(
        host if isinstance(host, str) else None,
        pid if isinstance(pid, int) else None,
        token if isinstance(token, str) else None,
        st.st_mtime,
        info,
    )


class LockFile:
    """One O_EXCL lock file. `acquire`, then `refresh` more often than `stale_after`, then
    `release`."""

    def __init__(
        self,
        path: Path,
        *,
        stale_after: float,
        host: str | None = None,
        store: Path | None = None,
        **info: Any,
    ) -> None:
        self.path = path
        self.store = store  # the store root whose owner the lock file gets (store.owner)
        self.stale_after = stale_after
        self.host = host or host_id()
        self.token = secrets.token_hex(8)
        self.info = info
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we created

    def is_stale(self, holder: Holder, now: float | None = None) -> bool:
        now = now if now is not None else time.time()
        if holder.host is None:
            # Empty: its creator died before writing (then nobody will touch it again), or
            # the disk was full and it is alive and touching the file.
            return now - holder.heartbeat > self.stale_after
        same_host = holder.host == self.host
        same_pids = holder.info.get("incarnation", incarnation()) == incarnation()
        pid = holder.pid
        mine = pid is not None and pid == os.getpid()
        if same_host and same_pids and pid is not None and not mine and not pid_alive(pid):
            return True
        return now - holder.heartbeat > self.stale_after

    def acquire(self) -> None:
        """Take the lock, or raise LockBusyError naming its live holder."""
        body = json.dumps(
            {
                "host": self.host,
                "pid": os.getpid(),
                "token": self.token,
                "incarnation": incarnation(),
                "since": time.time(),
                **self.info,
            }
        ).encode()
        if self.store is not None:
            make_dirs(self.path.parent, self.store)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:
                    continue  # released meanwhile
                if not self.is_stale(holder):
                    who = holder.describe()
                    raise LockBusyError(f"{self.path.name} is held by {who}") from None
                self._take_over(holder)
                continue
            try:
                st = os.fstat(fd)
                self._file = (st.st_dev, st.st_ino)
                if self.store is not None:
                    adopt(self.path, self.store)
                try:
                    if os.write(fd, body) != len(body):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # A full disk is when GC is needed most: the lock is ours by its inode
                    # even without its JSON, and others wait `stale_after` for an empty one.
                    os.ftruncate(fd, 0)
            except BaseException:
                self._file = None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # a full disk: no empty lock left behind
                raise
            finally:
                os.close(fd)
            return
        raise LockBusyError(f"{self.path.name} keeps changing hands")

    def _take_over(self, judged: Holder) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = read_holder(aside)
        if moved is not None and (moved.token, moved.heartbeat) != (judged.token, judged.heartbeat):
            # Someone took it over and refreshed it between our look and our move: give it back
            # (link fails if a third party has created a new lock meanwhile; then that one wins
            # and the one we moved finds itself lost at its next refresh).
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)

    def holds(self) -> bool:
        """The lock file is the one we created, and says so (or cannot say otherwise)."""
        if self._file is None:
            return False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) != self._file:
            return False
        holder = read_holder(self.path)
        return holder is not None and holder.token in (self.token, None)

    def refresh(self) -> None:
        """Beat the heartbeat; LockLostError when the file is gone or someone else's."""
        if not self.holds():
            holder = read_holder(self.path)
            who = "removed" if holder is None else f"taken by {holder.describe()}"
            raise LockLostError(f"{self.path.name} was {who}")
        os.utime(self.path)

    def release(self) -> None:
        if self.holds():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._file = None
