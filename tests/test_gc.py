"""`modelfs gc`: each GC invariant (docs/architecture.md) by an attempt to break it.

Most tests run the real command in a subprocess against a store built in the test; a few
drive `plan_gc` with an explicit clock, or the runner in-process to make a lock fail on cue.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from modelfs.store.collect.gc import GcPolicy, load_first_seen, plan_gc, save_first_seen
from modelfs.store.digest import Digest
from modelfs.store.errors import LockBusyError, LockLostError
from modelfs.store.leases import LeaseKeeper
from modelfs.store.lockfile import LockFile
from modelfs.sync.daemon import gc as gc_runner
from tests.builders import LAYER, TinyStore, compact

MODELFS = str(Path(sys.executable).with_name("modelfs"))
HOUR = 3600.0


def gc(store: TinyStore, *args: str, env: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """Run `modelfs gc --json`; (exit code, report, stderr)."""
    r = subprocess.run(
        [MODELFS, "gc", "--store", str(store.root), "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    report = json.loads(r.stdout) if r.stdout.strip() else None
    return r.returncode, report, r.stderr


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def orphan(store: TinyStore, data: bytes, *, old: float = 2 * HOUR) -> Digest:
    d = store.blob(data)
    age(store.layout.blob(d), old)
    return d


def present(store: TinyStore, d: Digest) -> bool:
    return store.layout.blob(d).is_file()


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size)
    return out


@pytest.fixture
def store(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


# -- invariant 1: reachability from every manifest form ----------------------------------------
def test_nothing_any_manifest_form_names_is_ever_deleted(store: TinyStore) -> None:
    legacy = store.gguf_model("legacy:1", b"legacy weights")
    v2 = store.manifest([store.layer("model", b"v2 weights")])
    store.v2("v2model:1", v2)
    # A list with one present child, one absent child and one inline child.
    child = store.manifest([store.layer("model", b"child weights")])
    absent = store.manifest([store.layer("model", b"absent child weights")])
    absent_digest = Digest.of_bytes(absent)
    inline_layer = store.layer("model", b"inline child weights")
    lst = json.loads(store.manifest_list([(child, "llamacpp", "gguf"), (absent, "mlx", "st")]))
    store.layout.blob(absent_digest).unlink()  # a pull took only the llamacpp child
    # ...but a blob of the absent child exists: kept, since the child may be pulled again.
    inline = json.loads(store.manifest([inline_layer]))
    lst["manifests"].append({**inline, "runner": "ggml", "format": "gguf"})
    store.v2("listed:1", compact(lst))
    # The downgrade anchor: a legacy file hidden by a v2 tag of the same name.
    anchor = store.manifest([store.layer("model", b"anchor-only weights")])
    store.v2("anchored:1", v2)
    store.legacy("anchored:1", anchor)
    # (a legacy manifest is a file, not a blob)
    named = [Digest.of_bytes(x) for x in (v2, child, compact(lst))] + [
        Digest.parse(inline_layer["digest"])
    ]
    for obj in map(json.loads, (legacy, v2, child, anchor)):
        named += [Digest.parse(layer["digest"]) for layer in obj["layers"]]
        named.append(Digest.parse(obj["config"]["digest"]))
    for name in os.listdir(store.layout.blobs):
        age(store.layout.blobs / name, 2 * HOUR)
    junk = orphan(store, b"nobody's")

    for _ in range(3):
        rc, report, err = gc(store, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
        assert rc == 0, err
    assert not present(store, junk)
    for d in named:
        assert present(store, d), d
    assert report["referenced"] == report["blobs"] == len(os.listdir(store.layout.blobs))


# -- invariant 2: an unreadable manifest or lease stops everything --------------------------
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p.write_bytes(b""), id="zero-length"),
        pytest.param(
            lambda p: p.write_bytes(b'{"schemaVersion":2,"layers":[{"dig'), id="truncated"
        ),
        pytest.param(lambda p: p.write_bytes(b"\x00\x01 not json"), id="binary"),
    ],
)
def test_an_unreadable_manifest_stops_gc(store: TinyStore, make: Any) -> None:
    store.gguf_model("fine:1")
    junk = orphan(store, b"would go")
    bad = store.layout.manifests / "registry.ollama.ai" / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    make(bad)
    before = tree_state(store.root)
    for _ in range(2):
        rc, report, err = gc(store, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
        assert rc == 1
        assert "gc refused" in err and "nothing was deleted" in err
        assert report["refused"] and "library/broken" in report["refused"][0]["path"]
    assert present(store, junk)
    assert load_first_seen(store.layout) == {}  # not even a first sighting was recorded
    after = tree_state(store.root)
    assert {k: v for k, v in after.items() if not k.startswith(".modelfs")} == {
        k: v for k, v in before.items() if not k.startswith(".modelfs")
    }


def test_a_broken_list_child_stops_gc_a_dangling_v2_link_does_not(store: TinyStore) -> None:
    raw = store.manifest([store.layer("model", b"w")])
    link = store.v2("gone:1", raw)
    junk = orphan(store, b"would go")
    store.layout.blob(Digest.of_bytes(raw)).unlink()
    # What `ollama rm` leaves: a removed tag, not a manifest that cannot be read.
    rc, report, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0 and report["refused"] == []
    link.unlink()
    junk = orphan(store, b"would go too")

    child = store.manifest([store.layer("model", b"c")])
    store.v2("lst:1", store.manifest_list([(child, "llamacpp", "gguf")]))
    store.layout.blob(Digest.of_bytes(child)).write_bytes(b"{ not a manifest")
    rc, report, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 1 and "child" in report["refused"][0]["message"]
    rc, report, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert present(store, junk)


def test_a_stray_file_above_manifest_depth_does_not_stop_gc(store: TinyStore) -> None:
    store.gguf_model("fine:1")
    (store.layout.manifests / "registry.ollama.ai" / ".DS_Store").write_bytes(b"Bud1")
    junk = orphan(store, b"goes")
    gc(store, "--grace", "0", "--grace-below-floor")
    rc, _, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0 and not present(store, junk)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"version": 99}',
        b'{"version":1,"host":"h","pid":1,"purpose":"p","ttl":60,"digests":["sha256:nothex"]}',
    ],
    ids=["empty", "garbage", "version", "bad-digest"],
)
def test_an_unreadable_lease_stops_gc(store: TinyStore, body: bytes) -> None:
    junk = orphan(store, b"would go")
    store.layout.leases.mkdir(parents=True)
    (store.layout.leases / "other.1.mount.json").write_bytes(body)
    for _ in range(2):
        rc, report, _ = gc(store, "--grace", "0", "--grace-below-floor")
        assert rc == 1 and report["refused"][0]["path"].endswith("other.1.mount.json")
    assert present(store, junk)


# -- invariant 3: leases -------------------------------------------------------------------
def test_a_live_lease_keeps_its_blobs_and_an_expired_one_does_not(store: TinyStore) -> None:
    kept = orphan(store, b"held by a live lease")
    stale = orphan(store, b"held by a dead host's lease")
    manifest = store.manifest([store.layer("model", b"kept through a leased manifest")])
    leased_manifest = store.blob(manifest)
    layer = Digest.parse(json.loads(manifest)["layers"][0]["digest"])
    for d in (leased_manifest, layer):
        age(store.layout.blob(d), 2 * HOUR)

    live = LeaseKeeper(store.layout, "mount", host="gpu-02", ttl=HOUR)
    live.hold([kept], manifests=[leased_manifest])
    live.write()
    dead = LeaseKeeper(store.layout, "pull", host="gpu-03", ttl=60)
    dead.pid += 1  # another process's file
    dead.path = dead.path.with_name("gpu-03.999.pull.json")
    dead.hold([stale])
    dead.write()
    age(dead.path, 120)  # its heartbeat stopped two minutes ago; its TTL is one

    for _ in range(3):
        rc, report, err = gc(store, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
        assert rc == 0, err
        assert report["leases"] == {"live": 1, "expired": 1}
    assert present(store, kept) and present(store, leased_manifest) and present(store, layer)
    assert not present(store, stale)
    assert [i["digest"] for i in report["leased"]] == [str(kept)]

    # The live lease lets go: the blob goes after its two sightings.
    live.remove()
    gc(store, "--grace", "0", "--grace-below-floor")
    gc(store, "--grace", "0", "--grace-below-floor")
    assert not present(store, kept) and not present(store, layer)


# -- invariant 4: grace for young blobs and for everybody's partial files --------------------
def test_grace_keeps_young_blobs_and_two_sightings_must_be_grace_apart(store: TinyStore) -> None:
    layout, policy = store.layout, GcPolicy(grace=HOUR)
    young = store.blob(b"just written by another host's pull")
    old = orphan(store, b"old and unreferenced", old=3 * HOUR)
    t0 = time.time()
    plan = plan_gc(layout, policy, now=t0)
    assert [i.digest for i in plan.young] == [young]
    assert [i.digest for i in plan.pending] == [old] and not plan.trash
    save_first_seen(layout, plan.first_seen)
    plan = plan_gc(layout, policy, now=t0 + 0.5 * HOUR)  # second pass, too soon
    assert [i.digest for i in plan.pending] == [old] and not plan.trash
    save_first_seen(layout, plan.first_seen)
    plan = plan_gc(layout, policy, now=t0 + 1.01 * HOUR)
    assert [i.digest for i in plan.trash] == [old]
    assert young not in [i.digest for i in plan.trash]


def test_a_blob_touched_between_plan_and_move_stays(store: TinyStore) -> None:
    junk = orphan(store, b"re-pulled right now")
    gc(store, "--grace", "60s", "--grace-below-floor")
    state = load_first_seen(store.layout)
    state[junk.blob_name] -= 3600  # as if first seen an hour ago
    save_first_seen(store.layout, state)
    os.utime(store.layout.blob(junk))  # Ollama's NewLayer touches it: young again
    rc, report, _ = gc(store, "--grace", "60s", "--grace-below-floor")
    assert rc == 0 and present(store, junk)
    assert [i["digest"] for i in report["young"]] == [str(junk)]


def test_partial_and_temp_files_of_everyone_wait_for_the_partial_grace(store: TinyStore) -> None:
    blobs, tmp = store.layout.blobs, store.layout.tmp
    hexd = "ab" * 32
    names = {
        blobs / f"sha256-{hexd}-partial": 8 * 86400,
        blobs / f"sha256-{hexd}-partial-0": 8 * 86400,
        blobs / f"sha256-{'cd' * 32}.tmp": 8 * 86400,
        blobs / "sha256-1234567890": 8 * 86400,  # NewLayer's CreateTemp
        tmp / f"pull-sha256-{'ef' * 32}.partial": 8 * 86400,
        tmp / "blob-x1y2z3": 8 * 86400,
        blobs / f"sha256-{'12' * 32}-partial": 86400,  # only a day old: kept
        blobs / f"sha256:{'34' * 32}": 30 * 86400,  # a cross-OS copy: never ours to delete
        blobs / "README": 30 * 86400,  # foreign: never deleted
        # State files a kill -9 left before their rename (write_atomic), and one that is
        # none: the index itself, old, is never a temp file.
        store.layout.state / ".scan-index.0123456789ab.tmp": 8 * 86400,
        store.layout.state / "verify" / ".cache.0123456789ab.tmp": 8 * 86400,
        store.layout.state / "gc" / ".first-seen.json.0123456789ab.tmp": 86400,  # a day: kept
        store.layout.state / "scan-index": 30 * 86400,
    }
    held = tmp / f"pull-sha256-{'56' * 32}.partial"  # old, but its pull holds a lease
    names[held] = 8 * 86400
    for path, old in names.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
        age(path, old)
    keeper = LeaseKeeper(store.layout, "pull")
    keeper.hold([Digest("56" * 32)])
    keeper.write()

    rc, report, _ = gc(store, "--dry-run")
    assert rc == 0 and all(p.exists() for p in names)
    would = {i["path"] for i in report["temps_deleted"]}
    rc, report, _ = gc(store)
    assert rc == 0
    deleted = {i["path"] for i in report["temps_deleted"]}
    assert deleted == would
    assert deleted == {
        str(p.relative_to(store.root)) for p, a in names.items() if a == 8 * 86400 and p != held
    }
    for p in names:
        assert p.exists() == (str(p.relative_to(store.root)) not in deleted), p


def test_leftover_links_and_fuse_hidden_files_go_once_no_one_can_use_them(
    store: TinyStore,
) -> None:
    """A manifests-v2 link a killed pull never renamed into place goes after the partial
    grace; a `.fuse_hidden*` file (what a FUSE client such as sshfs leaves of a file unlinked
    while open) anywhere in `.modelfs/` goes after the grace unless a process here holds it."""
    links = store.layout.links
    links.mkdir(parents=True)
    old_link, young_link = links / "link-0123456789abcdef", links / "link-fedcba9876543210"
    for link in (old_link, young_link):
        os.symlink("../../../../blobs/sha256-" + "ab" * 32, link)
    age(old_link, 8 * 86400)
    age(young_link, 86400)
    store.layout.leases.mkdir(parents=True, exist_ok=True)
    hidden = {
        store.layout.state / ".fuse_hidden0000000a00000001": 2 * HOUR,
        store.layout.leases / ".fuse_hidden0000000b00000002": 2 * HOUR,
        store.layout.tmp / ".fuse_hidden0000000c00000003": 2 * HOUR,
        store.layout.leases / ".fuse_hidden0000000d00000004": 60,  # young: kept
    }
    held = store.layout.tmp / ".fuse_hidden0000000e00000005"  # old, but open here: kept
    hidden[held] = 2 * HOUR
    for path, old in hidden.items():
        path.write_bytes(b"lease")
        age(path, old)
    with open(held, "rb"):
        rc, report, _ = gc(store)
    assert rc == 0
    deleted = {i["path"] for i in report["temps_deleted"]}
    expected = {old_link, *(p for p, a in hidden.items() if a == 2 * HOUR and p != held)}
    assert deleted == {str(p.relative_to(store.root)) for p in expected}
    for path in [old_link, young_link, *hidden]:
        assert os.path.lexists(path) == (path not in expected), path


# -- invariant 5: one GC at a time -----------------------------------------------------------
def test_a_live_lock_of_another_host_refuses_and_a_stale_one_is_taken_over(
    store: TinyStore,
) -> None:
    junk = orphan(store, b"goes when the lock is ours")
    theirs = LockFile(store.layout.state / "gc.lock", stale_after=600, host="gpu-07")
    theirs.acquire()
    rc, report, err = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 75 and report is None  # EX_TEMPFAIL: somebody else is collecting
    assert "gc: skipped: gc.lock is held by pid" in err and "gpu-07" in err
    assert "error" not in err

    age(theirs.path, 601)  # its heartbeat stopped ten minutes ago
    rc, report, err = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0, err
    rc, report, err = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0 and not present(store, junk)
    assert not theirs.path.exists()


def test_a_lock_whose_owner_died_on_this_host_is_taken_over(store: TinyStore) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = store.layout.state / "gc.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = os.environ.get("MODELFS_HOST_ID") or os.uname().nodename
    lock.write_text(json.dumps({"host": me, "pid": dead.pid, "token": "x"}))
    rc, _, err = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0, err


def test_many_gcs_started_at_once_never_both_run(store: TinyStore) -> None:
    junk = [orphan(store, f"orphan {i}".encode()) for i in range(300)]
    gc(store, "--grace", "0", "--grace-below-floor")  # the first sighting
    args = [
        MODELFS,
        "gc",
        "--store",
        str(store.root),
        "--json",
        "--grace",
        "0",
        "--grace-below-floor",
    ]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)
    ]
    outcomes = [p.communicate(timeout=120) for p in procs]
    ran = [
        json.loads(out) for p, (out, _) in zip(procs, outcomes, strict=True) if p.returncode == 0
    ]
    busy = [err for p, (_, err) in zip(procs, outcomes, strict=True) if p.returncode == 75]
    assert len(ran) + len(busy) == 6 and ran
    assert all(b"gc.lock is held by" in err for err in busy)
    moved = [i["digest"] for r in ran for i in r["trashed"]]
    assert sorted(moved) == sorted(str(d) for d in junk)  # each exactly once, none lost
    trashed = {p.name for p in store.layout.trash.glob("*/*")}
    assert trashed == {d.blob_name for d in junk}


async def test_a_lock_refresh_that_fails_mid_run_stops_the_run(
    store: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = [orphan(store, f"orphan {i}".encode()) for i in range(gc_runner.BATCH + 10)]
    policy = GcPolicy(grace=0, below_floor=True)
    await gc_runner.run_gc(store.layout, policy)  # first sighting
    real = LockFile.refresh
    calls = 0

    def refresh(self: LockFile) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # before the second batch: someone took the lock over
            self.path.write_text(json.dumps({"host": "thief", "pid": 1, "token": "t"}))
        real(self)

    monkeypatch.setattr(LockFile, "refresh", refresh)
    report = await gc_runner.run_gc(store.layout, policy)
    assert report.aborted and "thief" in report.aborted
    assert len(report.trashed) == gc_runner.BATCH
    assert sum(present(store, d) for d in junk) == 10
    # The thief's lock is left alone.
    assert "thief" in (store.layout.state / "gc.lock").read_text()


async def test_a_lost_heartbeat_cancels_the_work(store: TinyStore) -> None:
    lock = gc_runner.lock_file(store.layout, GcPolicy(lock_ttl=0.04))
    lock.acquire()
    run = gc_runner._Run(
        store.layout,
        GcPolicy(lock_ttl=0.04),
        gc_runner.GcReport(str(store.root), "h", False, GcPolicy()),
        lock,
    )
    lock.path.unlink()  # the lock is gone: the next heartbeat finds out
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run.heartbeat)
        with run.work:
            await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert run.work.cancelled_caught
    assert run.report.aborted and "removed" in run.report.aborted


def test_lockfile_refresh_and_release_only_touch_our_own_lock(tmp_path: Path) -> None:
    path = tmp_path / "gc.lock"
    a = LockFile(path, stale_after=600, host="a")
    a.acquire()
    b = LockFile(path, stale_after=600, host="b")
    with pytest.raises(LockBusyError):
        b.acquire()
    b.release()  # not b's: left alone
    assert a.holds()
    path.unlink()
    b.acquire()
    with pytest.raises(LockLostError):
        a.refresh()
    a.release()
    assert b.holds()


# -- invariant 6: two passes, trash first ----------------------------------------------------
def test_a_blob_goes_to_the_trash_on_the_second_pass_and_is_unlinked_after_retention(
    store: TinyStore,
) -> None:
    store.gguf_model("keep:1")
    junk = orphan(store, b"x" * 1000)
    rc, r1, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert [i["digest"] for i in r1["pending"]] == [str(junk)] and not r1["trashed"]
    assert present(store, junk)
    rc, r2, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 0
    assert [i["digest"] for i in r2["trashed"]] == [str(junk)] and r2["bytes_trashed"] == 1000
    assert not present(store, junk)
    (trashed,) = store.layout.trash.glob(f"*/{junk.blob_name}")
    _, r3, _ = gc(store, "--grace", "0", "--grace-below-floor")  # retention 24h: still in the trash
    assert trashed.exists() and not r3["purged"]
    _, r4, _ = gc(store, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
    assert not trashed.exists() and r4["bytes_freed"] == 1000
    assert not list(store.layout.trash.iterdir())  # the emptied stamp dir is gone too


def test_a_trashed_blob_wanted_again_is_put_back(store: TinyStore) -> None:
    data = b"weights someone pulls again"
    junk = orphan(store, data)
    gc(store, "--grace", "0", "--grace-below-floor")
    gc(store, "--grace", "0", "--grace-below-floor")
    assert not present(store, junk)
    # A manifest naming it reappears (another host copied the manifest but not the blob).
    layer = {"mediaType": LAYER + "model", "digest": str(junk), "size": len(data)}
    store.legacy("again:1", store.manifest([layer]))
    _, report, _ = gc(store, "--grace", "0", "--grace-below-floor")
    assert [i["digest"] for i in report["restored"]] == [str(junk)]
    assert store.layout.blob(junk).read_bytes() == data


# -- invariant 7: a dry run changes nothing -------------------------------------------------
def test_a_dry_run_names_what_would_go_and_changes_nothing(store: TinyStore) -> None:
    store.gguf_model("keep:1")
    junk = orphan(store, b"y" * 500)
    gc(store, "--grace", "0", "--grace-below-floor")  # first sighting recorded
    old_trash = store.layout.trash / "20200101T000000Z-old"
    old_trash.mkdir(parents=True)
    (old_trash / f"sha256-{'77' * 32}").write_bytes(b"z" * 300)
    before = tree_state(store.root)
    rc, report, _ = gc(
        store, "--grace", "0", "--grace-below-floor", "--trash-retention", "0", "--dry-run"
    )
    assert rc == 0 and report["dry_run"]
    assert [i["digest"] for i in report["trashed"]] == [str(junk)]
    assert report["bytes_trashed"] == 500 and report["bytes_freed"] == 300
    assert tree_state(store.root) == before
    r = subprocess.run(
        [
            MODELFS,
            "gc",
            "--store",
            str(store.root),
            "--dry-run",
            "--grace",
            "0",
            "--grace-below-floor",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "would move to trash" in r.stdout and junk.blob_name in r.stdout
    assert "dry run: nothing changed" in r.stdout
    assert tree_state(store.root) == before


def test_llama_cpp_view_caches_go_with_their_source_blob(store: TinyStore) -> None:
    raw = store.gguf_model("keep:1", b"weights with a view")
    source = Digest.parse(json.loads(raw)["layers"][0]["digest"])
    gone = Digest("9" * 64)
    caches = {}
    for d in (source, gone):
        path = store.layout.compat / d.hex / "v1" / "blk.0.norm.weight.f32"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"\0" * 64)
        for p in (path, path.parent, path.parent.parent):
            age(p, 2 * HOUR)
        caches[d] = path.parent.parent
    rc, report, _ = gc(store, "--grace", "1h")
    assert rc == 0
    assert caches[source].exists() and not caches[gone].exists()
    assert [i["path"] for i in report["temps_deleted"]] == [f".modelfs/compat/{gone.hex}"]


# -- the filesystem says no -------------------------------------------------------------------
def test_gc_frees_space_on_a_full_disk(tiny_fs: Path) -> None:
    store = TinyStore(tiny_fs / "models")
    store.gguf_model("keep:1", b"kept")
    old = store.layout.trash / "20200101T000000Z-old"
    old.mkdir(parents=True)
    (old / f"sha256-{'77' * 32}").write_bytes(b"z" * (1 << 20))
    filler = tiny_fs / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    rc, report, err = gc(store, "--trash-retention", "0")
    assert rc == 0, err
    assert report["bytes_freed"] == 1 << 20 and not old.exists()
    assert not (store.layout.state / "gc.lock").exists()


def test_a_step_the_filesystem_refuses_is_one_line_not_a_traceback(store: TinyStore) -> None:
    orphan(store, b"would be recorded")
    (store.layout.state / "gc").parent.mkdir(parents=True, exist_ok=True)
    (store.layout.state / "gc").write_bytes(b"not a directory")
    rc, report, err = gc(store, "--grace", "0", "--grace-below-floor")
    assert rc == 1 and "Traceback" not in err
    assert report["errors"] and "nothing moved to trash" in report["errors"][0]
    assert err.strip().splitlines()[-1].startswith("modelfs: error: gc: 1 step failed")


async def test_a_blob_wanted_while_gc_moves_it_is_put_back(
    store: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = orphan(store, b"a pull starts using it right now")
    await gc_runner.run_gc(store.layout, GcPolicy(grace=0, below_floor=True))  # first sighting
    real = gc_runner.move_to_trash

    def move_then_lease(*args: Any) -> bool:
        moved = real(*args)
        # A pull wrote its lease after GC's last look and found the blob still there.
        keeper = LeaseKeeper(store.layout, "pull", host="other-host")
        keeper.hold([junk])
        keeper.write()
        return moved

    monkeypatch.setattr(gc_runner, "move_to_trash", move_then_lease)
    report = await gc_runner.run_gc(store.layout, GcPolicy(grace=0, below_floor=True))
    assert present(store, junk)
    assert not report.trashed and [i.digest for i in report.changed] == [junk]


def test_tag_history_keeps_old_versions_from_every_gc_for_its_retention(
    store: TinyStore,
) -> None:
    from modelfs.store.history import TagHistory
    from modelfs.store.scan import scan_store

    old = store.gguf_model("m:1", b"version one")
    old_blob = Digest.parse(json.loads(old)["layers"][0]["digest"])
    history = TagHistory(store.layout)
    history.observe(scan_store(store.root), time.time())
    store.gguf_model("m:1", b"version two")
    history.observe(scan_store(store.root), time.time())
    age(store.layout.blob(old_blob), 2 * HOUR)
    for _ in range(2):  # no daemon runs: the history itself is a root
        rc, _, _ = gc(store, "--grace", "0", "--grace-below-floor")
        assert rc == 0
    assert present(store, old_blob)
    history.set_retention(0)
    for _ in range(2):
        gc(store, "--grace", "0", "--grace-below-floor")
    assert not present(store, old_blob)


def test_the_plan_sees_a_blob_come_with_the_mtime_of_blobs_put_back(
    store: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reach index keeps blobs/'s listing by its key: a blob added with the directory's
    mtime then put back (`rsync -a`, `tar -x`) moved its ctime, so the plan lists it again."""
    from modelfs.store.index import indexfile

    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # a listing just made may be kept
    store.gguf_model("keep:1")
    policy = GcPolicy(grace=0, below_floor=True)
    plan_gc(store.layout, policy)  # the reach index keeps the listing of blobs/
    st = store.layout.blobs.stat()
    junk = orphan(store, b"y" * 1000)
    os.utime(store.layout.blobs, ns=(st.st_atime_ns, st.st_mtime_ns))
    plan = plan_gc(store.layout, policy)
    assert junk.blob_name in [i.path.name for i in plan.pending + plan.trash]


def test_a_purge_looks_again_and_never_trusts_the_reach_index(
    store: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge cannot be undone. The plan may read reach from `.modelfs/reach-index`; a
    trashed blob a manifest names (written by another host, or an index that is wrong) must
    not be unlinked because the index did not say so: the purge gets the fresh look a move to
    trash gets (GC invariant 3). The index is made wrong by hand here, its stamps kept."""
    from modelfs.store.index import indexfile, reachcache

    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # a file just written may be kept
    store.gguf_model("keep:1")
    junk = orphan(store, b"x" * 1000)
    policy = GcPolicy(grace=0, below_floor=True, trash_retention=0)
    trio.run(gc_runner.run_gc, store.layout, GcPolicy(grace=0, below_floor=True))
    trio.run(gc_runner.run_gc, store.layout, GcPolicy(grace=0, below_floor=True))
    (trashed,) = store.layout.trash.glob(f"*/{junk.blob_name}")
    # Another host tags it again; its blob is only in our trash.
    store.gguf_model("late:1", payload=b"x" * 1000)
    store.layout.blob(junk).unlink()
    plan_gc(store.layout, policy)  # leaves the reach index with late:1 in it
    path = store.layout.state / reachcache.FILE_NAME
    root, files, listing = indexfile.read_index(
        path, reachcache.MAGIC, reachcache.FORMAT_VERSION, store.root
    )[0]
    forged = [(p, k, tuple(n for n in names if n != junk.blob_name)) for p, k, names in files]
    assert forged != [tuple(f) for f in files]
    indexfile.write_index(
        path, reachcache.MAGIC, reachcache.FORMAT_VERSION, (root, forged, listing), store.root
    )
    report = trio.run(gc_runner.run_gc, store.layout, policy)
    assert trashed.exists(), report.purged  # the old purge unlinked it
    assert [i.path.name for i in report.changed] == [junk.blob_name]


def test_a_purge_look_that_cannot_read_a_manifest_stops_the_run(
    store: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge's fresh look refusing (a manifest written unreadable after the plan, by
    another host) stops the run there, as a refused plan does (GC invariant 2): no old temp
    file deleted, no first sighting saved, nothing moved to trash after it."""
    store.gguf_model("keep:1")
    junk = orphan(store, b"x" * 1000)
    trio.run(gc_runner.run_gc, store.layout, GcPolicy(grace=0, below_floor=True))
    trio.run(gc_runner.run_gc, store.layout, GcPolicy(grace=0, below_floor=True))
    assert list(store.layout.trash.glob(f"*/{junk.blob_name}"))
    young = orphan(store, b"y" * 1000)
    old_temp = store.layout.blobs / f"sha256-{'ab' * 32}-partial"
    old_temp.write_bytes(b"x" * 10)
    age(old_temp, 8 * 86400)
    real = gc_runner.plan_gc

    def plan_then_break(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        bad = store.layout.manifests / "registry.ollama.ai" / "library" / "broken" / "latest"
        bad.parent.mkdir(parents=True)
        bad.write_bytes(b"{not json")
        return plan

    monkeypatch.setattr(gc_runner, "plan_gc", plan_then_break)
    report = trio.run(
        gc_runner.run_gc,
        store.layout,
        GcPolicy(grace=0, below_floor=True, trash_retention=0),
    )
    assert report.refused and not report.purged
    assert old_temp.exists() and not report.temps
    assert present(store, young) and not report.trashed
