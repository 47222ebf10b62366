"""`modelfs verify` on worker processes, and what `--quick` promises (docs/gc.md).

The damage: one small blob among hundreds changed in place, its size and mtime put back (so
only its bytes and its ctime betray it); damage that bypasses the filesystem, simulated by
giving the cache the stamp the damaged file now has (a failing disk changes bytes, never a
ctime); workers stopped, killed, and a verify interrupted with Ctrl-C.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from modelfs.store.collect.verify import (
    CHUNK,
    SAMPLE_FROM,
    Interrupted,
    hash_fd,
    sample_hash,
    sample_pieces,
)
from modelfs.store.collect.verify_cache import VerifyCache
from modelfs.store.collect.workers import WorkerError, Workers
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.layout import Layout
from modelfs.sync.daemon.verify import BATCH_BLOBS
from tests.builders import TinyStore
from tests.test_pull import weights
from tests.test_verify import Model, command, verify, zero_in_place

MiB = 1 << 20


def flip_in_place(path: Path, offset: int) -> None:
    """Flip one bit at `offset`; size and mtime put back to the nanosecond."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def as_if_unchanged(layout: Layout, name: str) -> None:
    """Give the cache entry of `name` the stamp its file has now: what a quick run sees
    after damage that did not go through the filesystem (which leaves the ctime alone)."""
    cache = VerifyCache.load(layout)
    st = (layout.blobs / name).stat()
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    entry = cache.get(name)
    assert entry is not None
    cache.put(name, entry._replace(stamp=stamp))
    assert cache.save()


def many_small(root: Path, n: int) -> tuple[TinyStore, list[bytes]]:
    tiny = TinyStore(root)
    payloads = [weights(200 + i % 300, seed=i) for i in range(n)]
    tiny.legacy("many:1", tiny.manifest([tiny.layer("params", p) for p in payloads]))
    return tiny, payloads


# -- full checks on workers ---------------------------------------------------------------------
def test_a_small_blob_changed_in_place_among_many_is_caught_by_a_full_check(
    tmp_path: Path,
) -> None:
    # Several batches, so several workers: the bad blob is in the middle of one.
    tiny, payloads = many_small(tmp_path / "models", 3 * BATCH_BLOBS)
    rc, report, _ = verify(tiny.root)
    assert rc == 0 and report["checked"]["sha256"] == report["checked"]["blobs"]
    bad = Digest.of_bytes(payloads[len(payloads) // 2])
    flip_in_place(tiny.layout.blob(bad), 7)
    rc, report, _ = verify(tiny.root)
    assert rc == 1 and report["problems"] == ["1 corrupt"]
    [corrupt] = report["corrupt"]
    assert corrupt["blob"] == f"blobs/{bad.blob_name}"
    assert corrupt["quarantined"] == f".modelfs/quarantine/{bad.blob_name}"
    assert report["checked"]["blobs"] == len(payloads) + 1  # and the config
    assert report["checked"]["sha256"] == len(payloads) + 1
    assert not tiny.layout.blob(bad).exists()


def test_quick_catches_a_small_blob_changed_in_place_by_its_ctime(tmp_path: Path) -> None:
    tiny, payloads = many_small(tmp_path / "models", 50)
    assert verify(tiny.root)[0] == 0
    bad = Digest.of_bytes(payloads[3])
    flip_in_place(tiny.layout.blob(bad), 0)
    rc, report, _ = verify(tiny.root, "--quick")
    assert rc == 1 and [c["blob"] for c in report["corrupt"]] == [f"blobs/{bad.blob_name}"]
    # Only that blob was read: the others passed on their stamps alone.
    assert report["checked"]["sha256"] == 1
    assert report["checked"]["bytes_read"] == len(payloads[3])


def findings(report: dict[str, Any]) -> dict[str, Any]:
    """What a report says of the store, but for how its blobs were checked."""
    keys = ("ok", "problems", "corrupt", "missing", "orphaned", "stray", "misnamed")
    return {
        **{k: report[k] for k in (*keys, "bad_manifests")},
        "blobs": report["checked"]["blobs"],
        "bytes": report["checked"]["bytes"],
    }


def test_quick_reports_the_store_as_a_full_run_does(tmp_path: Path) -> None:
    """All that a full run reports but the bytes of unchanged blobs is --quick's too, after
    blobs/ changed since the last full check (a blob new, one gone, one misnamed, strays, a
    link and a directory under blob names) and again while blobs/ stays as it was (when the
    listing the cache recorded is used)."""
    tiny, payloads = many_small(tmp_path / "models", 3 * BATCH_BLOBS)
    other = Digest.of_bytes(b"other weights")
    tiny.gguf_model("other:1", payload=b"other weights")
    tiny.legacy("bad:1", b"")  # a zero-length manifest, as a full disk leaves it
    assert verify(tiny.root)[0] == 1
    blobs = tiny.layout.blobs
    gone = Digest.of_bytes(payloads[5])
    (blobs / gone.blob_name).unlink()  # a blob a manifest names: missing
    tiny.blob(b"an orphan added since")
    (blobs / f"{Digest('1' * 64).blob_name}-partial").write_bytes(bytes(123))
    os.symlink("/etc/hostname", blobs / Digest("2" * 64).blob_name)
    (blobs / Digest("3" * 64).blob_name).mkdir()
    os.rename(blobs / other.blob_name, blobs / f"sha256:{other.hex}")
    flip_in_place(tiny.layout.blob(Digest.of_bytes(payloads[7])), 3)

    rc, quick, _ = verify(tiny.root, "--quick")
    assert rc == 1
    assert quick["checked"]["sha256"] == 2  # the new blob, the changed one
    assert [c["blob"] for c in quick["corrupt"]] == [
        f"blobs/{Digest.of_bytes(payloads[7]).blob_name}"
    ]
    rc, again, _ = verify(tiny.root, "--quick")  # blobs/ as the last run listed it
    assert rc == 1 and again["checked"]["sha256"] == 0
    rc, full, _ = verify(tiny.root)
    assert rc == 1
    assert findings(again) == findings(full)
    # The first quick run found the changed blob corrupt and moved it: the later runs call
    # it missing. Of the rest, it said what they say.
    bad = str(Digest.of_bytes(payloads[7]))
    first = findings(quick)
    assert first["missing"] == [m for m in full["missing"] if m["digest"] != bad]
    assert first["blobs"] == full["checked"]["blobs"] + 1
    for key in ("orphaned", "stray", "misnamed", "bad_manifests"):
        assert first[key] == full[key], key
    # What each of those is.
    assert {m["digest"] for m in full["missing"]} == {str(gone), str(other), bad}
    assert [m["path"] for m in full["misnamed"]] == [f"blobs/sha256:{other.hex}"]
    assert [p["path"] for p in full["bad_manifests"]] == [
        "manifests/registry.ollama.ai/library/bad/1"
    ]
    assert f"blobs/{Digest('1' * 64).blob_name}-partial" in [
        f["path"] for f in full["stray"]["files"]
    ]
    assert [o["blob"] for o in full["orphaned"]["blobs"]] == [
        f"blobs/{Digest.of_bytes(b'an orphan added since').blob_name}"
    ]
    regular = [p for p in blobs.iterdir() if is_blob_name(p.name) and not p.is_symlink()]
    assert full["checked"]["blobs"] == len([p for p in regular if p.is_file()])


def test_quick_takes_the_last_survey_again_only_while_the_tags_and_blobs_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quick run takes the survey of the run before (no scan) while blobs/ and every tag file
    are as they were, and surveys afresh once a tag is removed, edited or added; the owners of
    a blob it finds corrupt are named either way."""
    import modelfs.sync.daemon.verify as dv
    from modelfs.store.index import indexfile
    from modelfs.store.names import parse_name
    from modelfs.sync.daemon.verify import VerifyOptions, run_verify

    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # this test's writes are kept at once
    scans = []
    real = dv._scan

    def counted(layout: Layout) -> Any:
        scans.append(1)
        return real(layout)

    monkeypatch.setattr(dv, "_scan", counted)
    m = Model(tmp_path / "models")
    m.tiny.gguf_model("other:1", payload=b"other weights")

    def quick() -> Any:
        scans.clear()
        return run_verify(m.root, VerifyOptions(quick=True, workers=2))

    assert run_verify(m.root, VerifyOptions(workers=2)).ok
    report = quick()
    assert report.ok and not report.orphaned and scans == []  # the last survey, again

    other = m.layout.legacy_manifest(parse_name("other:1"))
    raw = other.read_bytes()
    other.unlink()  # `ollama rm other:1`: its own blobs are orphans now
    report = quick()
    assert scans == [1]
    assert [n for n, _ in report.orphaned] == [Digest.of_bytes(b"other weights").blob_name]
    assert quick().orphaned == report.orphaned and scans == []

    m.tiny.legacy("other:1", raw)  # back, a new file
    report = quick()
    assert scans == [1] and report.ok and not report.orphaned
    m.tiny.legacy("bad:1", b"")  # a manifest a full disk left empty
    report = quick()
    assert scans == [1] and [p for p, _ in report.bad_manifests] == [
        "manifests/registry.ollama.ai/library/bad/1"
    ]
    # A file that cannot be read is not kept by the reach index: surveyed afresh each time.
    again = quick()
    assert scans == [1] and again.bad_manifests == report.bad_manifests
    m.layout.legacy_manifest(parse_name("bad:1")).unlink()
    assert quick().ok and scans == [1]
    assert quick().ok and scans == []

    zero_in_place(m.blob)  # a blob's bytes: a scan only to name its owners
    report = quick()
    [corrupt] = report.corrupt
    assert [o.label for o in corrupt.owners] == ["llama3.2:3b"] and scans == [1]


def test_quick_sees_blobs_come_and_go_with_the_mtime_of_blobs_put_back(tmp_path: Path) -> None:
    """A blob added, one a manifest names deleted and a partial left, with blobs/'s mtime then
    put back (as `rsync -a` or `tar -x` restores a directory's): blobs/'s ctime moved, so
    --quick lists it again, checks the new blob, and the scan sees the missing one."""
    tiny, payloads = many_small(tmp_path / "models", 20)
    assert verify(tiny.root)[0] == 0
    assert verify(tiny.root, "--quick")[0] == 0  # the listing is known by blobs/'s key now
    blobs = tiny.layout.blobs
    st = blobs.stat()
    added = Digest("ab" * 32)
    (blobs / added.blob_name).write_bytes(b"not those bytes")
    deleted = Digest.of_bytes(payloads[3])
    (blobs / deleted.blob_name).unlink()
    partial = f"blobs/{Digest('cd' * 32).blob_name}-partial"
    (tiny.root / partial).write_bytes(bytes(10))
    os.utime(blobs, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert blobs.stat().st_mtime_ns == st.st_mtime_ns

    rc, report, _ = verify(tiny.root, "--quick")
    assert rc == 1 and report["unreadable"] == []
    assert [c["blob"] for c in report["corrupt"]] == [f"blobs/{added.blob_name}"]
    assert [m["digest"] for m in report["missing"]] == [str(deleted)]
    assert [f["path"] for f in report["stray"]["files"]] == [partial]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_quick_reports_a_large_blob_become_no_file_as_a_full_run_does(
    tmp_path: Path, kind: str
) -> None:
    """A large blob (one the cache has a sample of) that is now a FIFO, a link or a directory
    is missing, as a full run says, not a blob whose sample could not be read."""
    m = Model(tmp_path / "models", size=2 * SAMPLE_FROM)
    assert verify(m.root)[0] == 0
    m.blob.unlink()
    if kind == "fifo":
        os.mkfifo(m.blob)
    elif kind == "symlink":
        m.blob.symlink_to(m.layout.blob(Digest.of_bytes(b"MIT")))
    else:
        m.blob.mkdir()
    rc, quick, _ = verify(m.root, "--quick")
    rc_full, full, _ = verify(m.root)
    assert rc == rc_full == 1
    assert quick["problems"] == full["problems"] == ["1 missing"]
    assert findings(quick) == findings(full)


def test_quick_keeps_the_new_listing_when_only_a_name_with_no_entry_came(tmp_path: Path) -> None:
    """A stray that came to blobs/ changes no entry, and with a manifest list in the store no
    survey is kept either: the cache is still to be written, with the listing and blobs/'s
    key as they are now, or every later --quick lists blobs/ again and aligns it by name."""
    tiny, _ = many_small(tmp_path / "models", 20)
    child = tiny.manifest([tiny.layer("model", b"child weights")])
    tiny.legacy("listed:1", tiny.manifest_list([(child, "llama", "gguf")]))
    assert verify(tiny.root)[0] == 0
    assert verify(tiny.root, "--quick")[0] == 0
    (tiny.layout.blobs / "sha256-partial-1").write_bytes(b"x")
    assert verify(tiny.root, "--quick")[0] == 0
    cache = VerifyCache.load(tiny.layout)
    st = tiny.layout.blobs.stat()
    assert cache.listed == (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    assert sorted(cache.names) == sorted(os.listdir(tiny.layout.blobs))


# -- what --quick cannot catch, as docs/gc.md says ---------------------------------------------
def test_quick_misses_damage_below_the_filesystem_in_a_small_blob_and_full_does_not(
    tmp_path: Path,
) -> None:
    tiny, payloads = many_small(tmp_path / "models", 10)
    assert verify(tiny.root)[0] == 0
    bad = Digest.of_bytes(payloads[0])
    flip_in_place(tiny.layout.blob(bad), 5)
    as_if_unchanged(tiny.layout, bad.blob_name)
    rc, report, _ = verify(tiny.root, "--quick")
    assert rc == 0 and report["checked"]["bytes_read"] == 0  # under 1 MiB: the stamp alone
    rc, report, _ = verify(tiny.root)
    assert rc == 1 and [c["blob"] for c in report["corrupt"]] == [f"blobs/{bad.blob_name}"]


@pytest.mark.parametrize("where", ["sampled", "between samples"])
def test_quick_sees_damage_below_the_filesystem_only_in_its_sample(
    tmp_path: Path, where: str
) -> None:
    m = Model(tmp_path / "models", size=4 * MiB)
    pieces = sample_pieces(len(m.payload))
    assert len(pieces) == 16 and sum(n for _, n in pieces) == len(m.payload) // 16
    assert pieces[0][0] == 0 and sum(pieces[-1]) == len(m.payload)  # first and last byte
    assert verify(m.root)[0] == 0
    first_gap = pieces[0][1] + 10
    assert first_gap < pieces[1][0]
    offset = pieces[5][0] + 100 if where == "sampled" else first_gap
    flip_in_place(m.blob, offset)
    as_if_unchanged(m.layout, m.digest.blob_name)
    rc, report, _ = verify(m.root, "--quick")
    if where == "sampled":
        # The sample differs: a full check confirms it, and it is quarantined.
        assert rc == 1 and report["problems"] == ["1 corrupt"]
        assert report["checked"]["sha256"] == 1
    else:
        assert rc == 0 and report["checked"]["sha256"] == 0
        rc, report, _ = verify(m.root)
        assert rc == 1 and report["problems"] == ["1 corrupt"]


def test_quick_reads_a_sixteenth_of_a_large_blob_and_nothing_of_small_ones(
    tmp_path: Path,
) -> None:
    m = Model(tmp_path / "models", size=SAMPLE_FROM * 3 + 12345)
    assert verify(m.root)[0] == 0
    rc, report, _ = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == 0
    assert report["checked"]["xxh3_only"] == report["checked"]["blobs"] == 4
    assert report["checked"]["bytes_read"] == sum(n for _, n in sample_pieces(len(m.payload)))
    assert report["checked"]["bytes_read"] <= len(m.payload) // 16


def test_quick_without_a_cache_entry_is_a_full_check(tmp_path: Path) -> None:
    tiny, _ = many_small(tmp_path / "models", 20)
    rc, report, _ = verify(tiny.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == report["checked"]["blobs"] == 21


# -- workers are always stopped -----------------------------------------------------------------
def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_workers_stop_when_told_to_mid_run(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    # Sparse blobs (no disk) of 64 MiB each, seconds of hashing in all (their names are
    # wrong, which does not matter: the run is stopped long before the end).
    units: list[Any] = []
    for i in range(100):
        name = f"sha256-{i:064x}"
        with open(tiny.layout.blobs / name, "wb") as f:
            f.truncate(64 * MiB)
        units.append(([name], None))
    with Workers(tiny.layout, units, 2) as pool:
        pids = [p.pid for p in pool.procs if p.pid is not None]
        assert len(pids) == 2
        with pytest.raises(Interrupted):
            pool.run(stop=lambda: pool.progress()[0] >= 3)
        assert pool.progress()[0] < len(units)  # stopped before the end
    assert all(gone(pid) for pid in pids)


def test_a_worker_killed_mid_run_is_an_error_and_the_others_stop(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    # Sparse blobs (no disk used) that take seconds each to hash, so the run cannot end before
    # the kill lands (400 small blobs were all checked first, now and then).
    names = [f"sha256-{i:064x}" for i in range(4)]
    for name in names:
        with open(tiny.layout.blobs / name, "wb") as f:
            f.truncate(4 << 30)
    units: list[Any] = [([name], None) for name in names]
    with Workers(tiny.layout, units, 2) as pool:
        pids = [p.pid for p in pool.procs if p.pid is not None]
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerError):
            pool.run(stop=lambda: False)
    assert all(gone(pid) for pid in pids)


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        out.update(int(x) for x in text.split())
    return out


def test_ctrl_c_stops_verify_and_its_workers(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    # Sparse blobs (no disk used) that take seconds to hash; named wrong, which does not
    # matter: the run is interrupted first.
    for i in range(4):
        with open(m.layout.blobs / f"sha256-{i:064x}", "wb") as f:
            f.truncate(8 << 30)
    proc = subprocess.Popen(
        command("verify", "--store", str(m.root)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = children(proc.pid)
            time.sleep(0.05)
        assert len(workers) >= 2, "no workers started"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert b"Traceback" not in err, err.decode(errors="replace")
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in workers)


@pytest.mark.parametrize(
    "size",
    [
        0,
        1,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        SAMPLE_FROM - 1,
        SAMPLE_FROM,
        3 * SAMPLE_FROM + 12345,
        17 * MiB + 1,
    ],
)
def test_the_sample_taken_in_the_full_pass_is_the_one_quick_reads(
    tmp_path: Path, size: int
) -> None:
    """A full check hashes the sample in its one pass, chunk by chunk, where pieces straddle
    chunks; --quick reads the pieces alone. Both must agree, or every quick run would
    re-hash every large blob (or, worse, pass a changed one)."""
    data = weights(size, seed=size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        sampled = size >= SAMPLE_FROM
        hashes = hash_fd(fd, size_hint=size, sample=sampled)
        assert hashes.sha256 == hashlib.sha256(data).hexdigest() and hashes.size == size
        assert hashes.sample == (sample_hash(fd, size) if sampled else None)
        if sampled:
            want = xxhash.xxh3_128(b"".join(data[o : o + n] for o, n in sample_pieces(size)))
            assert hashes.sample == want.hexdigest()
    finally:
        os.close(fd)


def test_an_unreadable_small_blob_among_many_is_reported_by_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small blob is read with one pread (a large one with preadv): its EIO, raised in a
    worker process (forked after the patch, so it has it), is one UNREADABLE line."""
    import errno

    import modelfs.store.collect.verify as sv
    from modelfs.sync.daemon.verify import VerifyOptions, run_verify

    tiny, payloads = many_small(tmp_path / "models", 3 * BATCH_BLOBS)
    bad = Digest.of_bytes(payloads[100]).blob_name
    real = os.pread

    def failing(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(bad):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(sv.os, "pread", failing)
    report = run_verify(tiny.root, VerifyOptions(workers=2))
    assert report.problems == ["1 unreadable"]
    assert report.unreadable == [(bad, "Input/output error")]
    assert report.sha256 == len(payloads)  # every other blob, and the config
    assert tiny.layout.blob(Digest.of_bytes(payloads[100])).exists()  # not moved


def test_a_worker_that_fails_raises_its_error_and_every_worker_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import modelfs.store.collect.workers as sw

    tiny, payloads = many_small(tmp_path / "models", 40)
    units: list[Any] = [([Digest.of_bytes(p).blob_name], None) for p in payloads]

    def broken(*args: object, **kw: object) -> object:
        raise RuntimeError("a bug in a worker")

    monkeypatch.setattr(sw, "check_batch", broken)
    with Workers(tiny.layout, units, 2) as pool:
        pids = [p.pid for p in pool.procs if p.pid is not None]
        with pytest.raises(RuntimeError, match="a bug in a worker"):
            pool.run(stop=lambda: False)
    assert all(gone(pid) for pid in pids)


class Unpicklable(Exception):
    """An exception that holds a lock: it cannot cross a pipe."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class NeedsTwo(Exception):
    """One that pickles but does not unpickle (its __init__ takes two arguments)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (Unpicklable("a lock in the way"), "Unpicklable: a lock in the way"),
        (NeedsTwo("blob", "odd"), "NeedsTwo: blob: odd"),
    ],
    ids=["unpicklable", "not-unpicklable"],
)
def test_a_worker_error_that_cannot_cross_the_pipe_is_told_by_type_and_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, said: str
) -> None:
    import modelfs.store.collect.workers as sw

    tiny, payloads = many_small(tmp_path / "models", 4)
    units: list[Any] = [([Digest.of_bytes(p).blob_name], None) for p in payloads]

    def broken(*args: object, **kw: object) -> object:
        raise error

    monkeypatch.setattr(sw, "check_batch", broken)
    with Workers(tiny.layout, units, 2) as pool, pytest.raises(WorkerError) as raised:
        pool.run(stop=lambda: False)
    assert str(raised.value) == f"a verify worker failed: {said}"
