"""FUSE passthrough for blob-backed files: one backing id per inode, never mixed with reads the
daemon serves, and a clean fallback. The mount test needs the pyfuse3 that
scripts/build-passthrough makes, root, and a kernel >= 6.9."""

from __future__ import annotations

import errno
import gzip
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

import modelfs.fsd.ops as fsd_ops
from modelfs.fsd.backing import PASSTHROUGH_API
from modelfs.fsd.builder import TreeBuilder
from modelfs.fsd.nodes import BlobNode, InodeTable
from modelfs.fsd.ops import ModelOperations
from modelfs.store.digest import Digest
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.mounting import fuse, mounted


class FakeKernel:
    """pyfuse3's backing_open/backing_close, as the kernel answers them."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.open_ids: set[int] = set()
        self.calls = 0
        self.next_id = 1

    def backing_open(self, fd: int) -> int:
        self.calls += 1
        os.fstat(fd)  # a real, open fd
        if self.fail:
            raise OSError(self.fail, os.strerror(self.fail))
        self.next_id += 1
        self.open_ids.add(self.next_id)
        return self.next_id

    def backing_close(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel()
    # A backing id goes at the last release, unless a test is about lingering.
    monkeypatch.setattr(fsd_ops, "LINGER", 0.0)
    monkeypatch.setattr(pyfuse3, "backing_open", k.backing_open, raising=False)
    monkeypatch.setattr(pyfuse3, "backing_close", k.backing_close, raising=False)
    # pyfuse3 without passthrough has no FileInfo.backing_id
    monkeypatch.setattr(pyfuse3, "FileInfo", lambda **kw: types.SimpleNamespace(**kw))
    return k


def blob_ops(tmp_path: Path) -> tuple[ModelOperations, BlobNode, BlobNode]:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"weights of a")
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    ops = ModelOperations(tree, 0, 0, tiny.root)
    ops.passthrough = True  # as INIT grants it
    _ = tree.root.children[".blobs"].children  # blob nodes are made when first shown
    one, two = list(tree.blob_nodes.values())[:2]
    for node in (one, two):
        ops._handed_out(node.inode)  # as by the kernel's lookup: kept across a swap
    return ops, one, two


async def opened(ops: ModelOperations, node: BlobNode) -> Any:
    return await ops.open(node.inode, os.O_RDONLY, None)  # type: ignore[arg-type]


async def test_opens_of_an_inode_share_one_backing_id(tmp_path: Path, kernel: FakeKernel) -> None:
    ops, one, two = blob_ops(tmp_path)
    a, b, c = await opened(ops, one), await opened(ops, one), await opened(ops, two)
    assert a.backing_id == b.backing_id != c.backing_id
    assert not a.keep_cache
    assert kernel.calls == 2 and len(kernel.open_ids) == 2
    await ops.release(a.fh)
    assert a.backing_id in kernel.open_ids  # b still uses it
    await ops.release(b.fh)
    await ops.release(c.fh)
    assert not kernel.open_ids and not ops.backing.in_use


async def test_opens_at_the_same_time_share_one_backing_id(
    tmp_path: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Eight ranks open one model together: each open's blob open runs in a thread, and a
    # second backing id for the inode would fail that open with EIO in the kernel.
    ops, one, _ = blob_ops(tmp_path)
    real = ops._open_files

    def slow(node: Any, handle: Any) -> None:
        time.sleep(0.05)
        real(node, handle)

    monkeypatch.setattr(ops, "_open_files", slow)
    infos: list[Any] = []

    async def open_one() -> None:
        infos.append(await opened(ops, one))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(open_one)
    assert len({i.backing_id for i in infos}) == 1 and kernel.calls == 1
    assert all(h.fd == -1 for h in ops._handles.values())  # no fd left behind
    for info in infos:
        await ops.release(info.fh)
    assert not kernel.open_ids and not ops.backing.in_use


async def test_a_closed_file_leaves_its_backing_id_a_moment(
    tmp_path: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsd_ops, "LINGER", 0.3)
    ops, one, _ = blob_ops(tmp_path)
    a = await opened(ops, one)
    await ops.release(a.fh)
    assert a.backing_id in kernel.open_ids
    # Opened again at once: the same id, no backing open, no blob opened by the daemon.
    monkeypatch.setattr(ops, "_open_files", None)  # would raise if called
    b = await opened(ops, one)
    assert b.backing_id == a.backing_id and kernel.calls == 1
    await ops.release(b.fh)
    await trio.sleep(0.2)
    ops.backing.close_idle()
    assert a.backing_id in kernel.open_ids  # b's release started the moment again
    with trio.move_on_after(1):
        await ops.linger()  # closes it on time without another open or release
    assert not kernel.open_ids and not ops.backing.in_use and not ops.backing.idle


async def test_a_blob_gone_from_the_store_is_not_opened_anew_through_a_shared_id(
    tmp_path: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsd_ops, "LINGER", 60.0)
    ops, one, two = blob_ops(tmp_path)
    store = one.path.parent.parent
    a = await opened(ops, one)
    b = await opened(ops, two)
    await ops.release(b.fh)
    assert len(kernel.open_ids) == 2  # b's id idles, a's is in use
    # verify quarantines the blob `one` reads; the mount's rescan swaps the tree in.
    quarantine = tmp_path / "quarantine"
    quarantine.mkdir()
    one.path.rename(quarantine / one.path.name)
    inodes = ops.tree._build.inodes  # type: ignore[union-attr]  # the mount's, kept
    ops.swap(TreeBuilder(inodes).build(scan_store(store)))
    assert kernel.open_ids == {a.backing_id}  # the idle id went with the swap
    with pytest.raises(pyfuse3.FUSEError) as info:
        await opened(ops, one)
    assert info.value.errno == errno.ENOENT
    await ops.release(a.fh)
    c = await opened(ops, two)  # still in the store: opened again, with its checks
    assert c.backing_id and kernel.calls == 3
    await ops.release(c.fh)


async def test_eperm_turns_passthrough_off_for_good(tmp_path: Path, kernel: FakeKernel) -> None:
    ops, one, two = blob_ops(tmp_path)
    kernel.fail = errno.EPERM
    a = await opened(ops, one)
    assert not hasattr(a, "backing_id") and a.keep_cache
    assert not ops.passthrough
    b = await opened(ops, two)
    assert not hasattr(b, "backing_id") and kernel.calls == 1
    assert await ops.read(b.fh, 0, 5) == two.path.read_bytes()[:5]
    await ops.release(a.fh)
    await ops.release(b.fh)
    assert not ops.backing.served


async def test_an_inode_served_here_gets_no_backing_id_until_closed(
    tmp_path: Path, kernel: FakeKernel
) -> None:
    # Mixing would fail the open with EIO in the kernel.
    ops, one, _ = blob_ops(tmp_path)
    kernel.fail = errno.ELOOP  # this blob's filesystem is stacked too deep
    a = await opened(ops, one)
    kernel.fail = 0
    b = await opened(ops, one)
    assert not hasattr(b, "backing_id") and kernel.calls == 1 and ops.passthrough
    await ops.release(a.fh)
    await ops.release(b.fh)
    c = await opened(ops, one)
    assert c.backing_id and kernel.calls == 2
    await ops.release(c.fh)
    assert not kernel.open_ids


async def test_a_shared_id_outlives_passthrough_being_turned_off(
    tmp_path: Path, kernel: FakeKernel
) -> None:
    ops, one, two = blob_ops(tmp_path)
    a = await opened(ops, one)
    kernel.fail = errno.EPERM
    await opened(ops, two)
    assert not ops.passthrough
    b = await opened(ops, one)  # still the inode's id: a plain open would fail with EIO
    assert b.backing_id == a.backing_id


async def test_without_passthrough_nothing_changes(tmp_path: Path, kernel: FakeKernel) -> None:
    ops, one, _ = blob_ops(tmp_path)
    ops.passthrough = False
    a = await opened(ops, one)
    assert a.keep_cache and not hasattr(a, "backing_id") and kernel.calls == 0


def kernel_has_passthrough() -> bool:
    """CONFIG_FUSE_PASSTHROUGH, from the kernel's own config when it shows it."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return any(line.strip() == "CONFIG_FUSE_PASSTHROUGH=y" for line in f)
    except OSError:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
        return (major, minor) >= (6, 9)


def passthrough_missing() -> str:
    """Why the real-mount test cannot run here; "" when it can. CI sets
    MODELFS_REQUIRE_PASSTHROUGH=1: there a pyfuse3 without it is a failure, not a skip."""
    if not PASSTHROUGH_API and os.environ.get("MODELFS_REQUIRE_PASSTHROUGH") != "1":
        return "needs the pyfuse3 scripts/build-passthrough makes (scripts/setup runs it)"
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN) for backing files"
    if not kernel_has_passthrough():
        return "needs a kernel with CONFIG_FUSE_PASSTHROUGH (Linux >= 6.9)"
    return ""


@fuse
@pytest.mark.skipif(bool(passthrough_missing()), reason=passthrough_missing() or "-")
def test_the_kernel_reads_blob_files_itself(tmp_path: Path) -> None:
    assert PASSTHROUGH_API, "pyfuse3 has no passthrough: did scripts/build-passthrough run?"
    tiny = TinyStore(tmp_path / "models")
    weights = os.urandom(8 << 20)
    tiny.gguf_model("m:1", payload=weights)
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:

        def daemon_read_bytes() -> int:
            with open(f"/proc/{proc.pid}/io") as f:
                return int(next(line for line in f if line.startswith("rchar:")).split()[1])

        path = mnt / "m" / "1" / "model.gguf"
        before = daemon_read_bytes()
        with open(path, "rb") as f, open(path, "rb") as g:
            assert f.read() == weights
            with mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                assert mm[-100:] == weights[-100:]
        # The same blob by another name is the same inode: it shares the backing file.
        assert (mnt / ".blobs" / Digest.of_bytes(weights).blob_name).read_bytes() == weights
        assert daemon_read_bytes() - before < len(weights) // 4


def test_why_passthrough_is_off_is_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ops, _, _ = blob_ops(tmp_path)
    monkeypatch.setattr(fsd_ops, "PASSTHROUGH_API", False)  # a plain `pip install`
    with caplog.at_level("INFO", logger="modelfs.fsd.ops"):
        ops.init()
    assert not ops.passthrough
    (line,) = [r.getMessage() for r in caplog.records]
    command = f"{sys.executable} -m modelfs build-passthrough"
    assert "\n" not in line and line.endswith(f"to turn it on for this environment: {command}")
    # The command is there in every install: `python -m modelfs` of the same environment.
    done = subprocess.run([*command.split(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--venv" in done.stdout, done.stderr
    monkeypatch.setattr(fsd_ops, "PASSTHROUGH_API", True)
    monkeypatch.setattr(pyfuse3, "passthrough_negotiated", lambda: False, raising=False)
    assert "did not offer it" in ops.passthrough_off()
    monkeypatch.setattr(pyfuse3, "passthrough_negotiated", lambda: True, raising=False)
    monkeypatch.setattr(fsd_ops.privhelper, "effective_capabilities", lambda: 0)
    assert "CAP_SYS_ADMIN" in ops.passthrough_off()  # a user's own mount
    ops.helper = FakeKernel()
    assert ops.passthrough_off() == ""  # the systemd unit's: its helper registers them


def cached_bytes(path: Path) -> int:
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(done.stdout.strip())


def uncache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs fincore (util-linux)")
async def test_served_reads_leave_one_copy_in_the_page_cache(tmp_path: Path) -> None:
    """Without passthrough the kernel caches what the mount serves in the FUSE file's pages;
    the blob's pages the mount read from disk for it are dropped, those cached before kept."""
    tiny = TinyStore(tmp_path / "models")
    weights = os.urandom(16 << 20)
    tiny.gguf_model("m:1", payload=weights)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    ops = ModelOperations(tree, 0, 0, tiny.root)  # passthrough off, as at a user's INIT
    _ = tree.root.children[".blobs"].children  # blob nodes are made when first shown
    node = next(n for n in tree.blob_nodes.values() if n.size == len(weights))

    async def read_all() -> bytes:
        info = await opened(ops, node)
        chunks = [await ops.read(info.fh, off, 128 << 10) for off in range(0, node.size, 128 << 10)]
        await ops.release(info.fh)
        return b"".join(chunks)

    uncache(node.path)
    assert cached_bytes(node.path) == 0
    assert await read_all() == weights
    assert cached_bytes(node.path) <= 2 << 20  # at most the last, partly read step
    node.path.read_bytes()  # another reader of the store's file
    assert cached_bytes(node.path) == len(weights)
    assert await read_all() == weights
    assert cached_bytes(node.path) == len(weights)
