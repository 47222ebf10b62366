"""Leases (GC invariant 3, docs/architecture.md): what a mount has open and what a pull
has in flight is on disk under `<store>/.modelfs/leases/`, so a GC on any host leaves it alone.

- store.leases directly: the file a LeaseKeeper writes, counted holds, live vs expired by
  mtime + ttl, and every way a lease file can be unreadable.
- The mount, as a real `modelfs mount` process: a file open through it is in its lease before
  `open` returns, and leaves it after the last close; the merged `model.safetensors` holds
  every tensor blob; a clean unmount removes the file, kill -9 leaves it to expire; a store
  where no lease can be written is still served.
- A pull: as a real `modelfs pull` process against a throttled fake peer, its lease lists
  every digest of the model while blobs arrive and is gone after; in-process, the lease is
  removed after a failure or a cancel, blobs already here are kept young for Ollama's prune,
  and a blob deleted under the pull is fetched again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from modelfs.demo import build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.leases import Lease, LeaseKeeper, read_leases
from modelfs.sync.errors import LocalWriteError, PeerError
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.puller import pull
from tests.builders import TinyStore
from tests.fakepeer import FakePeer
from tests.mounting import MODELFS, force_unmount, fuse, mounted, wait_for_mount
from tests.test_mount import wait_until
from tests.test_pull import assert_no_manifest, assert_store_sound, source_store, tree

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
D1, D2 = Digest("1" * 64), Digest("2" * 64)


async def until(check: Callable[[], object]) -> None:
    """Poll `check` (a file the pull writes: nothing to wait on but the clock)."""
    with trio.fail_after(10):
        for _ in iter(int, 1):
            if check():
                return
            await trio.sleep(0.01)


def leases_of(root: Path, purpose: str) -> list[Lease]:
    found = read_leases(Layout(root))
    assert found.unreadable == [], found.unreadable
    return [lease for lease in found.live + found.expired if lease.purpose == purpose]


def lease_files(root: Path) -> list[str]:
    d = Layout(root).leases
    return sorted(os.listdir(d)) if d.is_dir() else []


# -- store.leases ------------------------------------------------------------------------------
def test_keeper_writes_counted_holds(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    keeper = LeaseKeeper(layout, "mount", host="gpu-01", ttl=600)
    keeper.hold([D1, D1, D2], manifests=[D2])
    assert keeper.dirty
    keeper.write()
    assert not keeper.dirty
    [lease] = read_leases(layout).live
    assert (lease.host, lease.pid, lease.purpose) == ("gpu-01", os.getpid(), "mount")
    assert lease.ttl == 600
    assert lease.digests == {D1, D2} and lease.manifests == {D2}
    assert lease.path.name == f"gpu-01.{os.getpid()}.mount.json"
    keeper.drop([D1])  # held twice: still held
    assert not keeper.dirty and keeper.digests == {D1, D2}
    keeper.drop([D1], manifests=[D2])
    keeper.write()
    [lease] = read_leases(layout).live
    assert lease.digests == {D1, D2} - {D1} and lease.manifests == frozenset()
    keeper.path.unlink()
    keeper.touch()  # a heartbeat of a lease removed under us writes it again
    assert read_leases(layout).live[0].digests == {D2}
    keeper.remove()
    assert lease_files(tmp_path) == []


def test_host_id_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELFS_HOST_ID", "rack7/node 3")
    keeper = LeaseKeeper(Layout(tmp_path), "pull")
    keeper.write()
    [lease] = read_leases(Layout(tmp_path)).live
    assert lease.host == "rack7/node 3"
    assert lease.path.name == f"rack7_node_3.{os.getpid()}.pull.json"  # a safe file name


def test_live_or_expired_by_heartbeat_and_ttl(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    keeper = LeaseKeeper(layout, "mount", ttl=100)
    keeper.hold([D1])
    keeper.write()
    now = time.time()
    os.utime(keeper.path, (now - 90, now - 90))
    found = read_leases(layout, now)
    assert [lease.digests for lease in found.live] == [{D1}] and found.expired == []
    assert found.digests == {D1}
    os.utime(keeper.path, (now - 110, now - 110))
    found = read_leases(layout, now)
    assert found.live == [] and len(found.expired) == 1 and found.digests == set()
    keeper.touch()  # the heartbeat makes it live again
    assert read_leases(layout).digests == {D1}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{not json", "not JSON"),
        (b"", "not JSON"),
        (b'{"version": 2, "host": "h", "pid": 1, "purpose": "p", "ttl": 60}', "version 1"),
        (b"[1]", "version 1"),
        (b'{"version": 1, "host": "h", "purpose": "p", "ttl": 60}', "pid"),
        (b'{"version": 1, "host": "h", "pid": 1, "purpose": "p", "ttl": 0}', "ttl"),
        (
            b'{"version": 1, "host": "h", "pid": 1, "purpose": "p", "ttl": 60,'
            b' "digests": ["sha256:1234"]}',
            "invalid digest",
        ),
        (
            b'{"version": 1, "host": "h", "pid": 1, "purpose": "p", "ttl": 60,'
            b' "manifests": "sha256:' + b"1" * 64 + b'"}',
            "not a list",
        ),
        (
            b'{"version": 1, "host": "h", "pid": 1, "purpose": "p", "ttl": 60, "digests": [7]}',
            "non-string",
        ),
    ],
)
def test_an_unreadable_lease_is_reported(tmp_path: Path, body: bytes, why: str) -> None:
    layout = Layout(tmp_path)
    good = LeaseKeeper(layout, "mount")
    good.hold([D1])
    good.write()
    (layout.leases / "other.1.pull.json").write_bytes(body)
    (layout.leases / ".other.1.pull.json.1.tmp").write_bytes(b"half")  # being written
    found = read_leases(layout)
    [problem] = found.unreadable
    assert problem.path == ".modelfs/leases/other.1.pull.json"
    assert why in problem.message, problem
    assert found.digests == {D1}  # the readable one still counts


def test_a_directory_among_the_leases_is_unreadable(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    (layout.leases / "odd.json").mkdir(parents=True)
    assert [p.message for p in read_leases(layout).unreadable] == ["a directory"]
    assert read_leases(Layout(tmp_path / "none")).unreadable == []  # no leases dir: none


# -- the mount ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The demo store mounted by a host with an id of its own: (store root, mount point)."""
    root = build_demo_store(tmp_path_factory.mktemp("demo") / "models").root
    mnt = tmp_path_factory.mktemp("mnt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELFS_HOST_ID", "mount-host-1")
        with mounted(root, mnt):
            mp.undo()
            yield root, mnt


def held(root: Path) -> frozenset[Digest]:
    [lease] = leases_of(root, "mount")
    return lease.digests


def digest_of(path: Path) -> Digest:
    return Digest.parse(os.getxattr(path, "user.modelfs.digest").decode())


@fuse
def test_the_mount_keeps_a_lease_of_its_own(demo: tuple[Path, Path]) -> None:
    demo_root, _ = demo
    [lease] = leases_of(demo_root, "mount")
    assert lease.host == "mount-host-1"  # from MODELFS_HOST_ID
    assert lease.path.name.startswith("mount-host-1.")
    assert not lease.expired(time.time())


@fuse
def test_an_open_file_is_leased_until_closed(demo: tuple[Path, Path]) -> None:
    demo_root, demo_mnt = demo
    path = demo_mnt / "gemma4" / "26b" / "model.gguf"
    digest = digest_of(path)
    assert wait_until(lambda: digest not in held(demo_root))
    with open(path, "rb") as f:
        # No waiting: the lease is on disk before open() returns.
        assert digest in held(demo_root)
        assert f.read(4) == b"GGUF"
        assert digest in held(demo_root)
    assert wait_until(lambda: digest not in held(demo_root))


@fuse
def test_two_opens_of_one_blob_hold_it_until_both_close(demo: tuple[Path, Path]) -> None:
    demo_root, demo_mnt = demo
    path = demo_mnt / "someuser" / "tiny" / "q8" / "model.gguf"
    digest = digest_of(path)
    raw = demo_mnt / ".blobs" / digest.blob_name  # the same blob by another path
    first = open(path, "rb")  # noqa: SIM115
    second = open(raw, "rb")  # noqa: SIM115
    try:
        assert digest in held(demo_root)
        first.close()
        time.sleep(0.5)  # the release of the first reached the mount and was written
        assert digest in held(demo_root)
        assert second.read(4) == b"GGUF"
    finally:
        first.close()
        second.close()
    assert wait_until(lambda: digest not in held(demo_root))


@fuse
def test_merged_safetensors_holds_every_tensor_blob(demo: tuple[Path, Path]) -> None:
    demo_root, demo_mnt = demo
    mlx = demo_mnt / "gemma4" / "26b@mlx"
    tensors = {digest_of(p) for p in (mlx / "tensors").iterdir()}
    assert len(tensors) > 1
    assert wait_until(lambda: not tensors & held(demo_root))
    with open(mlx / "model.safetensors", "rb") as f:
        assert tensors <= held(demo_root)
        f.seek(-16, os.SEEK_END)
        assert len(f.read()) == 16
    assert wait_until(lambda: not tensors & held(demo_root))


@fuse
def test_clean_unmount_removes_the_lease(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:
        [lease] = leases_of(tiny.root, "mount")
        assert lease.pid == proc.pid
        (mnt / "m" / "1" / "model.gguf").read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert lease_files(tiny.root) == []

    # `modelfs umount` (fusermount -u from outside) is a clean unmount too.
    proc = subprocess.Popen([MODELFS, "mount", "--store", str(tiny.root), str(mnt)])
    try:
        wait_for_mount(proc, mnt)
        assert len(leases_of(tiny.root, "mount")) == 1
        done = subprocess.run([MODELFS, "umount", str(mnt)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert proc.wait(timeout=10) == 0
        assert lease_files(tiny.root) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        force_unmount(mnt)


@fuse
def test_a_killed_mount_leaves_its_lease_to_expire(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:
        f = open(mnt / "m" / "1" / "model.gguf", "rb")  # noqa: SIM115
        proc.kill()
        proc.wait()
        with pytest.raises(OSError):  # ENOTCONN: the flush finds the mount dead
            f.close()
    [lease] = leases_of(tiny.root, "mount")
    assert lease.pid == proc.pid
    assert lease.digests == {Digest.of_bytes(b"weights")}
    assert not lease.expired(time.time()) and lease.expired(time.time() + lease.ttl + 1)


@fuse
def test_a_store_without_room_for_leases_is_still_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights")
    shutil.rmtree(tiny.root / ".modelfs")
    (tiny.root / ".modelfs").write_bytes(b"not a directory")  # no leases/ can be made in it
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:
        for _ in range(3):
            assert (mnt / "m" / "1" / "model.gguf").read_bytes() == b"weights"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    out = capsys.readouterr().out
    assert out.count("cannot write lease") == 1, out
    assert "Traceback" not in out
    assert (tiny.root / ".modelfs").read_bytes() == b"not a directory"


# -- pull --------------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OLLAMA_MODELS"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _fakepeer(store: Path, *faults: str) -> tuple[subprocess.Popen[bytes], str]:
    argv = [sys.executable, "-m", "tests.fakepeer", "--store", str(store)]
    for fault in faults:
        argv += ["--fault", fault]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=_env()
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "listening on " in line, line
    return proc, line.split("listening on ", 1)[1].strip()


def test_a_pull_leases_every_digest_of_the_model_while_fetching(tmp_path: Path) -> None:
    tiny, raw, big = source_store(tmp_path / "a", size=2 * MiB)
    manifest = json.loads(raw)
    model = {
        Digest.of_bytes(raw),
        Digest.parse(manifest["config"]["digest"]),
        *(Digest.parse(layer["digest"]) for layer in manifest["layers"]),
    }
    b = tmp_path / "b"
    peer, url = _fakepeer(tiny.root, f"throttle=1M@{big.hex[:12]}")
    puller = None
    try:
        puller = subprocess.Popen(
            [MODELFS, "pull", "--store", str(b), "llama3.2:3b", "--from", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=_env(MODELFS_HOST_ID="puller-9"),
        )
        seen: list[Lease] = []

        def leased() -> bool:
            seen[:] = [lease for lease in leases_of(b, "pull") if lease.digests]
            return bool(seen)

        assert wait_until(leased, timeout=10)
        assert not Layout(b).blob(big).exists()  # while the big blob is still on its way
        [lease] = seen
        assert lease.digests == model
        assert (lease.host, lease.pid) == ("puller-9", puller.pid)
        assert puller.wait(timeout=30) == 0, puller.stderr.read() if puller.stderr else ""
    finally:
        for proc in (puller, peer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert lease_files(b) == []
    assert tree(b) == tree(tiny.root)


async def test_the_pull_lease_goes_after_a_failure_or_a_cancel(tmp_path: Path) -> None:
    tiny, _raw, big = source_store(tmp_path / "a")
    b = Layout(tmp_path / "b")
    failing = FakePeer(tiny.root, [f"status=500@{big.hex[:12]}"])
    with failing as peer, pytest.raises(PeerError):
        await pull(b, ["llama3.2:3b"], [peer.url], options=PullOptions(read_timeout=1.0))
    assert b.leases.is_dir() and lease_files(b.root) == []
    with FakePeer(tiny.root, [f"throttle=1M@{big.hex[:12]}"]) as peer:
        with trio.move_on_after(0.5) as scope:
            await pull(b, ["llama3.2:3b"], [peer.url])
        assert scope.cancelled_caught
    assert lease_files(b.root) == []
    assert_no_manifest(b.root)


async def test_the_pull_lease_cannot_be_written(tmp_path: Path) -> None:
    tiny, _raw, _big = source_store(tmp_path / "a")
    b = Layout(tmp_path / "b")
    b.tmp.mkdir(parents=True)
    b.leases.write_bytes(b"")  # a file where the directory should be
    with (
        FakePeer(tiny.root) as peer,
        pytest.raises(LocalWriteError, match="cannot write the pull's lease"),
    ):
        await pull(b, ["llama3.2:3b"], [peer.url])
    assert peer.requests == []  # nothing asked for before the lease was on disk


async def test_blobs_already_here_are_kept_young_during_the_pull(tmp_path: Path) -> None:
    tiny, raw, big = source_store(tmp_path / "a", size=2 * MiB)
    b = Layout(tmp_path / "b")
    b.blobs.mkdir(parents=True)
    license_ = Digest.parse(json.loads(raw)["layers"][2]["digest"])
    here = b.blob(license_)
    here.write_bytes(tiny.layout.blob(license_).read_bytes())
    old = time.time() - 2 * 3600  # older than Ollama's 1 h prune grace
    os.utime(here, (old, old))
    opts = PullOptions(freshen_every=0.1)
    with FakePeer(tiny.root, [f"throttle=2M@{big.hex[:12]}"]) as peer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: pull(b, ["llama3.2:3b"], [peer.url], options=opts))
            await until(lambda: here.stat().st_mtime > time.time() - 60)  # touched at the start
            os.utime(here, (old, old))
            await until(lambda: here.stat().st_mtime > time.time() - 60)  # and while it fetches
            assert not b.blob(big).exists()
    assert [r["digest"] for r in peer.blob_requests(license_.hex)] == []
    assert tree(b.root) == tree(tiny.root)


async def test_a_blob_pruned_during_the_pull_is_fetched_again(tmp_path: Path) -> None:
    """Ollama's startup prune (on any host sharing the store) deletes unreferenced blobs over
    an hour old without reading our leases: a blob fetched early in a long pull can go before
    the manifest names it. The pull notices and fetches it again."""
    tiny, raw, big = source_store(tmp_path / "a", size=2 * MiB)
    b = Layout(tmp_path / "b")
    license_ = Digest.parse(json.loads(raw)["layers"][2]["digest"])
    with FakePeer(tiny.root, [f"throttle=2M@{big.hex[:12]}"]) as peer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: pull(b, ["llama3.2:3b"], [peer.url]))
            await until(b.blob(license_).exists)
            b.blob(license_).unlink()  # fetched, and pruned before the manifest was written
            assert not b.blob(big).exists()
            assert_no_manifest(b.root)
    assert len(peer.blob_requests(license_.hex)) == 2
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []
    assert lease_files(b.root) == []


async def test_a_lingering_drop_keeps_the_hold_a_moment_and_a_reopen_writes_nothing(
    tmp_path: Path,
) -> None:
    from modelfs.runtime.leasing import leased

    layout = Layout(tmp_path / "store")
    keeper = LeaseKeeper(layout, "mount", host="h")
    async with leased(keeper, strict=True, heartbeat=60) as lease:
        await lease.hold([D1])
        written = keeper.written
        inode = keeper.path.stat().st_ino
        lease.drop([D1], linger=0.3)
        lease.drop([D2], linger=0.2)  # never held: a drop of nothing changes nothing
        await trio.sleep(0.1)
        await lease.hold([D1])  # opened again within the moment: no write
        assert keeper.written == written and keeper.path.stat().st_ino == inode
        lease.drop([D1], linger=0.3)
        await trio.sleep(0.1)
        assert D1 in read_leases(layout).live[0].digests
        # The file is renamed into place before the write's directory fsync returns and
        # counts it, so the count may trail what a reader sees by that fsync.
        for _ in range(100):
            if D1 not in read_leases(layout).live[0].digests and keeper.written > written:
                break
            await trio.sleep(0.05)
        assert D1 not in read_leases(layout).live[0].digests
        assert keeper.written > written


def test_a_hold_counts_each_digest_once_whatever_holds_them() -> None:
    """A {digest: size} mapping is held as its digests, once each: one drop lets each go (a
    mapping's values were added as counts, so a 4 GB blob stayed held for ever)."""
    keeper = LeaseKeeper(Layout(Path("/nonexistent")), "mirror", host="h")
    keeper.hold({D1: 4_000_000_000, D2: 1}, manifests=iter([D2]))
    keeper.drop([D1, D2], manifests=[D2])
    assert not keeper.digests
    assert json.loads(keeper.snapshot()[1])["manifests"] == []
