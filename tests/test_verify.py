"""`modelfs verify`: real stores, the real command, a real server and mount.

The damage is what users report: a blob zeroed at full size (its mtime put back, so nothing
but the bytes betrays it), a truncated or deleted blob, Ollama's partials, a blob copied from
Windows as `sha256:<hex>`, orphans after `ollama rm`. Each test checks the exit status, the
JSON report and the store afterwards.
"""

from __future__ import annotations

import array
import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelfs.store.collect.verify import CacheEntry, FileKey, check_blob, quarantine_blob
from modelfs.store.collect.verify_cache import VerifyCache
from modelfs.store.digest import Digest
from modelfs.store.history import TagHistory
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.store.units import counted, human_bytes
from modelfs.sync.daemon.verify import VerifyOptions, run_verify
from tests.builders import TinyStore
from tests.mounting import fuse, mounted
from tests.test_mount import wait_until
from tests.test_pull import weights
from tests.test_serve_process import served

MODELFS = str(Path(sys.executable).with_name("modelfs"))
MiB = 1 << 20


# -- helpers ----------------------------------------------------------------------------------
class Model:
    """`llama3.2:3b` in a TinyStore: a model blob of `size` bytes, template, license, config."""

    def __init__(self, root: Path, size: int = 2 * MiB, name: str = "llama3.2:3b") -> None:
        self.tiny = TinyStore(root)
        self.payload = weights(size)
        self.raw = self.tiny.gguf_model(name, self.payload)
        self.digest = Digest.of_bytes(self.payload)
        self.name = name

    @property
    def root(self) -> Path:
        return self.tiny.root

    @property
    def layout(self) -> Layout:
        return self.tiny.layout

    @property
    def blob(self) -> Path:
        return self.layout.blob(self.digest)

    def layers(self) -> list[dict[str, Any]]:
        return json.loads(self.raw)["layers"]  # type: ignore[no-any-return]


# The stores here are written a moment before they are verified, within the verify cache's
# racy margin (indexfile.RACY_NS), in which a check keeps no cache entry and a --quick after it
# hashes everything again. So the command runs as it ships but for that margin, at 0; a test
# of the margin itself passes `racy=True` (the real one).
NO_RACY_MARGIN = (
    "import modelfs.store.index.indexfile as f; f.RACY_NS = 0; from modelfs.cli import main; main()"
)


def command(*args: str, racy: bool = False) -> list[str]:
    """`modelfs *args`, without the racy margin unless `racy`."""
    return [MODELFS, *args] if racy else [sys.executable, "-c", NO_RACY_MARGIN, *args]


def verify(root: Path, *args: str, racy: bool = False) -> tuple[int, dict[str, Any], str]:
    """`modelfs verify --json` as a process: (exit status, report, stderr)."""
    proc = subprocess.run(
        command("verify", "--store", str(root), "--json", *args, racy=racy),
        capture_output=True,
        timeout=120,
        check=False,
    )
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode in (0, 1), err
    assert "Traceback" not in err, err
    return proc.returncode, json.loads(proc.stdout), err


def verify_text(root: Path, *args: str) -> tuple[int, str]:
    proc = subprocess.run(
        command("verify", "--store", str(root), *args),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in proc.stderr.decode(errors="replace")
    return proc.returncode, proc.stdout.decode()


def zero_in_place(path: Path) -> None:
    """Overwrite every byte with zeros, same inode, same size, mtime put back to the ns."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(bytes(st.st_size))
        f.flush()
        os.fsync(f.fileno())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )


def blob_names(report: dict[str, Any], key: str) -> list[str]:
    return [c["blob"] for c in report[key]]


# -- a clean store ----------------------------------------------------------------------------
def test_clean_store_passes(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    rc, report, err = verify(m.root)
    assert rc == 0
    assert report["ok"] is True and report["problems"] == []
    # Sizes as everywhere else (store.units), not "0.0 GB" for a small store.
    total = sum(p.stat().st_size for p in m.layout.blobs.iterdir())
    assert f"verifying 4 blobs ({human_bytes(total)})," in err, err
    assert report["mode"] == "full"
    # model, template, license, config
    assert report["checked"]["blobs"] == 4
    assert report["checked"]["sha256"] == 4
    assert report["checked"]["bytes"] == sum(p.stat().st_size for p in m.layout.blobs.iterdir())
    for key in ("corrupt", "unreadable", "missing", "misnamed", "bad_manifests", "quarantine"):
        assert report[key] == [], key
    assert report["orphaned"] == {"bytes": 0, "reclaimable_bytes": 0, "blobs": []}
    rc, text = verify_text(m.root, "--quick")
    assert rc == 0
    assert text.strip().endswith("ok: every blob matches its name and every manifest is whole")


# -- a blob zeroed at full size -----------------------------------------------------------------
def test_zeroed_blob_full_check_catches_it(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    zero_in_place(m.blob)
    rc, report, err = verify(m.root)
    assert rc == 1
    assert report["ok"] is False and report["problems"] == ["1 corrupt"]
    [corrupt] = report["corrupt"]
    assert corrupt["blob"] == f"blobs/{m.digest.blob_name}"
    assert corrupt["size"] == len(m.payload)
    assert corrupt["actual"] == str(Digest.of_bytes(bytes(len(m.payload))))
    assert corrupt["quarantined"] == f".modelfs/quarantine/{m.digest.blob_name}"
    assert corrupt["manifests"] == [
        {"manifest": "manifests/registry.ollama.ai/library/llama3.2/3b", "name": "llama3.2:3b"}
    ]
    # Reported once: as corrupt, not also as a missing blob of its manifest.
    assert report["missing"] == []
    assert not m.blob.exists()
    assert (m.layout.quarantine / m.digest.blob_name).read_bytes() == bytes(len(m.payload))
    assert "is corrupt" in err
    # Afterwards the model lacks that blob: reported as missing, still not ok.
    rc, report, _ = verify(m.root)
    assert rc == 1
    assert [x["digest"] for x in report["missing"]] == [str(m.digest)]
    assert report["quarantine"] == [
        {"path": f".modelfs/quarantine/{m.digest.blob_name}", "size": len(m.payload)}
    ]


@fuse
def test_zeroed_blob_quick_check_catches_it_and_nobody_serves_it(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    rc, report, _ = verify(m.root)  # the full check the quick one compares with
    assert rc == 0
    blob_url_path = f"/v2/library/llama3.2/blobs/{m.digest}"
    mnt = tmp_path / "mnt"
    with served(m.root) as (url, _), mounted(m.root, mnt):
        model_file = mnt / "llama3.2" / "3b" / "model.gguf"
        raw_file = mnt / ".blobs" / m.digest.blob_name
        assert model_file.read_bytes() == m.payload
        zero_in_place(m.blob)
        # Until verify runs, the zeroed bytes are what everyone gets (so the test can fail).
        r = httpx.get(url + blob_url_path)
        assert r.status_code == 200 and r.content == bytes(len(m.payload))

        rc, report, _ = verify(m.root, "--quick")
        assert rc == 1
        assert report["mode"] == "quick"
        assert blob_names(report, "corrupt") == [f"blobs/{m.digest.blob_name}"]
        # Three blobs passed on xxh3 alone; the zeroed one was confirmed with sha256.
        assert report["checked"]["xxh3_only"] == 3
        assert report["checked"]["sha256"] == 1
        assert not m.blob.exists()
        assert (m.layout.quarantine / m.digest.blob_name).exists()

        assert httpx.head(url + blob_url_path).status_code == 404
        assert httpx.get(url + blob_url_path).status_code == 404
        # The mount drops the file (and the raw blob) within a few seconds.
        assert wait_until(lambda: "model.gguf" not in os.listdir(model_file.parent), 5)
        assert wait_until(lambda: m.digest.blob_name not in os.listdir(mnt / ".blobs"), 5)
        assert not raw_file.exists()
        status = (model_file.parent / ".ollama" / "status").read_text()
        assert f"missing blob {m.digest}" in status


# -- other damage -------------------------------------------------------------------------------
def test_truncated_blob(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    assert verify(m.root)[0] == 0
    with open(m.blob, "r+b") as f:
        f.truncate(len(m.payload) // 2)
    # The cache key (size, mtime) no longer matches: quick does a full check.
    rc, report, _ = verify(m.root, "--quick")
    assert rc == 1
    [corrupt] = report["corrupt"]
    assert corrupt["size"] == len(m.payload) // 2
    assert corrupt["quarantined"] is not None
    assert report["checked"]["sha256"] == 1 and report["checked"]["xxh3_only"] == 3
    assert report["missing"] == []


def test_missing_blob_names_its_manifest(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    license_ = m.layers()[2]
    m.layout.blob(Digest.parse(license_["digest"])).unlink()
    rc, report, _ = verify(m.root)
    assert rc == 1
    assert report["problems"] == ["1 missing"]
    assert report["missing"] == [
        {
            "digest": license_["digest"],
            "size": license_["size"],
            "actual_size": None,
            "found_as": None,
            "repaired": False,
            "manifest": "manifests/registry.ollama.ai/library/llama3.2/3b",
            "name": "llama3.2:3b",
        }
    ]
    rc, text = verify_text(m.root)
    assert rc == 1
    assert f"MISSING     {license_['digest']}" in text
    assert "for llama3.2:3b (manifests/registry.ollama.ai/library/llama3.2/3b): absent" in text


def test_orphans_are_reported_with_bytes_and_do_not_fail(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    a = m.tiny.blob(weights(300_000, seed=1))
    b = m.tiny.blob(weights(5_000, seed=2))
    rc, report, _ = verify(m.root)
    assert rc == 0
    young = "younger than GC's grace (1h)"  # just written
    assert report["orphaned"] == {
        "bytes": 305_000,
        "reclaimable_bytes": 0,
        "blobs": [
            {"blob": f"blobs/{a.blob_name}", "size": 300_000, "kept": young},
            {"blob": f"blobs/{b.blob_name}", "size": 5_000, "kept": young},
        ],
    }
    rc, text = verify_text(m.root)
    assert rc == 0
    assert "ORPHANED    2 blobs, 305 KB" in text


def blobs_of(root: Path, name: str) -> set[str]:
    variant = scan_store(root).lookup(name).preferred()
    assert variant is not None
    return {d.blob_name for d in variant.manifest.blob_digests()}


def test_orphans_gc_keeps_are_told_apart_from_those_it_reclaims(tmp_path: Path) -> None:
    """A replaced version is kept by tag history, a pull's blob by its lease, a new blob by
    the grace; only the rest is GC's to reclaim, and verify says which is which."""
    m = Model(tmp_path / "models")
    old = time.time() - 2 * 3600
    history = TagHistory(m.layout)
    m.tiny.gguf_model("m:1", b"version one weights")
    history.observe(scan_store(m.root), old)
    replaced = blobs_of(m.root, "m:1")
    m.tiny.gguf_model("m:1", b"version two weights")  # the tag moved, as `ollama pull` does
    history.observe(scan_store(m.root), time.time())
    replaced -= blobs_of(m.root, "m:1")  # the template and license stay in use
    leased = m.tiny.blob(b"a pull in flight holds this")
    keeper = LeaseKeeper(m.layout, "pull")
    keeper.hold([leased])
    keeper.write()
    gone = m.tiny.blob(b"nobody wants this")
    young = m.tiny.blob(b"just written")
    for name in [*replaced, leased.blob_name, gone.blob_name]:
        os.utime(m.layout.blobs / name, (old, old))
    rc, report, _ = verify(m.root)
    assert rc == 0
    kept = {b["blob"].removeprefix("blobs/"): b["kept"] for b in report["orphaned"]["blobs"]}
    assert replaced and replaced <= set(kept)
    for name in replaced:
        assert kept[name] == "tag history keeps it for 7d (a version a tag moved away from)"
    host = keeper.host
    assert kept[leased.blob_name] == f"held by a live pull lease of {host}"
    assert kept[young.blob_name] == "younger than GC's grace (1h)"
    assert kept[gone.blob_name] is None
    assert report["orphaned"]["reclaimable_bytes"] == len(b"nobody wants this")
    rc, text = verify_text(m.root)
    assert rc == 0
    n = len(kept)
    assert (
        f"ORPHANED    {counted(n, 'blob')}," in text
        and f"`modelfs gc` reclaims 1 (17 B), keeps {n - 1}" in text
    )
    assert "ORPHANED (gc reclaims them)" not in text
    assert f"blobs/{gone.blob_name}  17 B\n" in text + "\n"
    assert "kept: tag history keeps it for 7d" in text


def test_stray_partial_is_reported_with_bytes(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    partial = m.layout.blobs / f"{Digest('1' * 64).blob_name}-partial"
    partial.write_bytes(b"\0" * 12345)
    (m.layout.blobs / f"{Digest('1' * 64).blob_name}-partial-0").write_bytes(b"{}")
    rc, report, _ = verify(m.root)
    assert rc == 0
    assert report["stray"]["bytes"] == 12345 + 2
    paths = {f["path"]: f["size"] for f in report["stray"]["files"]}
    assert paths == {
        f"blobs/{partial.name}": 12345,
        f"blobs/{partial.name}-0": 2,
    }
    assert partial.exists()  # reported, never deleted


def test_sha256_colon_blob_gets_a_fix(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    foreign = m.layout.blobs / f"sha256:{m.digest.hex}"
    os.rename(m.blob, foreign)  # as a copy from Windows leaves it
    rc, report, _ = verify(m.root)
    assert rc == 1  # the model lacks its blob under the name Ollama reads
    fix = f"mv 'blobs/sha256:{m.digest.hex}' blobs/{m.digest.blob_name}"
    assert report["misnamed"] == [
        {"path": f"blobs/sha256:{m.digest.hex}", "size": len(m.payload), "fix": fix}
    ]
    [missing] = report["missing"]
    assert missing["found_as"] == f"blobs/sha256:{m.digest.hex}"
    assert foreign.exists()  # printed, not done
    rc, text = verify_text(m.root)
    assert fix in text
    # The printed fix, run in the store root, makes the store whole.
    subprocess.run(["sh", "-c", fix], cwd=m.root, check=True)
    rc, report, _ = verify(m.root)
    assert rc == 0 and report["misnamed"] == []


# -- the cache ----------------------------------------------------------------------------------
def test_quick_uses_the_cache_and_a_changed_mtime_forces_sha256(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    rc, report, _ = verify(m.root, "--quick")  # no cache yet: every blob gets sha256
    assert rc == 0 and report["checked"]["sha256"] == 4 and report["checked"]["xxh3_only"] == 0
    cache = VerifyCache.load(m.layout).entries
    assert set(cache) == {p.name for p in m.layout.blobs.iterdir()}
    entry = cache[m.digest.blob_name]
    st = m.blob.stat()
    assert entry.stamp == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert entry.sample is not None  # the 2 MiB model blob is sampled; the others are not
    assert {e.sample for n, e in cache.items() if n != m.digest.blob_name} == {None}

    rc, report, _ = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == 0 and report["checked"]["xxh3_only"] == 4
    # What docs/gc.md promises: a 16th of a large blob read, none of a small one.
    assert report["checked"]["bytes_read"] == len(m.payload) // 16

    os.utime(m.blob, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    rc, report, _ = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == 1 and report["checked"]["xxh3_only"] == 3

    # A full run hashes everything with sha256 whatever the cache says.
    rc, report, _ = verify(m.root)
    assert rc == 0 and report["checked"]["sha256"] == 4 and report["checked"]["xxh3_only"] == 0


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{not json",
        b'{"version":1,"blobs":{"sha256-' + b"a" * 64 + b'":{"ino":"x"}}}',
        b"[]",
        b"[" * 200_000,
    ],
    ids=["empty", "not-json", "bad-entry", "wrong-shape", "nested-too-deep"],
)
def test_damaged_cache_is_ignored_with_one_line(tmp_path: Path, damage: bytes) -> None:
    m = Model(tmp_path / "models")
    assert verify(m.root)[0] == 0
    VerifyCache.path_for(m.layout).write_bytes(damage)
    rc, report, err = verify(m.root, "--quick")
    assert rc == 0
    assert report["checked"]["sha256"] == 4  # nothing trusted from it
    lines = [line for line in err.splitlines() if "verify cache" in line]
    assert len(lines) == 1, err
    assert "ignoring it" in lines[0]
    # Rewritten whole: the next quick run uses it.
    rc, report, err = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["xxh3_only"] == 4
    assert "verify cache" not in err


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_cache_that_is_no_regular_file_is_ignored_not_waited_on(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO where the cache is (or a link to one) would block the read for ever; a link
    could also lead to /dev/zero. Opened as the indexes are: not followed, not blocking."""
    m = Model(tmp_path / "models")
    assert verify(m.root)[0] == 0
    path = VerifyCache.path_for(m.layout)
    path.unlink()
    fifo = path if kind == "fifo" else tmp_path / "fifo"
    os.mkfifo(fifo)
    if kind == "symlink":
        path.symlink_to(fifo)
    proc = subprocess.run(
        command("verify", "--store", str(m.root), "--json", "--quick"),
        capture_output=True,
        timeout=30,
        check=False,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert json.loads(proc.stdout)["checked"]["sha256"] == 4  # nothing trusted from it
    [line] = [line for line in err.splitlines() if "verify cache" in line]
    assert "ignoring it" in line


@pytest.mark.parametrize("how", ["group-writable", "someone else's"])
def test_a_cache_others_could_write_is_ignored(tmp_path: Path, how: str) -> None:
    """The cache says which blobs --quick need not read, which names blobs/ holds and what
    the last survey found: one that a user other than the store's could have written is not
    trusted (as the indexes are not: store.index.indexfile)."""
    m = Model(tmp_path / "models")
    assert verify(m.root)[0] == 0
    path = VerifyCache.path_for(m.layout)
    if how == "group-writable":
        path.chmod(0o664)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        os.chown(path, 65534, 65534)
    rc, report, err = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == 4  # nothing trusted from it
    [line] = [line for line in err.splitlines() if "verify cache" in line]
    assert "ignoring it" in line
    assert path.stat().st_uid == m.root.stat().st_uid and not path.stat().st_mode & 0o022


def test_cache_keeps_any_name_and_a_damaged_byte_is_caught(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Names as a listing gives them, whatever they hold (a newline, bytes that are not UTF-8),
    in order, with 0s for a name with no entry; a byte changed anywhere fails the checksum."""
    import array

    layout = Layout(tmp_path / "models")
    names = [Digest("a" * 64).blob_name, "odd\nname", os.fsdecode(b"\xff-partial"), "x"]
    flat = array.array("q", [7, 2 << 20, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 9, 1, 2, 3])
    at = array.array("q", [100, 0, 0, 101])
    samples = {names[0]: "0123456789abcdef" * 2}
    cache = VerifyCache.of_columns(layout, names, flat, at, samples, (5, 6, 8))
    assert cache.save()
    back = VerifyCache.load(layout)
    assert (back.names, back.flat, back.at, back.samples, back.listed) == (
        names,
        flat,
        at,
        samples,
        (5, 6, 8),
    )
    assert set(back.stamps) == {names[0], "x"}  # a name with 0s has no entry
    assert back.get(names[0]) == CacheEntry((7, 2 << 20, 3, 4), samples[names[0]], 100)
    raw = bytearray(VerifyCache.path_for(layout).read_bytes())
    for at_ in (len(raw) - 1, len(raw) // 2):
        damaged = bytearray(raw)
        damaged[at_] ^= 1
        VerifyCache.path_for(layout).write_bytes(damaged)
        caplog.clear()
        assert VerifyCache.load(layout).names == []
        assert [r.message for r in caplog.records if "verify cache" in r.message] == [
            f"verify cache {VerifyCache.path_for(layout)} is damaged (length or checksum); "
            "ignoring it"
        ]


def test_the_json_cache_of_modelfs_before_is_ignored_and_replaced(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    old = VerifyCache.path_for(m.layout).with_name("cache.json")
    old.parent.mkdir(parents=True)
    old.write_text('{"version":2,"names":[],"stamps":"","verified_at":"","samples":{}}\n')
    rc, report, err = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["sha256"] == 4
    assert "is of an older modelfs; ignoring it" in err
    assert not old.exists() and VerifyCache.path_for(m.layout).exists()
    rc, report, err = verify(m.root, "--quick")
    assert rc == 0 and report["checked"]["xxh3_only"] == 4 and "verify cache" not in err


def test_a_blob_changed_within_the_racy_margin_gets_no_cache_entry(tmp_path: Path) -> None:
    """A write within one ctime tick after a full check leaves the blob's stamp as it was
    recorded: so a blob whose ctime is within RACY_NS of its check gets no entry, and the
    next --quick hashes it, rather than pass it on a stamp that cannot tell."""
    m = Model(tmp_path / "models")
    rc, report, _ = verify(m.root, racy=True)  # the blobs were written a moment ago
    assert rc == 0 and report["checked"]["sha256"] == 4
    assert VerifyCache.load(m.layout).entries == {}
    rc, report, _ = verify(m.root, "--quick", racy=True)
    assert rc == 0 and report["checked"]["sha256"] == 4 and report["checked"]["xxh3_only"] == 0
    # Out of the margin (0 here), the same blobs are recorded and then pass on their stamps.
    assert verify(m.root)[0] == 0
    assert set(VerifyCache.load(m.layout).entries) == {p.name for p in m.layout.blobs.iterdir()}
    rc, report, _ = verify(m.root, "--quick", racy=True)
    assert rc == 0 and report["checked"]["xxh3_only"] == 4


def test_a_blob_written_while_it_is_hashed_gets_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp is taken again after the read: a write meanwhile (here after the last byte
    was hashed, its mtime put back) keeps the blob out of the cache, so --quick hashes it."""
    import modelfs.store.collect.verify as sv
    from modelfs.store.index import indexfile

    monkeypatch.setattr(indexfile, "RACY_NS", 0)
    m = Model(tmp_path / "models")
    real = sv.hash_fd

    def hash_then_zero(fd: int, **kw: Any) -> sv.Hashes:
        hashes = real(fd, **kw)
        if os.fstat(fd).st_ino == m.blob.stat().st_ino:
            zero_in_place(m.blob)
        return hashes

    monkeypatch.setattr(sv, "hash_fd", hash_then_zero)
    report = run_verify(m.root, VerifyOptions(workers=1))
    monkeypatch.setattr(sv, "hash_fd", real)
    assert report.ok  # its bytes matched its name when they were read
    assert set(VerifyCache.load(m.layout).stamps) == {
        p.name for p in m.layout.blobs.iterdir() if p != m.blob
    }
    report = run_verify(m.root, VerifyOptions(quick=True, workers=1))
    assert [c.name for c in report.corrupt] == [m.digest.blob_name]
    assert report.sha256 == 1


# -- repair -------------------------------------------------------------------------------------
def test_repair_from_a_peer(tmp_path: Path) -> None:
    source = Model(tmp_path / "source")
    target_root = tmp_path / "target"
    shutil.copytree(source.root, target_root, symlinks=True)
    target = Layout(target_root)
    template = Digest.parse(source.layers()[1]["digest"])
    zero_in_place(target.blob(source.digest))
    target.blob(template).unlink()
    empty = TinyStore(tmp_path / "empty")

    with served(empty.root) as (nothing_url, _):
        rc, report, _ = verify(target_root, "--repair-from", nothing_url)
    assert rc == 1
    assert sorted(r["digest"] for r in report["repairs"]) == sorted(
        [str(source.digest), str(template)]
    )
    assert not any(r["ok"] for r in report["repairs"])
    assert (target.quarantine / source.digest.blob_name).exists()  # kept: no good copy yet

    with served(source.root) as (url, _):
        rc, report, err = verify(target_root, "--repair-from", nothing_url, "--repair-from", url)
    assert rc == 0, err
    assert report["ok"] is True
    repairs = {r["digest"]: r for r in report["repairs"]}
    assert set(repairs) == {str(source.digest), str(template)}  # the zeroed one was missing now
    assert all(r["ok"] for r in repairs.values())
    assert repairs[str(source.digest)]["dropped_from_quarantine"] == [source.digest.blob_name]
    assert target.blob(source.digest).read_bytes() == source.payload
    assert target.blob(template).read_bytes() == b"{{ .Prompt }}"
    assert report["quarantine"] == []
    index = scan_store(target_root)
    assert index.problems == []
    assert index.missing_blobs(index.lookup(source.name).variants[0].manifest) == []
    rc, report, _ = verify(target_root)
    assert rc == 0


def test_repair_in_the_same_run_as_the_corruption_is_found(tmp_path: Path) -> None:
    source = Model(tmp_path / "source")
    target_root = tmp_path / "target"
    shutil.copytree(source.root, target_root, symlinks=True)
    target = Layout(target_root)
    zero_in_place(target.blob(source.digest))
    with served(source.root) as (url, _):
        rc, text = verify_text(target_root, "--repair-from", url)
    assert rc == 0, text
    assert "CORRUPT" in text and "repaired" in text
    assert "ok: every blob matches its name and every manifest is whole (1 repaired)" in text
    assert target.blob(source.digest).read_bytes() == source.payload
    assert not any(target.quarantine.iterdir())


# -- unreadable, concurrent change, quarantine names --------------------------------------------
def test_unreadable_blob_is_reported_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import modelfs.store.collect.verify as sv

    m = Model(tmp_path / "models")
    real = os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(m.digest.blob_name):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(sv.os, "preadv", failing)
    report = run_verify(m.root, VerifyOptions())
    assert not report.ok
    assert report.problems == ["1 unreadable"]
    assert report.unreadable == [(m.digest.blob_name, "Input/output error")]
    assert m.blob.exists()  # not judged corrupt, not moved


def test_blob_replaced_while_checked_is_not_judged(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    zero_in_place(m.blob)
    good = tmp_path / "good"
    good.write_bytes(m.payload)
    calls = []

    def replace_once() -> bool:
        if not calls:
            os.replace(good, m.blob)  # `ollama pull` renames a good copy over it meanwhile
        calls.append(1)
        return False

    check = check_blob(m.blob, None, quick=False, stop=replace_once)
    assert check.status == "changed"
    assert check.entry is None
    assert check_blob(m.blob, None, quick=False).status == "ok"


def test_quarantine_keeps_an_earlier_copy(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    m.layout.quarantine.mkdir(parents=True)
    (m.layout.quarantine / m.digest.blob_name).write_bytes(b"older")
    zero_in_place(m.blob)
    rc, report, _ = verify(m.root)
    assert rc == 1
    moved = report["corrupt"][0]["quarantined"]
    assert moved.startswith(f".modelfs/quarantine/{m.digest.blob_name}.")
    assert (m.layout.quarantine / m.digest.blob_name).read_bytes() == b"older"
    assert (m.root / moved).read_bytes() == bytes(len(m.payload))
    # A blob put back since it was checked is not moved: renamed over it (another inode),
    # or restored in place (same inode, other mtime).
    m.blob.write_bytes(m.payload)
    st = m.blob.stat()
    for key in (
        FileKey(st.st_ino + 1, st.st_size, st.st_mtime_ns),
        FileKey(st.st_ino, st.st_size, st.st_mtime_ns - 1),
    ):
        with pytest.raises(FileNotFoundError):
            quarantine_blob(m.layout, m.digest.blob_name, key)
    assert m.blob.exists()


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    for args, needle in (
        (["--store", str(m.root), "--repair-from", "ftp://x"], "--repair-from 'ftp://x'"),
        (["--store", str(tmp_path / "nowhere")], "no model store at"),
    ):
        proc = subprocess.run([MODELFS, "verify", *args], capture_output=True, check=False)
        assert proc.returncode == 1
        lines = proc.stderr.decode().strip().splitlines()
        assert lines[-1].startswith("modelfs: error: ") and needle in lines[-1], lines
    help_text = subprocess.run(
        [MODELFS, "verify", "--help"], capture_output=True, check=True
    ).stdout.decode()
    assert "Exit status" in help_text and "Orphaned blobs" in help_text


def test_json_shape(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    _, report, _ = verify(m.root)
    assert set(report) == {
        "store",
        "mode",
        "ok",
        "problems",
        "checked",
        "corrupt",
        "unreadable",
        "changed",
        "missing",
        "orphaned",
        "stray",
        "misnamed",
        "bad_manifests",
        "quarantine",
        "repairs",
        "cache_written",
    }
    assert set(report["checked"]) == {
        "blobs",
        "bytes",
        "bytes_read",
        "sha256",
        "xxh3_only",
        "seconds",
    }
    assert report["store"] == str(m.root)
    assert set(report["orphaned"]) == {"bytes", "reclaimable_bytes", "blobs"}
    assert set(report["stray"]) == {"bytes", "files"}


def test_bad_manifest_fails_and_orphans_are_qualified(tmp_path: Path) -> None:
    m = Model(tmp_path / "models")
    m.tiny.gguf_model("other:1", payload=b"other weights")
    path = m.layout.legacy_manifest(parse_name("other:1"))
    path.write_bytes(b"")  # a zero-length manifest, as a full disk leaves it
    rc, report, _ = verify(m.root)
    assert rc == 1
    assert report["bad_manifests"] == [
        {"path": "manifests/registry.ollama.ai/library/other/1", "message": "empty file"}
    ]
    # Its blobs look orphaned, and the text says they may not be.
    assert report["orphaned"]["blobs"]
    rc, text = verify_text(m.root)
    assert "some may belong to the bad manifests above" in text


def test_blobs_of_a_legacy_file_hidden_by_v2_are_not_orphans(tmp_path: Path) -> None:
    """Reachability is GC's (store.reach): every manifest file counts, also a legacy anchor
    that a v2 tag of the same name hides from the scan."""
    m = Model(tmp_path / "models")
    anchor = m.tiny.manifest([m.tiny.layer("model", b"weights only the anchor names")])
    v2 = m.tiny.manifest([m.tiny.layer("model", b"weights of the v2 tag")])
    m.tiny.legacy("hidden:1", anchor)
    m.tiny.v2("hidden:1", v2)
    assert scan_store(m.root).lookup("hidden:1").source == "v2"
    rc, report, _ = verify(m.root)
    assert rc == 0
    assert report["orphaned"] == {"bytes": 0, "reclaimable_bytes": 0, "blobs": []}


def test_demo_store_is_whole(tmp_path: Path) -> None:
    from modelfs.demo import build_demo_store

    demo = build_demo_store(tmp_path / "models")
    rc, report, _ = verify(demo.root)
    assert rc == 0, report["problems"]
    assert report["orphaned"]["blobs"] == [] and report["missing"] == []


def test_repair_of_a_truncated_blob_fetches_the_size_its_manifest_gives(tmp_path: Path) -> None:
    source = Model(tmp_path / "source")
    target_root = tmp_path / "target"
    shutil.copytree(source.root, target_root, symlinks=True)
    target = Layout(target_root)
    with open(target.blob(source.digest), "r+b") as f:
        f.truncate(1000)
    with served(source.root) as (url, _):
        rc, report, err = verify(target_root, "--repair-from", url)
    assert rc == 0, err
    assert [r["ok"] for r in report["repairs"]] == [True]
    assert target.blob(source.digest).read_bytes() == source.payload


@pytest.mark.parametrize("name", ["../../victim", "sha256-partial-1"])
def test_a_cache_naming_a_file_no_listing_holds_moves_nothing(tmp_path: Path, name: str) -> None:
    """A cache is trusted to say which blobs a --quick run need not read, never what a file is
    called: a name that is a path out of blobs/ (the cache is then damaged), or no blob's name
    (taken for a changed one), with the file's own stamp and a sample that does not match, is
    never checked as a blob, so never moved to the quarantine."""
    m = Model(tmp_path / "models")
    assert verify(m.root)[0] == 0
    victim = tmp_path / "victim" if name.startswith("..") else m.layout.blobs / name
    victim.write_bytes(b"not the store's" * (MiB // 8))
    before = victim.read_bytes()
    cache = VerifyCache.load(m.layout)
    st = os.stat(m.layout.blobs)
    flat = array.array("q", cache.flat)
    vst = victim.stat()
    flat.extend([vst.st_ino, vst.st_size, vst.st_mtime_ns, vst.st_ctime_ns])
    at = array.array("q", [*cache.at, 1])
    samples = {**cache.samples, name: "0" * 32}
    listed = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    assert VerifyCache.of_columns(m.layout, [*cache.names, name], flat, at, samples, listed).save()
    _, report, err = verify(m.root, "--quick")
    assert victim.read_bytes() == before
    assert not report["corrupt"] and not report["quarantine"], report
    assert "Traceback" not in err
