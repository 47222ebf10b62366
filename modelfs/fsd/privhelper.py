"""FUSE passthrough without a privileged mount: a helper that only registers backing files.

The kernel asks CAP_SYS_ADMIN of whoever issues FUSE_DEV_IOC_BACKING_OPEN (linux
fs/fuse/passthrough.c, fuse_backing_open), but the mount parses files that peers wrote (GGUF
and safetensors headers, manifests). So a mount that starts with CAP_SYS_ADMIN and is not root
(systemd/modelfs-mount.service: `User=ollama`, `AmbientCapabilities=CAP_SYS_ADMIN`) splits in
two before it reads anything of the store:

- this helper, spawned first, keeps the capability and does nothing but
  FUSE_DEV_IOC_BACKING_OPEN/CLOSE on the mount's /dev/fuse connection, for file descriptors the
  mount hands it over a Unix socket (SCM_RIGHTS); it checks each one: opened read-only, a
  regular file, and (by /proc/self/fd and a matching stat) inside the store it was started for;
- the mount drops every capability (capset) and goes on as a plain user.

Run as a script with `python -I` (no site, no environment): it imports the standard library
only, so nothing of the store or of site-packages is ever loaded into the privileged process.
The protocol is one datagram each way (SOCK_SEQPACKET): a request `<cI` (op, argument) with at
most one fd, a reply `<ii` (value, errno).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

CAP_SYS_ADMIN = 21
FUSE_DEVICE = os.makedev(10, 229)  # /dev/fuse
# FUSE_DEV_IOC_BACKING_OPEN/CLOSE: _IOW(229, 1, struct fuse_backing_map{i32 fd, u32 flags,
# u64 padding}) and _IOW(229, 2, u32), from linux include/uapi/linux/fuse.h.
_IOC_WRITE = 1
BACKING_OPEN = (_IOC_WRITE << 30) | (16 << 16) | (229 << 8) | 1
BACKING_CLOSE = (_IOC_WRITE << 30) | (4 << 16) | (229 << 8) | 2

REQUEST = struct.Struct("<cI")
REPLY = struct.Struct("<ii")
OP_DEVICE, OP_OPEN, OP_CLOSE = b"D", b"O", b"C"
TIMEOUT = 10.0  # a helper that does not answer is treated as gone


# -- capabilities -------------------------------------------------------------------------------
def effective_capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def wants_helper() -> bool:
    """A non-root process holding CAP_SYS_ADMIN: the systemd unit's mount."""
    return os.geteuid() != 0 and bool(effective_capabilities() & (1 << CAP_SYS_ADMIN))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> None:
    """Empty this process's effective, permitted, inheritable and ambient sets for good."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")
    PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if effective_capabilities():
        raise OSError(errno.EPERM, "capabilities are still held after capset")


# -- the mount's side ---------------------------------------------------------------------------
class HelperGone(OSError):
    pass


class BackingHelper:
    """The mount's end: backing_open/backing_close as pyfuse3's, done by the helper."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self.sock = sock
        self.proc = proc

    @classmethod
    def spawn(cls, store: Path) -> BackingHelper:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, "--store", str(store),
                 "--socket", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env={},
            )  # fmt: skip
        finally:
            theirs.close()
        ours.settimeout(TIMEOUT)
        return cls(ours, proc)

    def _call(self, op: bytes, arg: int, fd: int | None = None) -> int:
        try:
            if fd is None:
                self.sock.send(REQUEST.pack(op, arg))
            else:
                socket.send_fds(self.sock, [REQUEST.pack(op, arg)], [fd])
            reply = self.sock.recv(REPLY.size)
        except OSError as exc:  # a timeout, EPIPE, ECONNRESET
            raise HelperGone(errno.EPERM, f"the passthrough helper is gone ({exc})") from None
        if len(reply) != REPLY.size:
            raise HelperGone(errno.EPERM, "the passthrough helper is gone")
        value: int
        err: int
        value, err = REPLY.unpack(reply)
        if err:
            raise OSError(err, os.strerror(err))
        return value

    def attach(self, fuse_fd: int) -> None:
        """Hand the helper the mount's /dev/fuse connection (once, after the mount is made)."""
        self._call(OP_DEVICE, 0, fuse_fd)

    def backing_open(self, fd: int) -> int:
        return self._call(OP_OPEN, 0, fd)

    def backing_close(self, backing_id: int) -> None:
        self._call(OP_CLOSE, backing_id)

    def close(self) -> None:
        self.sock.close()  # the helper exits at end of file
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fuse_device_fd() -> int:
    """The fd of this process's /dev/fuse connection (libfuse does not hand it out)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == FUSE_DEVICE:
            found.append(int(name))
    if len(found) != 1:
        raise OSError(errno.ENODEV, f"{len(found)} /dev/fuse descriptors open, expected one")
    return found[0]


# -- the helper ---------------------------------------------------------------------------------
class Helper:
    def __init__(self, store: Path) -> None:
        real = os.path.realpath(store)
        # blobs/ may be a symlink to another disk; what is under it is the store's all the same.
        self.roots = {real, os.path.realpath(os.path.join(real, "blobs"))}
        self.fuse_fd = -1
        self.ids: set[int] = set()

    def inside_store(self, fd: int) -> bool:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not any(path.startswith(root.rstrip("/") + "/") for root in self.roots):
            return False
        try:
            there = os.stat(path, follow_symlinks=False)
        except OSError:
            return False  # gone meanwhile, or a name " (deleted)" that is not there
        st = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino)

    def handle(self, op: bytes, arg: int, fds: list[int]) -> int:
        if op not in (OP_DEVICE, OP_OPEN, OP_CLOSE):
            raise OSError(errno.EINVAL, "unknown request")
        if op == OP_DEVICE:
            if self.fuse_fd >= 0 or len(fds) != 1:
                raise OSError(errno.EINVAL, "device already given")
            st = os.fstat(fds[0])
            if not stat.S_ISCHR(st.st_mode) or st.st_rdev != FUSE_DEVICE:
                raise OSError(errno.EINVAL, "not /dev/fuse")
            self.fuse_fd = fds.pop()
            return 0
        if self.fuse_fd < 0:
            raise OSError(errno.ENOTCONN, "no /dev/fuse yet")
        if op == OP_OPEN:
            if len(fds) != 1:
                raise OSError(errno.EINVAL, "one fd per open")
            fd = fds[0]
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                raise OSError(errno.EACCES, "not opened read-only")
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if not self.inside_store(fd):
                raise OSError(errno.EACCES, "not a file of the store")
            # A mutable buffer: then fcntl.ioctl returns the ioctl's value, the backing id.
            backing_id: int = fcntl.ioctl(
                self.fuse_fd, BACKING_OPEN, bytearray(struct.pack("<iIQ", fd, 0, 0))
            )
            if backing_id <= 0:
                raise OSError(errno.EIO, "backing id 0")
            self.ids.add(backing_id)
            return backing_id
        else:
            if arg not in self.ids:
                raise OSError(errno.ENOENT, "not an id of ours")
            fcntl.ioctl(self.fuse_fd, BACKING_CLOSE, bytearray(struct.pack("<I", arg)))
            self.ids.discard(arg)
        return 0

    def serve(self, sock: socket.socket) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, REQUEST.size, 1)
            except ConnectionResetError:
                return
            if not msg:
                return  # the mount is gone
            try:
                if len(msg) != REQUEST.size:
                    raise OSError(errno.EINVAL, "bad request")
                op, arg = REQUEST.unpack(msg)
                reply = REPLY.pack(self.handle(op, arg, fds), 0)
            except OSError as exc:
                reply = REPLY.pack(-1, exc.errno or errno.EIO)
            finally:
                for fd in fds:
                    os.close(fd)
            sock.send(reply)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="modelfs-passthrough-helper")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--socket", type=int, required=True)
    args = p.parse_args(argv)
    PR_SET_NO_NEW_PRIVS = 38
    ctypes.CDLL(None).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    with socket.socket(fileno=args.socket) as sock:
        Helper(args.store).serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
