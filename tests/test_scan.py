"""The store scan against stores built in each test, including every kind of damage."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from modelfs.store.digest import Digest
from modelfs.store.errors import ModelNotFoundError
from modelfs.store.manifest import MEDIA_LIST, ManifestList
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.store.tools.files import model_files
from tests.builders import TinyStore, compact


@pytest.fixture
def tiny(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


def kinds(index: object) -> list[tuple[str, str]]:
    return sorted((p.kind, p.path) for p in index.problems)  # type: ignore[attr-defined]


def test_legacy_models_and_lookup(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("llama3.2:3b")
    tiny.gguf_model("someuser/tiny:q8", payload=b"other weights")
    tiny.gguf_model("hf.co/bartowski/SmolLM2:Q4_K_M", payload=b"hf weights")
    index = scan_store(tiny.root)
    assert index.problems == []
    assert sorted(e.name.shortest for e in index) == [
        "hf.co/bartowski/SmolLM2:Q4_K_M",
        "llama3.2:3b",
        "someuser/tiny:q8",
    ]
    entry = index.lookup("LLAMA3.2:3B")
    assert entry.name.shortest == "llama3.2:3b"  # on-disk spelling wins
    assert entry.digest == Digest.of_bytes(raw)
    assert entry.source == "legacy"
    (variant,) = entry.variants
    assert variant.runner == "ggml" and variant.format == "gguf" and not variant.from_list
    with pytest.raises(ModelNotFoundError):
        index.lookup("nope")


def test_v2_symlink_list_and_anchor(tiny: TinyStore) -> None:
    gguf_child = tiny.manifest([tiny.layer("model", b"weights")], runner="llamacpp", format="gguf")
    mlx_child = tiny.manifest(
        [
            tiny.layer("tensor", b"t0", name="a.weight"),
            tiny.layer("json", b"{}", name="config.json"),
        ],
        {"model_format": "safetensors"},
    )
    absent_child = compact({"schemaVersion": 2, "layers": []})
    lst = tiny.manifest_list(
        [
            (gguf_child, "llamacpp", "gguf"),
            (mlx_child, "mlx", "safetensors"),
            (absent_child, "ggml", "gguf"),
        ]
    )
    # The third child was never pulled here: only its reference exists.
    tiny.layout.blob(Digest.of_bytes(absent_child)).unlink()
    path = tiny.v2("gemma4:26b", lst)
    assert path.is_symlink() and not os.readlink(path).startswith("/")
    # Ollama's compat migration keeps a legacy anchor; v2 hides it.
    tiny.legacy("gemma4:26b", gguf_child)
    index = scan_store(tiny.root)
    assert index.problems == []
    (entry,) = list(index)
    assert entry.source == "v2" and isinstance(entry.top, ManifestList)
    assert entry.digest == Digest.of_bytes(lst)
    assert [v.runner for v in entry.variants] == ["llamacpp", "mlx"]
    assert [c.runner for c in entry.absent_children] == ["ggml"]
    assert entry.preferred().runner == "llamacpp"  # type: ignore[union-attr]
    assert entry.preferred(("mlx", "llamacpp")).runner == "mlx"  # type: ignore[union-attr]
    assert entry.preferred(("ggml",)).runner == "llamacpp"  # type: ignore[union-attr]
    assert entry.variant("MLX").manifest.raw == mlx_child  # type: ignore[union-attr]


def test_v2_hardlink_and_copy(tiny: TinyStore) -> None:
    raw = tiny.manifest([tiny.layer("model", b"w")])
    blob = tiny.layout.blob(tiny.blob(raw))
    for tag, make in (
        ("hard", os.link),
        ("copy", lambda a, b: Path(b).write_bytes(Path(a).read_bytes())),
    ):
        target = tiny.layout.v2_manifest(parse_name(f"m:{tag}"))
        target.parent.mkdir(parents=True, exist_ok=True)
        make(blob, target)
    index = scan_store(tiny.root)
    assert index.problems == []
    assert {e.name.tag for e in index} == {"hard", "copy"}
    assert all(e.digest == Digest.of_bytes(raw) for e in index)


def test_foreign_and_broken_files_are_reported_not_fatal(tiny: TinyStore) -> None:
    tiny.gguf_model("good:1")
    m = tiny.layout.manifests / "registry.ollama.ai" / "library"
    (m / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (m / "good" / ".DS_Store").write_bytes(b"junk")
    (m / "empty").mkdir()
    (m / "empty" / "latest").write_bytes(b"")
    (m / "trunc").mkdir()
    (m / "trunc" / "latest").write_bytes(b'{"schemaVersion":2,"layers":[{"mediaT')
    (m / "deep" / "x").mkdir(parents=True)
    (m / "deep" / "x" / "y").write_bytes(b"{}")
    (tiny.layout.manifests / "README").write_text("hi")
    blob_hex = "cd" * 32
    (tiny.layout.blobs / f"sha256:{blob_hex}").write_bytes(b"x")
    (tiny.layout.blobs / f"sha256-{blob_hex}-partial").write_bytes(b"x")
    index = scan_store(tiny.root)
    assert [e.name.shortest for e in index] == ["good:1"]
    found = kinds(index)
    assert ("stray", "manifests/registry.ollama.ai/library/.DS_Store") in found
    assert ("stray", "manifests/registry.ollama.ai/library/good/.DS_Store") in found
    assert ("bad-manifest", "manifests/registry.ollama.ai/library/empty/latest") in found
    assert ("bad-manifest", "manifests/registry.ollama.ai/library/trunc/latest") in found
    assert ("stray", "manifests/registry.ollama.ai/library/deep/x") in found
    assert ("stray", "manifests/README") in found
    assert ("foreign-blob", f"blobs/sha256:{blob_hex}") in found
    assert ("stray", f"blobs/sha256-{blob_hex}-partial") in found
    messages = {p.path: p.message for p in index.problems}
    assert messages["manifests/registry.ollama.ai/library/empty/latest"] == "empty file"
    # Reporting deletes nothing.
    assert (m / "empty" / "latest").exists() and (m / ".DS_Store").exists()


def test_missing_and_truncated_blobs(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("m:1", payload=b"0123456789")
    manifest = json.loads(raw)
    model = Digest.parse(manifest["layers"][0]["digest"])
    lic = Digest.parse(manifest["layers"][2]["digest"])
    tiny.layout.blob(model).write_bytes(b"01234")  # truncated in place
    tiny.layout.blob(lic).unlink()
    index = scan_store(tiny.root)
    entry = index.lookup("m:1")
    assert set(index.missing_blobs(entry.variants[0].manifest)) == {model, lic}
    msgs = sorted(p.message for p in index.problems if p.kind == "missing-blob")
    assert msgs == sorted([f"blob {lic} missing", f"blob {model} wrong size (5 bytes)"])


def test_hostile_links(tiny: TinyStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b'{"layers":[]}')
    raw = tiny.manifest([tiny.layer("model", b"w")])
    digest = tiny.blob(raw)
    v2 = tiny.layout.manifests_v2 / "ollama.com" / "library" / "evil"
    v2.mkdir(parents=True)
    (v2 / "out").symlink_to(outside)
    (v2 / "etc").symlink_to("/etc/passwd")
    # A link to a blob whose bytes do not match its name.
    fake = Digest("ef" * 32)
    tiny.layout.blob(fake).write_bytes(raw)
    (v2 / "lie").symlink_to(os.path.relpath(tiny.layout.blob(fake), v2))
    (v2 / "ok").symlink_to(os.path.relpath(tiny.layout.blob(digest), v2))
    # A blob that is itself a symlink out of the store is never taken as present.
    linked = Digest("12" * 32)
    tiny.layout.blob(linked).symlink_to("/etc/passwd")
    index = scan_store(tiny.root)
    assert [e.name.tag for e in index] == ["ok"]
    bad = {p.path: p.message for p in index.problems}
    assert "outside blobs/" in bad["manifests-v2/ollama.com/library/evil/out"]
    assert "outside blobs/" in bad["manifests-v2/ollama.com/library/evil/etc"]
    assert "does not match" in bad["manifests-v2/ollama.com/library/evil/lie"]
    assert bad[f"blobs/{linked.blob_name}"] == "not a regular file"
    assert not index.has_blob(linked)


def test_corrupt_list_child_is_reported(tiny: TinyStore) -> None:
    child = tiny.manifest([tiny.layer("model", b"w")])
    lst = tiny.manifest_list([(child, "llamacpp", "gguf")])
    tiny.v2("m:t", lst)
    tiny.layout.blob(Digest.of_bytes(child)).write_bytes(child.replace(b"model", b"MODEL"))
    index = scan_store(tiny.root)
    entry = index.lookup("m:t")
    assert entry.variants == () and len(entry.absent_children) == 1
    assert any("do not match the name" in p.message for p in index.problems)


def test_newest_first(tiny: TinyStore) -> None:
    for i, name in enumerate(["a:1", "b:1", "c:1"]):
        raw = tiny.manifest([tiny.layer("model", name.encode())])
        tiny.legacy(name, raw, mtime=1_700_000_000 + i * 100)
    index = scan_store(tiny.root)
    assert [e.name.shortest for e in index.sorted_entries()] == ["c:1", "b:1", "a:1"]


def test_duplicate_spellings_in_one_layout(tiny: TinyStore) -> None:
    raw = tiny.manifest([tiny.layer("model", b"w")])
    tiny.legacy("m:t", raw)
    tiny.legacy("M:T", raw)
    index = scan_store(tiny.root)
    assert len(index) == 1
    assert [p.kind for p in index.problems] == ["stray"]


def test_list_media_type_in_anchor_layers_gets_a_fallback_file(tiny: TinyStore) -> None:
    lst = tiny.manifest_list([])
    raw = tiny.manifest([tiny.layer("model", b"w"), tiny.layer(MEDIA_LIST, lst)])
    tiny.legacy("m:t", raw)
    index = scan_store(tiny.root)
    files = [f.path for f in model_files(index.lookup("m:t").variants[0].manifest)]
    assert files == ["model.gguf", ".ollama/layers/1-application_vnd.ollama.manifest.list.v2+json"]


def test_empty_or_absent_store(tmp_path: Path) -> None:
    assert len(scan_store(tmp_path)) == 0
    assert scan_store(tmp_path).problems == []


def test_hostile_manifests_cost_only_themselves(tiny: TinyStore) -> None:
    tiny.gguf_model("good:1")
    digest = f"sha256:{'ab' * 32}"
    lib = tiny.layout.manifests / "registry.ollama.ai" / "library"
    bad = {
        "inline": compact(
            {"mediaType": MEDIA_LIST, "manifests": [{"layers": [1, 2], "config": "x"}]}
        ),
        "hugeint": b'{"layers":[{"mediaType":"x","digest":"' + digest.encode() + b'","size":'
        + b"9" * 5000 + b"}]}",
        "surrogate": compact(
            {"layers": [{"mediaType": "application/vnd.ollama.image.json", "digest": digest,
                         "size": 1, "name": "\ud800.json"}]}
        ),
        "runner": tiny.manifest_list(
            [(tiny.manifest([tiny.layer("model", b"w")]), "x/../y", "gguf")]
        ),
    }  # fmt: skip
    for model, raw in bad.items():
        (lib / model).mkdir(parents=True)
        (lib / model / "latest").write_bytes(raw)
    index = scan_store(tiny.root)
    names = {e.name.model for e in index}
    assert "good" in names and "inline" not in names and "hugeint" not in names
    problems = {p.path.split("/")[3]: p.message for p in index.problems if p.kind == "bad-manifest"}
    assert "malformed" in problems["inline"]
    assert "not valid JSON" in problems["hugeint"]
    assert "bad runner" in problems["runner"]
    entry = index.lookup("surrogate")
    (f,) = model_files(entry.variants[0].manifest)
    f.path.encode()  # a surrogate never reaches a file name
    assert "\ufffd" in f.path


def test_a_scan_cache_rereads_exactly_what_changed(
    tiny: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelfs.store.index import indexfile
    from modelfs.store.scan import ScanCache

    # Files written a moment ago are "racy" (indexfile.RACY_NS) and read again each scan;
    # here a file is as old as it needs to be to be kept.
    monkeypatch.setattr(indexfile, "RACY_NS", 0)

    tiny.gguf_model("a:1", payload=b"weights A")
    tiny.gguf_model("b:1", payload=b"weights B", file_type="Q8_0")
    path = tiny.layout.legacy_manifest(parse_name("a:1"))
    tiny.legacy("bad:1", b"{not json")
    cache = ScanCache()

    def same_as_fresh() -> object:
        cached, fresh = scan_store(tiny.root, cache), scan_store(tiny.root)
        assert {e.name.key: (e.digest, e.mtime_ns) for e in cached} == {
            e.name.key: (e.digest, e.mtime_ns) for e in fresh
        }
        assert kinds(cached) == kinds(fresh)
        assert ("bad-manifest", "manifests/" + bad_rel) in kinds(cached)
        return cached

    bad_rel = "registry.ollama.ai/library/bad/1"
    same_as_fresh()
    assert set(cache.manifests) == {
        str(tiny.layout.legacy_manifest(parse_name(n))) for n in ("a:1", "b:1")
    }  # the broken one is read again each time, never remembered as good
    # Rewritten in place to a manifest of the same size, its mtime put back: the ctime moved.
    st = path.stat()
    other = tiny.manifest(
        [
            tiny.layer("model", b"weights C"),
            tiny.layer("template", b"{{ .Prompt }}"),
            tiny.layer("license", b"MIT"),
        ]
    )
    assert len(other) == st.st_size
    with open(path, "r+b") as f:
        f.write(other)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    index = same_as_fresh()
    assert index.lookup("a:1").digest == Digest.of_bytes(other)
    # A config remembered from the last scan is not used once its blob is gone.
    b = index.lookup("b:1")
    assert index.config(b.top) is not None and index.config(b.top).file_type == "Q8_0"
    assert b.top.config is not None
    tiny.layout.blob(b.top.config.digest).unlink()
    index = scan_store(tiny.root, cache)
    assert index.config(index.lookup("b:1").top) is None
    # `ollama rm`: gone from the index and from the cache.
    path.unlink()
    same_as_fresh()
    assert str(path) not in cache.manifests


def test_prefetch_asks_for_regular_files_only_and_reads_ahead(tmp_path: Path) -> None:
    import shutil
    import subprocess

    from modelfs.store.disk.prefetch import prefetch

    data = tmp_path / "blob"
    data.write_bytes(os.urandom(1 << 20))
    os.mkfifo(tmp_path / "fifo")  # opening it for reading must not wait for a writer
    (tmp_path / "link").symlink_to(data)
    paths = [str(tmp_path / n) for n in ("fifo", "link", "missing", "blob")]
    assert prefetch(paths, 1 << 16) == 1

    fincore = shutil.which("fincore")
    if fincore is None:
        return
    with open(data, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def cached_pages() -> int:
        out = subprocess.run(
            [fincore, "-b", "-n", "-o", "PAGES", str(data)], capture_output=True, text=True
        )
        return int(out.stdout.split()[0])

    if cached_pages() != 0:
        pytest.skip("this filesystem keeps its pages (tmpfs?)")
    prefetch([str(data)], 1 << 16)
    deadline = time.monotonic() + 5
    while cached_pages() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 < cached_pages() < (1 << 20) // os.sysconf("SC_PAGE_SIZE")


def test_what_a_collector_pause_made_goes_to_the_oldest_generation_and_a_freeze_stays() -> None:
    """A scan's objects all live on and hold no cycle: the pause's end moves them to the
    oldest generation, not through a walk of the young one; and a freeze that a mount made
    (fsd.mount keeps its tree frozen) is not undone by a scan inside it."""
    import gc

    from modelfs.store.collector import cycles_uncollected

    gc.collect()
    with cycles_uncollected():
        made = [[i] for i in range(2000)]
    assert any(o is made[0] for o in gc.get_objects(generation=2))
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with cycles_uncollected():
            more = [[i] for i in range(2000)]
        assert gc.get_freeze_count() == frozen
        assert not any(o is more[0] for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
