"""The passthrough helper (modelfs/fsd/privhelper.py): the one process of the systemd mount that
keeps CAP_SYS_ADMIN registers backing files for read-only regular files of its store, and for
nothing else. The helper runs as a real process, spoken to over its socket."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelfs.fsd import privhelper
from modelfs.fsd.privhelper import BackingHelper
from tests.builders import TinyStore
from tests.mounting import MODELFS, fuse
from tests.processes import stop
from tests.test_passthrough import passthrough_missing
from tests.unitmount import UID, capabilities, namespaced_argv, seen_from_outside, unit_settings


@pytest.fixture
def store(tmp_path: Path) -> Path:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"weights of a")
    return tiny.root


@pytest.fixture
def helper(store: Path) -> Iterator[BackingHelper]:
    h = BackingHelper.spawn(store)
    try:
        yield h
    finally:
        h.close()
    assert h.proc.returncode in (0, -9)  # it left at end of file, on its own (or was killed)


def refused(helper: BackingHelper, path: Path, flags: int = os.O_RDONLY) -> int:
    fd = os.open(path, flags)
    try:
        helper.backing_open(fd)
    except OSError as exc:
        return exc.errno or 0
    finally:
        os.close(fd)
    return 0


def a_blob(store: Path) -> Path:
    return next((store / "blobs").iterdir())


def test_nothing_is_registered_before_the_mount_gives_its_device(
    helper: BackingHelper, store: Path
) -> None:
    assert refused(helper, a_blob(store)) == errno.ENOTCONN


def test_only_dev_fuse_is_taken_as_the_device(helper: BackingHelper, store: Path) -> None:
    fd = os.open(a_blob(store), os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            helper.attach(fd)
        assert info.value.errno == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.access("/dev/fuse", os.R_OK | os.W_OK), reason="needs /dev/fuse")
def test_only_read_only_regular_files_of_the_store_reach_the_kernel(
    helper: BackingHelper, store: Path, tmp_path: Path
) -> None:
    # A /dev/fuse connection that is not mounted: what passes the checks gets the kernel's
    # answer for it (no passthrough on this connection), what fails them gets the helper's.
    dev = os.open("/dev/fuse", os.O_RDWR)
    try:
        helper.attach(dev)
        with pytest.raises(OSError) as again:
            helper.attach(dev)  # one connection per helper
        assert again.value.errno == errno.EINVAL
    finally:
        os.close(dev)
    blob = a_blob(store)
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"secret")
    (store / "blobs" / "link").symlink_to(outside)
    assert refused(helper, blob, os.O_RDWR) == errno.EACCES
    assert refused(helper, store / "blobs", os.O_RDONLY | os.O_DIRECTORY) == errno.EINVAL
    assert refused(helper, outside) == errno.EACCES
    assert refused(helper, store / "blobs" / "link") == errno.EACCES  # resolved: outside
    # Renamed out of the store after the open: /proc/self/fd shows where it is now.
    moved = tmp_path / "moved"
    fd = os.open(blob, os.O_RDONLY)
    try:
        blob.rename(moved)
        with pytest.raises(OSError) as info:
            helper.backing_open(fd)
        assert info.value.errno == errno.EACCES
        moved.rename(blob)
        with pytest.raises(OSError) as kernel:
            helper.backing_open(fd)  # passes the checks; this connection has no passthrough
        assert kernel.value.errno not in (errno.EACCES, errno.ENOTCONN, 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        helper.backing_close(7)  # not one it opened
    assert info.value.errno == errno.ENOENT


def test_a_request_of_the_wrong_shape_gets_an_error_not_a_dead_helper(
    helper: BackingHelper, store: Path
) -> None:
    helper.sock.send(b"?")
    assert privhelper.REPLY.unpack(helper.sock.recv(64)) == (-1, errno.EINVAL)
    helper.sock.send(privhelper.REQUEST.pack(b"X", 0))
    assert privhelper.REPLY.unpack(helper.sock.recv(64)) == (-1, errno.EINVAL)
    assert refused(helper, a_blob(store)) == errno.ENOTCONN  # still answering


def test_a_dead_helper_is_eperm_for_the_mount(helper: BackingHelper, store: Path) -> None:
    helper.proc.kill()
    helper.proc.wait()
    assert refused(helper, a_blob(store)) == errno.EPERM  # the mount then serves reads itself


def test_capabilities_dropped_are_gone(tmp_path: Path) -> None:
    # In a child: dropping is for good, and this test process must keep its own.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            privhelper.drop_capabilities()
            ok = privhelper.effective_capabilities() == 0 and not privhelper.wants_helper()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_socket_is_a_seqpacket_pair(helper: BackingHelper) -> None:
    assert helper.sock.type == socket.SOCK_SEQPACKET


# -- the mount as systemd/modelfs-mount.service starts it ------------------------------------
@fuse
@pytest.mark.skipif(bool(passthrough_missing()), reason=passthrough_missing() or "-")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_mount_as_its_unit_starts_it_reads_blobs_by_passthrough() -> None:
    settings = unit_settings()
    assert settings["User"] == "ollama" and settings["AmbientCapabilities"] == "CAP_SYS_ADMIN"
    work = Path(tempfile.mkdtemp(prefix="modelfs-unit-"))
    os.chmod(work, 0o755)
    proc = None
    try:
        tiny = TinyStore(work / "models")
        weights = os.urandom(8 << 20)
        tiny.gguf_model("m:1", payload=weights)
        mnt = work / "mnt"
        mnt.mkdir()
        for d in (tiny.root, mnt):
            subprocess.run(["chown", "-R", f"{UID}:{UID}", str(d)], check=True)
        # ExecStart=, with the unit's Environment=OLLAMA_MODELS pointing at the test's store.
        proc = subprocess.Popen(
            namespaced_argv(work, [MODELFS, "mount", "--allow-other", str(mnt)]),
            env={"OLLAMA_MODELS": str(tiny.root), "PATH": os.environ["PATH"]},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # The mount is in the namespace only; its processes' root shows it to the test.
        seen = seen_from_outside(proc.pid, mnt)
        deadline = time.monotonic() + 20
        while not os.path.ismount(seen):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "not mounted in 20 s"
            time.sleep(0.05)
        with open(f"/proc/{proc.pid}/status") as f:
            uid_line = next(ln for ln in f if ln.startswith("Uid:"))
        assert uid_line.split()[1:] == [str(UID)] * 4
        assert capabilities(proc.pid) == 0  # the mount that parses the store holds nothing
        (helper_pid,) = (int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                         .read_text().split())  # fmt: skip
        assert capabilities(helper_pid) == 1 << privhelper.CAP_SYS_ADMIN

        def daemon_read_bytes() -> int:
            with open(f"/proc/{proc.pid}/io") as f:
                return int(next(ln for ln in f if ln.startswith("rchar:")).split()[1])

        path = seen / "m" / "1" / "model.gguf"
        before = daemon_read_bytes()
        with open(path, "rb") as f, open(path, "rb") as g:
            assert f.read() == weights
            with mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                assert mm[-100:] == weights[-100:]
        assert daemon_read_bytes() - before < len(weights) // 4  # the kernel read the blob
    finally:
        out = ""
        if proc is not None:
            stop(proc)
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            sys.stdout.write(out)
        shutil.rmtree(work, ignore_errors=True)
    assert "backing files registered by the helper" in out
