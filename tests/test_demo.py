"""The demo store: real files, read back with the reference readers (gguf, safetensors)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from safetensors import safe_open

from modelfs.demo import (
    GEMMA,
    GEMMA_MLX,
    LLAMA,
    QWEN,
    SMOL,
    TINY,
    VOCAB_ONLY_MODEL,
    DemoStore,
    build_demo_store,
    main,
    parse_size,
)
from modelfs.store.digest import Digest
from modelfs.store.manifest import (
    MEDIA_CONFIG,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    ManifestList,
    parse_manifest,
)
from modelfs.store.names import name_from_path_parts
from modelfs.store.scan import ollama_entries, scan_store

REPO = Path(__file__).resolve().parent.parent
Q = gguf.GGMLQuantizationType
T = gguf.TokenType


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_ref(root: Path, ref: dict) -> Path:
    """A manifest's config/layer entry names an existing blob of that size and hash."""
    digest = Digest.parse(ref["digest"])
    path = root / "blobs" / digest.blob_name
    assert path.is_file(), f"missing blob {ref['digest']} ({ref['mediaType']})"
    assert path.stat().st_size == ref["size"], ref
    assert _sha256(path) == digest.hex
    return path


def _named_files(root: Path) -> dict[Path, bool]:
    """Every file at depth 4 of manifests/ and manifests-v2/ -> is it a v2 entry."""
    out = {}
    for top, v2 in (("manifests", False), ("manifests-v2", True)):
        base = root / top
        for path in base.glob("*/*/*/*"):
            out[path] = v2
    return out


def _gguf(demo: DemoStore, key: str, file: str = "model.gguf") -> gguf.GGUFReader:
    return gguf.GGUFReader(demo.blob_path(demo.manifests[key].layer(file).digest))


def _kv(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


# --- manifests and blobs ---------------------------------------------------------------------


def test_every_manifest_layer_is_a_verified_blob(demo: DemoStore) -> None:
    root = demo.root
    named = _named_files(root)
    # 6 legacy files (the gemma4 anchor and gemma4:26b-mlx among them) + 1 v2 entry
    assert len(named) == 7
    runnable = 0
    for path in named:
        obj = json.loads(path.read_bytes())
        manifests = [obj]
        if obj["mediaType"] == MEDIA_LIST:
            manifests = []
            for child in obj["manifests"]:  # references carry no size; the blob's hash
                blob = root / "blobs" / Digest.parse(child["digest"]).blob_name
                assert _sha256(blob) == Digest.parse(child["digest"]).hex
                manifests.append(json.loads(blob.read_bytes()))
        for m in manifests:
            assert m["schemaVersion"] == 2
            assert m["mediaType"] == MEDIA_MANIFEST
            assert m["config"]["mediaType"] == MEDIA_CONFIG
            _check_ref(root, m["config"])
            for layer in m["layers"]:
                _check_ref(root, layer)
            runnable += 1
    assert runnable == 8


def test_summary_matches_disk(demo: DemoStore) -> None:
    for m in demo.manifests.values():
        assert Digest.of_bytes(m.raw) == m.digest
        assert demo.blob_path(m.config.digest).is_file()
        if m.path is not None:
            assert m.path.read_bytes() == m.raw
        else:  # a list child lives only as a blob
            assert demo.blob_path(m.digest).read_bytes() == m.raw
        for layer in m.layers:
            assert demo.blob_path(layer.digest).stat().st_size == layer.size
            assert layer.digest in demo.blobs
    on_disk = {Digest.parse(p.name) for p in (demo.root / "blobs").iterdir()}
    assert on_disk == demo.blobs
    # Nothing but empty folders (tmp/links/v2/, where manifests-v2 links are made).
    assert [p for p in (demo.root / ".modelfs" / "tmp").rglob("*") if not p.is_dir()] == []


def test_manifest_paths_are_valid_names(demo: DemoStore) -> None:
    names = set()
    for path, v2 in _named_files(demo.root).items():
        top = demo.root / ("manifests-v2" if v2 else "manifests")
        names.add(name_from_path_parts(path.relative_to(top).parts, v2=v2).shortest)
    assert names == set(demo.tags)
    assert (demo.root / "manifests" / "hf.co" / "bartowski").is_dir()
    assert (demo.root / "manifests" / "registry.ollama.ai" / "someuser" / "tiny" / "q8").is_file()


def test_the_mlx_child_is_named_by_a_legacy_file_of_its_own(demo: DemoStore) -> None:
    """`gemma4:26b-mlx`: the mlx child's own bytes, as `modelfs pull --all-variants` writes
    it, so that an Ollama reading only `manifests/` keeps the mlx variant's blobs."""
    variant = demo.variant_anchors[GEMMA_MLX]
    assert variant.path == demo.root / "manifests/registry.ollama.ai/library/gemma4/26b-mlx"
    assert variant.path.read_bytes() == demo.manifests[f"{GEMMA}@mlx"].raw == variant.raw
    assert variant.path.stat().st_mtime == demo.mtimes[GEMMA_MLX] < demo.mtimes[TINY]


def test_v2_entry_is_a_relative_symlink_to_the_list_blob(demo: DemoStore) -> None:
    link = demo.root / "manifests-v2" / "ollama.com" / "library" / "gemma4" / "26b"
    assert link.is_symlink()
    target = os.readlink(link)
    assert not os.path.isabs(target)
    assert target == "../../../../blobs/" + demo.lists[GEMMA].digest.blob_name
    resolved = link.resolve()
    assert resolved.parent == (demo.root / "blobs").resolve()
    assert _sha256(resolved) == demo.lists[GEMMA].digest.hex
    assert demo.lists[GEMMA].path == link


def test_list_references_both_children(demo: DemoStore) -> None:
    the_list = demo.lists[GEMMA]
    obj = json.loads(the_list.raw)
    assert obj["schemaVersion"] == 2 and obj["mediaType"] == MEDIA_LIST
    children = obj["manifests"]
    assert [(c["runner"], c["format"]) for c in children] == [
        ("llamacpp", "gguf"),
        ("mlx", "safetensors"),
    ]
    for child in children:
        assert set(child) == {"mediaType", "digest", "runner", "format"}
        assert child["mediaType"] == MEDIA_MANIFEST
        variant = demo.manifests[f"{GEMMA}@{child['runner']}"]
        assert Digest.parse(child["digest"]) == variant.digest
        assert demo.blob_path(variant.digest).read_bytes() == variant.raw
        assert (variant.runner, variant.format) == (child["runner"], child["format"])
        child_obj = json.loads(variant.raw)
        assert (child_obj["runner"], child_obj["format"]) == (child["runner"], child["format"])
    parsed = parse_manifest(the_list.raw, "gemma4 list")
    assert isinstance(parsed, ManifestList)
    assert [c.digest for c in parsed.children] == [d for _, _, d in the_list.children]
    assert set(demo.variants(GEMMA)) == {"llamacpp", "mlx"}


def test_legacy_anchor_keeps_the_list_and_children_reachable(demo: DemoStore) -> None:
    path = demo.root / "manifests" / "registry.ollama.ai" / "library" / "gemma4" / "26b"
    anchor = demo.anchors[GEMMA]
    assert path.read_bytes() == anchor.raw
    obj = json.loads(anchor.raw)
    child = json.loads(demo.manifests[f"{GEMMA}@llamacpp"].raw)
    n = len(child["layers"])
    assert obj["config"] == child["config"]
    assert obj["layers"][:n] == child["layers"]
    extra = obj["layers"][n:]
    assert [x["mediaType"] for x in extra] == [MEDIA_LIST, MEDIA_MANIFEST, MEDIA_MANIFEST]
    assert [Digest.parse(x["digest"]) for x in extra] == [
        demo.lists[GEMMA].digest,
        demo.manifests[f"{GEMMA}@llamacpp"].digest,
        demo.manifests[f"{GEMMA}@mlx"].digest,
    ]
    # hidden by the v2 entry: older than it
    assert path.stat().st_mtime < demo.mtimes[GEMMA]


def test_legacy_manifests_are_compact_json_and_newline(demo: DemoStore) -> None:
    for key in (LLAMA, QWEN, TINY, SMOL):
        raw = demo.manifests[key].raw
        assert raw.endswith(b"}\n")
        assert json.dumps(json.loads(raw), separators=(",", ":")).encode() + b"\n" == raw
        parsed = parse_manifest(raw, key)
        assert parsed.digest == demo.manifests[key].digest
        assert parsed.layers[0].kind == "model"


def test_shared_blobs(demo: DemoStore) -> None:
    llama, qwen = demo.manifests[LLAMA].files(), demo.manifests[QWEN].files()
    assert llama["template.txt"] == qwen["template.txt"]
    assert llama["LICENSE"] == qwen["LICENSE"]
    assert llama["model.gguf"] != qwen["model.gguf"]
    gg, mlx = demo.manifests[f"{GEMMA}@llamacpp"].files(), demo.manifests[f"{GEMMA}@mlx"].files()
    for file in ("template.txt", "LICENSE", "params.json"):
        assert gg[file] == mlx[file]
    assert demo.manifests[TINY].files()["system.txt"]


def test_mtimes_are_distinct_and_newest_first(demo: DemoStore) -> None:
    assert demo.names == (GEMMA, QWEN, LLAMA, SMOL, TINY)
    times = [demo.mtimes[n] for n in demo.names]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    assert os.lstat(demo.lists[GEMMA].path).st_mtime == demo.mtimes[GEMMA]
    for key in (LLAMA, QWEN, TINY, SMOL):
        assert demo.manifests[key].path.stat().st_mtime == demo.mtimes[key]


def test_configs(demo: DemoStore) -> None:
    def config(key: str) -> dict:
        return json.loads(demo.blob_path(demo.manifests[key].config.digest).read_bytes())

    gg = config(f"{GEMMA}@llamacpp")
    assert gg["model_format"] == "gguf" and gg["file_type"] == "Q4_K_M"
    assert gg["model_family"] == "gemma4" and gg["model_families"] == ["gemma4"]
    assert gg["model_type"] == "25.8B" and "vision" in gg["capabilities"]
    st = config(f"{GEMMA}@mlx")
    assert st["model_format"] == "safetensors" and st["file_type"] == "nvfp4"
    assert st["draft"]["tensor_prefix"] == "draft."
    assert config(QWEN)["file_type"] == "Q8_0"
    assert config(LLAMA)["rootfs"]["diff_ids"] == [
        str(layer.digest) for layer in demo.manifests[LLAMA].layers
    ]


# --- GGUF ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "arch", "file_type", "types"),
    [
        (f"{GEMMA}@llamacpp", "gemma4", 15, {Q.Q4_K, Q.Q6_K, Q.F32}),
        (LLAMA, "llama", 15, {Q.Q4_K, Q.Q6_K, Q.F32}),
        (QWEN, "qwen3", 7, {Q.Q8_0, Q.F32}),
        (TINY, "llama", 7, {Q.Q8_0, Q.F32}),
        (SMOL, "llama", 15, {Q.Q5_0, Q.Q8_0, Q.F32}),
    ],
)
def test_model_gguf_reads_back(
    demo: DemoStore, key: str, arch: str, file_type: int, types: set
) -> None:
    r = _gguf(demo, key)
    assert _kv(r, "general.architecture") == arch
    assert _kv(r, "general.file_type") == file_type
    assert _kv(r, "general.parameter_count") > 0
    assert _kv(r, "general.name")
    for suffix in ("context_length", "embedding_length", "block_count"):
        assert _kv(r, f"{arch}.{suffix}") > 0
    assert {t.tensor_type for t in r.tensors} == types
    n_blocks = _kv(r, f"{arch}.block_count")
    assert {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")} == set(
        range(n_blocks)
    )
    tokens = _kv(r, "tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == len(_kv(r, "tokenizer.ggml.token_type"))
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert [int(x) for x in embd.shape] == [_kv(r, f"{arch}.embedding_length"), len(tokens)]
    # the data of the last tensor ends the file
    last = max(r.tensors, key=lambda t: t.data_offset)
    size = demo.blob_path(demo.manifests[key].layer("model.gguf").digest).stat().st_size
    assert last.data_offset + last.n_bytes == size


def test_gemma_gguf_layers(demo: DemoStore) -> None:
    r = _gguf(demo, f"{GEMMA}@llamacpp")
    by_name = {t.name: t for t in r.tensors}
    assert by_name["token_embd.weight"].tensor_type == Q.Q6_K
    assert by_name["blk.0.attn_q.weight"].tensor_type == Q.Q4_K
    assert by_name["blk.0.ffn_down.weight"].tensor_type == Q.Q6_K
    assert by_name["blk.1.ffn_down.weight"].tensor_type == Q.Q4_K
    assert len(by_name["blk.0.ffn_gate_up_exps.weight"].shape) == 3
    assert _kv(r, "tokenizer.ggml.model") == "llama"
    assert "<start_of_turn>" in _kv(r, "tokenizer.chat_template")
    assert len(_kv(r, "tokenizer.ggml.scores")) == len(_kv(r, "tokenizer.ggml.tokens"))
    # dequantizes to finite numbers: the block scales are real f16 values
    q = by_name["blk.0.attn_q.weight"]
    values = gguf.dequantize(q.data, q.tensor_type)
    assert values.size == q.n_elements and bool(abs(values).max() < 1e3)

    mmproj = _gguf(demo, f"{GEMMA}@llamacpp", "mmproj.gguf")
    assert _kv(mmproj, "general.architecture") == "clip"
    assert _kv(mmproj, "clip.projector_type")
    assert _kv(mmproj, "general.file_type") == 1
    assert {t.tensor_type for t in mmproj.tensors} == {Q.F16, Q.F32}

    draft = _gguf(demo, f"{GEMMA}@llamacpp", "draft.gguf")
    assert _kv(draft, "general.architecture") == "gemma4"
    assert {t.tensor_type for t in draft.tensors} == {Q.Q8_0, Q.F32}


def test_vocab_only_model_is_consistent(demo: DemoStore) -> None:
    """What llama.cpp needs to load the vocabulary of a `gpt2` (byte-level BPE) model."""
    assert VOCAB_ONLY_MODEL == LLAMA
    r = _gguf(demo, VOCAB_ONLY_MODEL)
    assert _kv(r, "general.architecture") == "llama"
    assert _kv(r, "tokenizer.ggml.model") == "gpt2"
    assert _kv(r, "tokenizer.ggml.pre") == "llama-bpe"
    tokens = _kv(r, "tokenizer.ggml.tokens")
    types = _kv(r, "tokenizer.ggml.token_type")
    ids = {t: i for i, t in enumerate(tokens)}
    assert _kv(r, "llama.vocab_size") == len(tokens)
    assert len([t for t in tokens if len(t) == 1]) >= 256  # every byte has a token
    merges = _kv(r, "tokenizer.ggml.merges")
    assert merges
    for merge in merges:
        left, right = merge.split(" ")
        assert left in ids and right in ids and left + right in ids
    for key in ("bos", "eos"):
        tid = _kv(r, f"tokenizer.ggml.{key}_token_id")
        assert 0 <= tid < len(tokens) and types[tid] == T.CONTROL
    assert "<|eot_id|>" in ids
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        assert _kv(r, f"llama.{key}") > 0


# --- safetensors -----------------------------------------------------------------------------


def test_tensor_blobs_read_with_safetensors(demo: DemoStore) -> None:
    mlx = demo.manifests[f"{GEMMA}@mlx"]
    tensor_layers = [layer for layer in mlx.layers if layer.media_type.endswith(".tensor")]
    assert [layer.name for layer in tensor_layers] == sorted(layer.name for layer in tensor_layers)
    quantized = plain = 0
    for layer in tensor_layers:
        assert layer.file == f"tensors/{layer.name}.safetensors"
        path = demo.blob_path(layer.digest)
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0
        header = json.loads(raw[8 : 8 + n])
        assert list(header) == sorted(header)  # Go marshals maps with sorted keys
        with safe_open(str(path), framework="numpy") as f:
            keys = set(f.keys())
            assert layer.name in keys
            meta = f.metadata()
            if meta and meta.get("quant_type") == "nvfp4":
                quantized += 1
                assert meta["group_size"] == "16"
                assert keys == {layer.name, layer.name + ".scale", layer.name + ".global_scale"}
                weight = f.get_tensor(layer.name)
                scale = f.get_tensor(layer.name + ".scale")
                global_scale = f.get_tensor(layer.name + ".global_scale")
                assert str(weight.dtype) == "uint32" and str(scale.dtype) == "uint8"
                assert str(global_scale.dtype) == "float32" and global_scale.shape == ()
                assert weight.shape[0] == scale.shape[0]
                assert weight.shape[1] * 8 == scale.shape[1] * 16  # in_features both ways
                assert 0 < float(global_scale) < 1
            else:
                plain += 1
                assert meta is None and keys == {layer.name}
                sl = f.get_slice(layer.name)
                assert sl.get_dtype() == "BF16"
                count = 1
                for d in sl.get_shape():
                    count *= d
                assert len(raw) - 8 - n == 2 * count
    assert quantized >= 10 and plain >= 10
    assert any(layer.name.startswith("draft.") for layer in tensor_layers)


def test_json_layers(demo: DemoStore) -> None:
    mlx = demo.manifests[f"{GEMMA}@mlx"]
    json_layers = {layer.name: layer for layer in mlx.layers if layer.media_type.endswith(".json")}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "draft/config.json"} <= set(
        json_layers
    )
    for name, layer in json_layers.items():
        assert layer.file == name
        json.loads(demo.blob_path(layer.digest).read_bytes())
    config = json.loads(demo.blob_path(json_layers["config.json"].digest).read_bytes())
    assert config["model_type"] == "gemma4"
    tokenizer = json.loads(demo.blob_path(json_layers["tokenizer.json"].digest).read_bytes())
    vocab = tokenizer["model"]["vocab"]
    for left, right in tokenizer["model"]["merges"]:
        assert left + right in vocab


# --- determinism, sizes, command line --------------------------------------------------------


def test_building_twice_gives_identical_digests(demo: DemoStore, tmp_path: Path) -> None:
    again = build_demo_store(tmp_path / "again")
    assert {k: m.digest for k, m in again.manifests.items()} == {
        k: m.digest for k, m in demo.manifests.items()
    }
    assert again.lists[GEMMA].digest == demo.lists[GEMMA].digest
    assert again.anchors[GEMMA].digest == demo.anchors[GEMMA].digest
    assert again.blobs == demo.blobs
    assert sorted(os.listdir(tmp_path / "again" / "blobs")) == sorted(
        os.listdir(demo.root / "blobs")
    )
    # and building over an existing store rewrites the same thing
    assert build_demo_store(tmp_path / "again").blobs == demo.blobs


def test_small_store_is_small(demo: DemoStore) -> None:
    total = sum(p.stat().st_size for p in (demo.root / "blobs").iterdir())
    assert total < 10 << 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("small", 0),
        ("0", 0),
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        ("4GiB", 4 << 30),
        ("1.5g", 3 << 29),
        ("512k", 512 << 10),
        ("1048576", 1 << 20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "x"), "--size", "lots"])
    assert exc.value.code == 2
    assert "bad size" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_size_option_makes_a_big_model_blob(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = 64 << 20
    assert main([str(tmp_path / "big"), "--size", "64M", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    path = Path(summary["model_blob"])
    size = path.stat().st_size
    assert summary["model_blob_size"] == size
    assert abs(size - target) < target * 0.01
    assert _sha256(path) == path.name.removeprefix("sha256-")
    r = gguf.GGUFReader(path)
    assert _kv(r, "general.architecture") == "gemma4"
    assert _kv(r, "general.file_type") == 15
    assert {t.tensor_type for t in r.tensors} == {Q.Q4_K, Q.Q6_K, Q.F32}
    last = max(r.tensors, key=lambda t: t.data_offset)
    assert last.data_offset + last.n_bytes == size
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert int(embd.shape[1]) == len(_kv(r, "tokenizer.ggml.tokens"))
    # the rest of the store stays small and the same
    assert (
        summary["manifests"][LLAMA]
        == build_demo_store(tmp_path / "small").manifests[LLAMA].digest.hex
    )


def test_script_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(REPO / "scripts" / "make-demo-store"), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for name in (GEMMA, LLAMA, QWEN, TINY, SMOL):
        assert name in out.stdout
    assert (tmp_path / "s" / "manifests-v2" / "ollama.com").is_dir()


def test_module_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "modelfs.demo", str(tmp_path / "m"), "--size", "small", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["names"][0] == GEMMA


def test_demo_store_prints_only_its_own_lines(tmp_path: Path) -> None:
    """`modelfs demo-store` through the CLI, whose logging shows INFO from every logger: only
    its summary and the CLI's own `modelfs:` lines, none of gguf's writer ("Writing the
    following files", "This GGUF file is for Little Endian only")."""
    modelfs = Path(sys.executable).parent / "modelfs"
    out = subprocess.run(
        [str(modelfs), "demo-store", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[0] == f"demo store: {tmp_path / 'd'}"
    assert lines[-1].startswith("  model blob: ")
    # Each tag as `modelfs ls` lists it (tests/test_words.py compares IDs and sizes).
    keys = [line.split()[0] for line in lines[1:-1]]
    assert keys == [e.name.shortest for e in ollama_entries(scan_store(tmp_path / "d"))]
