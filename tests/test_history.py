"""Tag history (store.history): re-tags, removals, persistence, GC roots, retention, pruning.

Stores are built with tests/builders.py; the clock is passed explicitly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelfs.store.collect.gc import GcPolicy, plan_gc
from modelfs.store.digest import Digest
from modelfs.store.history import TagHistory
from modelfs.store.leases import LeaseKeeper
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests.builders import TinyStore

T0 = 1_700_000_000.0
DAY = 86400.0
WEEK = 7 * DAY


@pytest.fixture
def tiny(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


def observe(tiny: TinyStore, now: float, history: TagHistory | None = None) -> list:
    history = history or TagHistory(tiny.layout)
    return history.observe(scan_store(tiny.layout), now)


def model(tiny: TinyStore, weights: bytes, template: bytes = b"{{ .Prompt }}") -> bytes:
    return tiny.manifest([tiny.layer("model", weights), tiny.layer("template", template)])


def log_lines(tiny: TinyStore) -> list[dict]:
    return [json.loads(x) for x in (tiny.layout.history / "log.jsonl").read_text().splitlines()]


def test_legacy_retag_is_recorded_and_old_bytes_kept(tiny: TinyStore) -> None:
    v1 = model(tiny, b"weights one")
    tiny.legacy("llama3:8b", v1)
    first = observe(tiny, T0)
    assert [(c.kind, c.old, c.new) for c in first] == [("added", None, Digest.of_bytes(v1))]

    v2 = model(tiny, b"weights two")
    tiny.legacy("llama3:8b", v2)  # overwrites the file: v1's bytes exist nowhere in the store
    assert not tiny.layout.blob(Digest.of_bytes(v1)).exists()
    changes = observe(tiny, T0 + 60)
    assert len(changes) == 1
    change = changes[0]
    assert change.kind == "changed"
    assert change.name.full == "registry.ollama.ai/library/llama3:8b"
    assert (change.old, change.new, change.time) == (
        Digest.of_bytes(v1),
        Digest.of_bytes(v2),
        T0 + 60,
    )

    history = TagHistory(tiny.layout)
    assert history.manifest_bytes(Digest.of_bytes(v1)) == v1  # saved byte for byte
    assert history.previous("llama3:8b") == (Digest.of_bytes(v1), v1)
    lines = log_lines(tiny)
    assert lines[-1]["old"] == str(Digest.of_bytes(v1))
    assert lines[-1]["new"] == str(Digest.of_bytes(v2))
    assert observe(tiny, T0 + 120) == []  # nothing new


def test_v2_list_retag_keeps_children(tiny: TinyStore) -> None:
    child1 = model(tiny, b"gguf one")
    mlx1 = tiny.manifest([tiny.layer("tensor", b"tensor one", name="w")])
    list1 = tiny.manifest_list([(child1, "llamacpp", "gguf"), (mlx1, "mlx", "safetensors")])
    tiny.v2("gemma4:e2b", list1)
    observe(tiny, T0)

    child2 = model(tiny, b"gguf two")
    list2 = tiny.manifest_list([(child2, "llamacpp", "gguf")])
    tiny.v2("gemma4:e2b", list2)
    # Ollama's re-pull prunes what only the old version used, manifests included.
    for raw in (list1, child1, mlx1):
        tiny.layout.blob(Digest.of_bytes(raw)).unlink()
    (change,) = observe(tiny, T0 + 10)
    assert (change.old, change.new) == (Digest.of_bytes(list1), Digest.of_bytes(list2))

    history = TagHistory(tiny.layout)
    for raw in (list1, child1, mlx1):
        assert history.manifest_bytes(Digest.of_bytes(raw)) == raw
    roots = history.roots(T0 + 20, WEEK)
    assert {Digest.of_bytes(list1), Digest.of_bytes(child1), Digest.of_bytes(mlx1)} <= roots
    assert Digest.of_bytes(b"gguf one") in roots
    assert Digest.of_bytes(b"tensor one") in roots
    assert Digest.of_bytes(b"gguf two") not in roots  # current: reachable anyway, not ours


def test_removal_is_recorded(tiny: TinyStore) -> None:
    v1 = model(tiny, b"weights")
    path = tiny.legacy("someuser/tiny:q8", v1)
    observe(tiny, T0)
    path.unlink()
    (change,) = observe(tiny, T0 + 5)
    assert (change.kind, change.old, change.new) == ("removed", Digest.of_bytes(v1), None)
    history = TagHistory(tiny.layout)
    assert Digest.of_bytes(b"weights") in history.roots(T0 + 6, DAY)
    assert observe(tiny, T0 + 10) == []  # recorded once


def test_unreadable_manifest_is_not_a_removal(tiny: TinyStore) -> None:
    path = tiny.legacy("llama3:8b", model(tiny, b"w"))
    observe(tiny, T0)
    path.write_bytes(b"")  # half-written by someone, or truncated by a crash
    assert observe(tiny, T0 + 5) == []


def test_change_while_nothing_ran_is_seen_by_a_new_instance(tiny: TinyStore) -> None:
    v1 = model(tiny, b"one")
    tiny.legacy("qwen3:30b", v1)
    TagHistory(tiny.layout).observe(scan_store(tiny.layout), T0)
    v2 = model(tiny, b"two")
    tiny.legacy("qwen3:30b", v2)  # while no daemon runs
    changes = TagHistory(tiny.layout).observe(scan_store(tiny.layout), T0 + DAY)
    assert [(c.old, c.new) for c in changes] == [(Digest.of_bytes(v1), Digest.of_bytes(v2))]


def test_two_hosts_record_a_change_once(tiny: TinyStore) -> None:
    tiny.legacy("llama3:8b", model(tiny, b"one"))
    a, b = TagHistory(tiny.layout, host="a"), TagHistory(tiny.layout, host="b")
    a.observe(scan_store(tiny.layout), T0)
    assert b.observe(scan_store(tiny.layout), T0 + 1) == []
    tiny.legacy("llama3:8b", model(tiny, b"two"))
    assert len(b.observe(scan_store(tiny.layout), T0 + 2)) == 1
    assert a.observe(scan_store(tiny.layout), T0 + 3) == []
    assert [x["host"] for x in log_lines(tiny)] == ["a", "b"]


def test_torn_and_repeated_lines_are_ignored(tiny: TinyStore) -> None:
    v1 = model(tiny, b"one")
    tiny.legacy("llama3:8b", v1)
    observe(tiny, T0)
    log = tiny.layout.history / "log.jsonl"
    first = log.read_bytes()
    with open(log, "ab") as f:
        f.write(first)  # the same record again (a crash between append and... anything)
        f.write(b'{"name": "registry.ollama.ai/library/llama3:8b", "old"')  # torn by a crash
    v2 = model(tiny, b"two")
    tiny.legacy("llama3:8b", v2)
    (change,) = observe(tiny, T0 + 1)
    assert change.old == Digest.of_bytes(v1)
    history = TagHistory(tiny.layout)
    assert [(r.old, r.new) for r in history.records("llama3:8b")] == [
        (None, Digest.of_bytes(v1)),
        (Digest.of_bytes(v1), Digest.of_bytes(v2)),
    ]
    assert log.read_bytes().endswith(b"\n")


def test_roots_until_retention_then_gone(tiny: TinyStore) -> None:
    v1 = model(tiny, b"old weights")
    tiny.legacy("llama3:8b", v1)
    observe(tiny, T0)
    tiny.legacy("llama3:8b", model(tiny, b"new weights"))
    observe(tiny, T0 + 100)
    history = TagHistory(tiny.layout)
    old = {Digest.of_bytes(v1), Digest.of_bytes(b"old weights")}
    assert old <= history.roots(T0 + 100 + WEEK - 1, WEEK)
    assert Digest.of_bytes(b"{{ .Prompt }}") in history.roots(T0 + 101, WEEK)  # shared, too
    assert history.roots(T0 + 100 + WEEK, WEEK) == set()


def test_roots_in_a_lease_keep_old_blobs_from_gc(tiny: TinyStore) -> None:
    tiny.legacy("llama3:8b", model(tiny, b"old weights"))
    observe(tiny, T0)
    tiny.legacy("llama3:8b", model(tiny, b"new weights"))
    now = T0 + 100
    observe(tiny, now)
    old_blob = tiny.layout.blob(Digest.of_bytes(b"old weights"))
    os.utime(old_blob, (now - 10 * DAY, now - 10 * DAY))  # well past any grace

    policy = GcPolicy(grace=0.0, below_floor=True)
    history = TagHistory(tiny.layout)
    history.set_retention(0)  # nothing kept by the history itself: only the lease below
    plan = plan_gc(tiny.layout, policy, now=now + 1)
    assert old_blob in [i.path for i in plan.pending + plan.trash]  # without the lease: goes

    lease = LeaseKeeper(tiny.layout, "history")
    lease.hold(digests=history.roots(now, WEEK))
    lease.write()
    plan = plan_gc(tiny.layout, policy, now=now + 1)
    assert old_blob in [i.path for i in plan.leased]
    assert old_blob not in [i.path for i in plan.pending + plan.trash]


def test_prune_drops_old_records_and_manifests(tiny: TinyStore) -> None:
    v1, v2 = model(tiny, b"one"), model(tiny, b"two")
    tiny.legacy("llama3:8b", v1)
    observe(tiny, T0)
    tiny.legacy("llama3:8b", v2)
    observe(tiny, T0 + DAY)
    gone = tiny.legacy("phi3:mini", model(tiny, b"phi"))
    observe(tiny, T0 + DAY)
    gone.unlink()
    observe(tiny, T0 + 2 * DAY)
    history = TagHistory(tiny.layout)
    saved = history.manifests_dir

    kept = history.prune(T0 + 2 * DAY, WEEK)  # nothing is old yet
    assert (kept.records_dropped, kept.manifests_removed) == (0, 0)
    assert len(log_lines(tiny)) == 4  # llama3 added, changed; phi3 added, removed

    result = history.prune(T0 + 2 * DAY + WEEK + 1, WEEK)
    # left: llama3's latest record, the anchor the next observe compares with
    assert result.records_dropped == 3
    assert [(x["name"], x["new"]) for x in log_lines(tiny)] == [
        ("registry.ollama.ai/library/llama3:8b", str(Digest.of_bytes(v2)))
    ]
    assert result.manifests_removed == 2  # v1 and phi; v2 is current
    assert sorted(os.listdir(saved)) == [Digest.of_bytes(v2).blob_name]
    assert history.previous("llama3:8b") is None
    assert observe(tiny, T0 + 3 * WEEK) == []  # the anchor still says what is current
    assert history.roots(T0 + 3 * WEEK, WEEK) == set()


def test_previous_when_tag_moved_since_last_observation(tiny: TinyStore) -> None:
    v1, v2 = model(tiny, b"one"), model(tiny, b"two")
    tiny.legacy("llama3:8b", v1)
    observe(tiny, T0)
    tiny.legacy("llama3:8b", v2)  # not observed yet
    history = TagHistory(tiny.layout)
    assert history.previous(parse_name("llama3:8b"), current=Digest.of_bytes(v2)) == (
        Digest.of_bytes(v1),
        v1,
    )
    assert history.previous("llama3:8b", current=Digest.of_bytes(v1)) is None


def test_a_removal_outlives_the_prune_of_its_older_records(tiny: TinyStore) -> None:
    """The removed version stays a root (and its manifest saved) for the retention, even
    after prune has dropped the record that added it."""
    raw = model(tiny, b"removed weights")
    path = tiny.legacy("llama3:8b", raw)
    observe(tiny, T0)
    path.unlink()
    now = T0 + 10 * DAY
    observe(tiny, now)
    history = TagHistory(tiny.layout)
    for t in (now + 1, now + 2):
        history.prune(t, WEEK)
        assert Digest.of_bytes(b"removed weights") in history.roots(t, WEEK)
        assert history.manifest_bytes(Digest.of_bytes(raw)) is not None
    assert history.roots(now + WEEK + 1, WEEK) == set()
