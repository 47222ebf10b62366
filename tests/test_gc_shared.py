"""GC on a store directory shared by hosts whose views of it lag behind (NFS, sshfs).

A network filesystem's client caches directory listings and attributes for seconds (sshfs: 20 s
by default; NFS: acdirmin/acdirmax, 30-60 s), so one host's GC may not see a manifest or a
lease another host wrote a moment ago. What keeps every wanted blob anyway, each by a test:

- a pull gives every blob of its model a fresh mtime before it writes the manifest, and a blob
  that vanishes under it (another host's GC) is fetched again: the pull never fails for it;
- GC decides each move on a fresh look (manifests and leases listed again, the candidate
  opened and its own mtime and ctime compared), and its grace is never below a floor that
  outlasts client caches unless a flag that names the risk says so;
- the trash puts back, first thing in a run, whatever any manifest, v2 link, list child or
  lease names, including a manifest blob a v2 link points at.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelfs.demo import GEMMA, build_demo_store
from modelfs.store.blobs import BlobStore
from modelfs.store.collect.gc import GRACE_FLOOR, FileItem, GcPolicy, move_to_trash, plan_gc
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper
from modelfs.store.manifest import ManifestList, parse_manifest
from modelfs.store.names import parse_name
from modelfs.sync.daemon import gc as gc_runner
from modelfs.sync.daemon.config import ConfigError, load_config
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.progress import NullProgress
from modelfs.sync.pull.puller import pull
from tests.builders import LAYER, TinyStore
from tests.fakepeer import FakePeer
from tests.mounting import fuse
from tests.test_pull_hosts import _env, modelfs_serve

MODELFS = str(Path(sys.executable).with_name("modelfs"))

OPTS = PullOptions(read_timeout=5.0)


def trash_everything(layout: Layout) -> list[str]:
    """What another host's GC does to every blob it takes for unneeded: a rename into the trash."""
    trash = layout.trash / "20260101T000000Z-otherhost"
    trash.mkdir(parents=True, exist_ok=True)
    moved = [n for n in os.listdir(layout.blobs) if is_blob_name(n)]
    for n in moved:
        os.rename(layout.blobs / n, trash / n)
    return moved


# -- a pull survives a concurrent GC ------------------------------------------------------------
def test_put_bytes_writes_anew_a_blob_that_leaves_between_the_look_and_the_touch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(tmp_path / "s")
    store = BlobStore(layout)
    data = b'{"schemaVersion":2}'
    digest = store.put_bytes(data)
    real_has = BlobStore.has

    def has_then_gone(self: BlobStore, d: Digest, size: int | None = None) -> bool:
        found = real_has(self, d, size)
        trash_everything(layout)  # another host's GC, right after our look
        return found

    monkeypatch.setattr(BlobStore, "has", has_then_gone)
    assert store.put_bytes(data) == digest
    assert layout.blob(digest).read_bytes() == data


class TrashOnFirstPresent(NullProgress):
    """Progress that, when the pull reports its first blob as already here, has another host's
    GC take every blob of the store: the window between "present" and "refreshed"."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.moved: list[str] = []

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        if not self.moved and completed == total:
            self.moved = trash_everything(self.layout)


async def test_a_re_pull_whose_present_blobs_are_collected_under_it_fetches_them_again(
    tmp_path: Path,
) -> None:
    demo = build_demo_store(tmp_path / "src")
    layout = Layout(tmp_path / "dst")
    with FakePeer(demo.root) as peer:
        await pull(layout, [GEMMA], [peer.url], options=OPTS)
        name = parse_name(GEMMA)
        # `ollama rm`: the tag's files go, its blobs stay (until a GC).
        layout.v2_manifest(name).unlink()
        layout.legacy_manifest(name).unlink()
        progress = TrashOnFirstPresent(layout)
        report = await pull(layout, [GEMMA], [peer.url], options=OPTS, progress=progress)
    assert progress.moved, "the re-pull found nothing present: the test tested nothing"
    [model] = report.models
    assert model.fetched > 0  # fetched again rather than failed
    lst = demo.lists[GEMMA]
    assert layout.v2_manifest(name).read_bytes() == lst.raw
    child = demo.manifests[f"{GEMMA}@llamacpp"]
    for d in (lst.digest, child.digest, *(layer.digest for layer in child.layers)):
        assert layout.blob(d).is_file(), d
    assert json.loads(layout.legacy_manifest(name).read_bytes())["layers"]
    shutil.rmtree(layout.trash)


# -- the trash puts back whatever is wanted, first thing in a run -------------------------------
def gc_cli(root: Path, *args: str, host: str = "host-b") -> tuple[int, Any, str]:
    r = subprocess.run(
        [MODELFS, "gc", "--store", str(root), "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MODELFS_HOST_ID": host},
    )
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else None, r.stderr


def listed_model(store: TinyStore) -> tuple[Digest, Digest, list[Digest]]:
    """A manifest list behind a v2 link: (list digest, child digest, the child's blobs)."""
    child = store.manifest([store.layer("model", b"child weights"), store.layer("license", b"L")])
    lst = store.manifest_list([(child, "llamacpp", "gguf")])
    store.v2("shared:1", lst)
    obj = json.loads(child)
    blobs = [Digest.parse(x["digest"]) for x in (obj["config"], *obj["layers"])]
    return Digest.of_bytes(lst), Digest.of_bytes(child), blobs


def to_trash(store: TinyStore, digests: list[Digest]) -> None:
    """As a GC whose cached listing hid the manifest left them: in the trash, aged."""
    trash = store.layout.trash / "20260101T000000Z-stale"
    trash.mkdir(parents=True, exist_ok=True)
    for d in digests:
        os.rename(store.layout.blob(d), trash / d.blob_name)


@pytest.mark.parametrize("which", ["link-target", "list-child"])
def test_a_link_or_list_pointing_into_the_trash_is_a_restore_not_a_refusal(
    tmp_path: Path, which: str
) -> None:
    store = TinyStore(tmp_path / "s")
    lst, child, blobs = listed_model(store)
    gone = [lst, child, *blobs] if which == "link-target" else [child, *blobs]
    to_trash(store, gone)
    # Default grace and retention: nothing about the run is unusual but the trash.
    rc, report, err = gc_cli(store.root)
    assert rc == 0, err
    assert sorted(i["digest"] for i in report["restored"]) == sorted(map(str, gone))
    for d in (lst, child, *blobs):
        assert store.layout.blob(d).is_file(), d
    verify = subprocess.run(
        [MODELFS, "verify", "--store", str(store.root)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_lease_naming_a_trashed_blob_brings_it_back(tmp_path: Path) -> None:
    store = TinyStore(tmp_path / "s")
    d = store.blob(b"a blob a mount on another host holds open")
    to_trash(store, [d])
    keeper = LeaseKeeper(store.layout, "mount", host="host-a")
    keeper.hold([d])
    keeper.write()
    rc, report, err = gc_cli(store.root)
    assert rc == 0, err
    assert [i["digest"] for i in report["restored"]] == [str(d)]
    assert store.layout.blob(d).is_file()


def test_put_backs_come_first_even_when_the_run_is_refused(tmp_path: Path) -> None:
    store = TinyStore(tmp_path / "s")
    raw = store.gguf_model("wanted:1", b"weights")
    layers = [Digest.parse(x["digest"]) for x in json.loads(raw)["layers"]]
    to_trash(store, layers)
    bad = store.layout.legacy_manifest(parse_name("half-written:1"))
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"")  # another host is writing it: nothing may be deleted
    rc, report, _ = gc_cli(store.root)
    assert rc == 1 and report["refused"]
    assert sorted(i["digest"] for i in report["restored"]) == sorted(map(str, layers))
    assert all(store.layout.blob(d).is_file() for d in layers)


# -- a fresh look before each move, and a grace floor ---------------------------------------------
def test_a_grace_below_the_floor_needs_the_flag_that_names_the_risk(tmp_path: Path) -> None:
    store = TinyStore(tmp_path / "s")
    junk = store.blob(b"an orphan")
    old = time.time() - 7200
    os.utime(store.layout.blob(junk), (old, old))
    rc, report, err = gc_cli(store.root, "--grace", "2s")
    assert rc == 1 and report is None and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("modelfs: error: a grace of 2s is below the 10m floor")
    assert "--grace-below-floor accepts that risk" in line
    assert not (store.layout.state / "gc").exists()  # nothing looked at, nothing recorded
    for _ in range(2):
        rc, report, err = gc_cli(store.root, "--grace", "0", "--grace-below-floor")
        assert rc == 0, err
    assert not store.layout.blob(junk).exists()
    assert gc_cli(store.root, "--grace", f"{GRACE_FLOOR:.0f}s")[0] == 0  # the floor itself is fine
    with pytest.raises(ValueError, match="below the 10m floor"):
        GcPolicy(grace=1.0)
    helptext = subprocess.run([MODELFS, "gc", "--help"], capture_output=True, text=True).stdout
    assert "--grace-below-floor" in helptext and "client caches" in helptext


def test_a_config_grace_below_the_floor_needs_its_key(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[gc]\ngrace = "30s"\n')
    with pytest.raises(ConfigError, match=r"gc\.grace: a grace of 30s is below the 10m floor"):
        load_config(path)
    path.write_text('[gc]\ngrace = "30s"\ngrace_below_floor = true\n')
    assert load_config(path).gc.policy().grace == 30.0


def test_a_candidate_whose_ctime_changed_since_the_plan_stays(tmp_path: Path) -> None:
    """A hard link made and removed (as a v2 link's fallback writer does) or a touch that keeps
    the mtime: the size and mtime the plan saw are the same, the inode's ctime is not."""
    store = TinyStore(tmp_path / "s")
    junk = store.blob(b"looks unchanged")
    path = store.layout.blob(junk)
    old = time.time() - 7200
    os.utime(path, (old, old))
    policy = GcPolicy(grace=0, below_floor=True)
    plan = plan_gc(store.layout, policy)
    (item,) = plan.pending
    time.sleep(0.02)  # a ctime the clock can tell apart
    os.link(path, tmp_path / "elsewhere")
    os.unlink(tmp_path / "elsewhere")
    assert os.stat(path).st_mtime == item.mtime
    assert not move_to_trash(store.layout, item, store.layout.trash / "t", 0.0)
    assert path.is_file()


async def test_a_manifest_written_while_gc_moves_keeps_the_blobs_of_later_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch of moves starts from a fresh look: a manifest another host writes while the
    first batch moves keeps its blobs in blobs/ (not moved and then put back)."""
    store = TinyStore(tmp_path / "s")
    orphans = [store.blob(b"orphan %d" % i) for i in range(gc_runner.BATCH + 5)]
    old = time.time() - 7200
    for d in orphans:
        os.utime(store.layout.blob(d), (old, old))
    policy = GcPolicy(grace=0, below_floor=True)
    await gc_runner.run_gc(store.layout, policy)  # first sighting
    late = orphans[-3:]
    moved: list[Digest] = []
    real = gc_runner.move_to_trash

    def move_then_write(layout: Layout, item: FileItem, *args: Any) -> bool:
        if not moved:  # another host re-pulls a model made of three of them
            layers = [{"mediaType": LAYER + "model", "digest": str(d), "size": 8} for d in late]
            store.legacy("again:1", store.manifest(layers))
        ok = real(layout, item, *args)
        if ok:
            assert item.digest is not None
            moved.append(item.digest)
        return ok

    monkeypatch.setattr(gc_runner, "move_to_trash", move_then_write)
    monkeypatch.setattr(gc_runner, "LOOK_EVERY", 0.0)
    report = await gc_runner.run_gc(store.layout, policy)
    late_set = set(late)
    first_batch = {i.digest for i in report.plan.trash[: gc_runner.BATCH]} if report.plan else set()
    assert not (late_set - first_batch) & set(moved)
    assert all(store.layout.blob(d).is_file() for d in late)


# -- two hosts, one of them behind a client cache ------------------------------------------------
@contextlib.contextmanager
def hiding_mount(source: Path, mnt: Path, hide: float) -> Iterator[Path]:
    """`source` as a host with a network filesystem's client caches sees it (tests/hidingfs)."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hidingfs", str(source), str(mnt), "--hide", str(hide)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.strip() == "ready", line + proc.stdout.read().decode()
        yield mnt
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            proc.kill()
            proc.wait()


@fuse
def test_the_caching_client_shows_a_new_file_that_reuses_an_inode_number_as_it_is(
    tmp_path: Path,
) -> None:
    """The harness itself: the real filesystem gives a deleted file's inode number to the
    next file made (ext4 does at once, of any type), as when `ollama rm` and a re-pull
    replace a manifest with a v2 link. The client's caches are per file, so the new link is
    a link, never the cached regular file (the soak's GC runs met 'a directory' and EIO)."""
    source = tmp_path / "source"
    source.mkdir()
    with hiding_mount(source, tmp_path / "mnt", 30.0) as mnt:
        for _ in range(20):  # until the filesystem reuses the number (ext4: the first try)
            (source / "x").write_bytes(b"a manifest" * 10)
            assert os.lstat(mnt / "x").st_size == 100  # cached for 30 s
            ino = os.lstat(source / "x").st_ino
            (source / "x").unlink()
            (source / "x").symlink_to("../blobs/sha256-" + "a" * 64)
            if os.lstat(source / "x").st_ino == ino:
                break
            (source / "x").unlink()
        else:
            pytest.skip("this filesystem does not reuse inode numbers at once")
        st = os.lstat(mnt / "x")
        assert stat.S_ISLNK(st.st_mode), oct(st.st_mode)
        assert os.readlink(mnt / "x") == "../blobs/sha256-" + "a" * 64


def pull_as(host: str, store: Path, url: str, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MODELFS, "pull", name, "--from", url, "--store", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "MODELFS_HOST_ID": host},
    )


def rm_tag(store: Path, name: str) -> None:
    """As `ollama rm` does: the tag's manifest files go, the blobs stay."""
    layout, n = Layout(store), parse_name(name)
    for path in (layout.v2_manifest(n), layout.legacy_manifest(n)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def origin_store(root: Path) -> TinyStore:
    origin = TinyStore(root)
    shared_license = b"one license for all"
    for i in range(3):
        origin.legacy(
            f"m{i}:1",
            origin.manifest(
                [
                    origin.layer("model", os.urandom(64 << 10)),
                    origin.layer("license", shared_license),
                ]
            ),
        )
    child = origin.manifest([origin.layer("model", os.urandom(32 << 10))])
    origin.v2("listed:1", origin.manifest_list([(child, "llamacpp", "gguf")]))
    return origin


@fuse
def test_a_re_pulled_model_hidden_by_a_client_cache_keeps_its_blobs(tmp_path: Path) -> None:
    """The soak's loss, replayed step by step: host B's cached view still hides the manifest
    host A re-pulled and still shows the blobs' old mtimes; the pull's fresh mtimes, seen by
    GC's open just before the move, keep them (the old code took them: 3 blobs lost)."""
    origin = origin_store(tmp_path / "origin")
    shared = tmp_path / "shared"
    shared.mkdir()
    with modelfs_serve(origin.root) as url, hiding_mount(shared, tmp_path / "b", 30) as b:
        assert pull_as("host-a", shared, url, "m0:1").returncode == 0
        old = time.time() - 7200
        for name in os.listdir(shared / "blobs"):
            os.utime(shared / "blobs" / name, (old, old))
        rm_tag(shared, "m0:1")
        args = ("--grace", "2s", "--grace-below-floor", "--trash-retention", "1h")
        rc, first, err = gc_cli(b, *args)
        assert rc == 0 and len(first["pending"]) == 3, err  # B saw the rm at once
        assert pull_as("host-a", shared, url, "m0:1").returncode == 0  # all present: 0 B
        time.sleep(2.1)  # the grace between the two sightings
        rc, second, err = gc_cli(b, *args)
        assert rc == 0, err
        assert second["manifests"] == 0, "the cache did not hide the manifest: tested nothing"
        assert not second["trashed"], second["trashed"]
        assert len(second["changed"]) == 3
        raw = Layout(shared).legacy_manifest(parse_name("m0:1")).read_bytes()
        for x in (json.loads(raw)["config"], *json.loads(raw)["layers"]):
            assert Layout(shared).blob(Digest.parse(x["digest"])).is_file()


def named_but_absent(store: Path) -> set[Digest]:
    """Blobs that a manifest present in `store` names (in any form) and `blobs/` lacks; a
    manifest that changed or went while we looked does not count."""
    layout = Layout(store)
    absent: set[Digest] = set()
    for top in (layout.manifests, layout.manifests_v2):
        for dirpath, _, files in os.walk(top):
            for f in files:
                path = Path(dirpath, f)
                try:
                    target = os.readlink(path) if path.is_symlink() else None
                    raw = None if target else path.read_bytes()
                except OSError:
                    continue
                wanted: list[Digest] = []
                if target is not None:
                    wanted.append(Digest(os.path.basename(target).removeprefix("sha256-")))
                    with contextlib.suppress(OSError):
                        raw = path.read_bytes()
                if raw is not None:
                    with contextlib.suppress(StoreError):
                        parsed = parse_manifest(raw, str(path))
                        if isinstance(parsed, ManifestList):
                            for child in parsed.children:
                                wanted.append(child.digest)
                                with contextlib.suppress(OSError, StoreError):
                                    blob = layout.blob(child.digest).read_bytes()
                                    wanted += parse_manifest(blob, "child").blob_digests()
                        else:
                            wanted += parsed.blob_digests()
                missing = {d for d in wanted if not layout.blob(d).is_file()}
                try:  # still the same manifest?
                    same = (os.readlink(path) == target) if target else path.read_bytes() == raw
                except OSError:
                    same = False
                if same:
                    absent |= missing
    return absent


@fuse
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_pulls_and_gc_on_two_hosts_over_a_caching_client(tmp_path: Path) -> None:
    """Host A (MODELFS_HOST_ID=host-a, the directory itself) loops: remove a tag as `ollama
    rm` does, and pull removed ones again from a `modelfs serve` peer on loopback. Host B
    (host-b, through tests/hidingfs with a 3 s cache, like an sshfs client's 20 s) loops
    `modelfs gc` with a 5 s grace and a 3 s trash retention, below the floor on purpose. An
    observer on the directory looks every 0.2 s for blobs that a present manifest names.
    Zero pulls may fail, and no such blob may be gone for longer than one GC run."""
    seconds = float(os.environ.get("MODELFS_SOAK_SECONDS", "60"))
    hide = 3.0
    origin = origin_store(tmp_path / "origin")
    names = ["m0:1", "m1:1", "m2:1", "listed:1"]
    shared = tmp_path / "shared"
    shared.mkdir()
    gc_runs: list[tuple[float, float, int, Any, str]] = []
    episodes: list[tuple[Digest, float]] = []  # a named blob absent, for how long
    stop = threading.Event()

    def host_b(b: Path) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            rc, report, err = gc_cli(
                b, "--grace", "5s", "--grace-below-floor", "--trash-retention", "3s"
            )
            gc_runs.append((t0, time.monotonic(), rc, report, err))
            stop.wait(0.2)

    def observer() -> None:
        since: dict[Digest, float] = {}
        while True:
            now = time.monotonic()
            absent = named_but_absent(shared)
            for d in list(since):
                if d not in absent:
                    episodes.append((d, now - since.pop(d)))
            for d in absent:
                since.setdefault(d, now)
            if stop.is_set():
                episodes.extend((d, now - t) for d, t in since.items())
                return
            stop.wait(0.2)

    pulls: list[subprocess.CompletedProcess[str]] = []
    rng = random.Random(20)
    with modelfs_serve(origin.root) as url, hiding_mount(shared, tmp_path / "b", hide) as b:
        for n in names:
            r = pull_as("host-a", shared, url, n)
            assert r.returncode == 0, r.stderr
        threads = [threading.Thread(target=host_b, args=(b,)), threading.Thread(target=observer)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + seconds
            removed: list[str] = []
            while time.monotonic() < deadline:
                # Up to 3 tags removed at a time, each for a few seconds to a few times the
                # grace: long enough for B to collect some, and re-pulled at any moment of it.
                if len(removed) < 3 and rng.random() < 0.5:
                    name = rng.choice([n for n in names if n not in removed])
                    rm_tag(shared, name)
                    removed.append(name)
                elif removed:
                    name = removed.pop(rng.randrange(len(removed)))
                    pulls.append(pull_as("host-a", shared, url, name))
                time.sleep(rng.uniform(0, 2))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
    failed = [r.stderr for r in pulls if r.returncode != 0]
    assert not failed, failed
    # Every run completes: a manifest pulled or removed under it is whole or gone, never
    # unreadable, whatever the client's caches show.
    bad = [e for *_, rc, _, e in gc_runs if rc]
    assert not bad, bad
    longest_run = max(end - start for start, end, *_ in gc_runs)
    assert all(gone <= longest_run for _, gone in episodes), (episodes, longest_run)
    trashed = sum(len(rep["trashed"]) for *_, rep, _ in gc_runs if rep)
    assert len(gc_runs) >= 5 and trashed > 0, "the GC host never collected: tested nothing"
    print(
        f"soak {seconds:.0f} s: {len(pulls)} pulls, {len(gc_runs)} gc runs (longest "
        f"{longest_run:.1f} s), {trashed} blobs trashed, "
        f"{sum(len(rep['restored']) for *_, rep, _ in gc_runs)} restored, "
        f"{sum(len(rep['changed']) for *_, rep, _ in gc_runs)} kept as changed, "
        f"{len(episodes)} named-blob absences"
    )


def test_a_manifest_removed_between_listing_and_reading_is_a_removed_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host's `ollama rm` lands between GC's listing and its read: the manifest names
    nothing any more, so GC goes on (it used to refuse the whole run)."""
    from modelfs.store.collect import reach

    store = TinyStore(tmp_path / "s")
    store.gguf_model("kept:1", b"kept")
    store.gguf_model("removed:1", b"removed")
    real = reach.walk_manifest_tree

    def walk_then_rm(root: Path) -> Iterator[Any]:
        for parts, de, problem in real(root):
            if de is not None and "removed" in parts:
                os.unlink(de.path)
            yield parts, de, problem

    monkeypatch.setattr(reach, "walk_manifest_tree", walk_then_rm)
    result = reach.reachable(store.layout)
    assert not result.unreadable and result.manifests == 1


def test_a_manifest_removed_between_the_look_and_the_open_names_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same `ollama rm` a moment later, after GC's lstat and before its open (the soak
    over the caching client met it, whose every look is a round trip): GC goes on."""
    from modelfs.store.collect import reach

    store = TinyStore(tmp_path / "s")
    store.gguf_model("kept:1", b"kept")
    store.gguf_model("removed:1", b"removed")
    real = reach.read_limited

    def rm_then_read(path: Path | str, limit: int) -> bytes:
        if Path(path).parent.name == "removed":
            os.unlink(path)
        return real(path, limit)

    monkeypatch.setattr(reach, "read_limited", rm_then_read)
    result = reach.reachable(store.layout)
    assert not result.unreadable and result.manifests == 1


def test_a_blob_gc_may_not_open_is_judged_by_a_plain_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's blob that GC's user cannot read still goes when unchanged: the open
    before the move is for fresh attributes, not a condition of moving."""
    from modelfs.store.collect import gc as store_gc

    store = TinyStore(tmp_path / "s")
    junk = store.blob(b"someone else's, mode 0600")
    old = time.time() - 7200
    os.utime(store.layout.blob(junk), (old, old))
    (item,) = plan_gc(store.layout, GcPolicy(grace=0, below_floor=True)).pending
    real_open = os.open

    def no_read(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path) == str(item.path):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(store_gc.os, "open", no_read)
    assert move_to_trash(store.layout, item, store.layout.trash / "t", 0.0)
    assert not store.layout.blob(junk).exists()
