"""llama.cpp views of Ollama-layout GGUFs: per handler, a small GGUF in the Ollama
layout built here, its view read back with the reference reader (`gguf.GGUFReader`), and the
KVs, tensor names, shapes, types and data checked against what Ollama's upstream handler
(ollama/ollama llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modelfs.demo.vocab import GEMMA_SPECIALS, spm_vocab  # noqa: E402
from modelfs.store.compat import CompatViews, compat_views  # noqa: E402
from modelfs.store.compat.compute import ComputeCache  # noqa: E402
from modelfs.store.compat.view import GGUFView  # noqa: E402
from modelfs.store.gguf import read_array, read_gguf_header_path  # noqa: E402
from tests.builders import TinyStore  # noqa: E402
from tests.mounting import fuse, mounted  # noqa: E402

V = gguf.GGUFValueType
HEX = "ab" * 32

# (key, value, type[, item type])
KV = tuple[Any, ...]
# (name, numpy array), (name, numpy-order shape, ggml type name): raw random bytes, or
# (name, float array, ggml type name): the values quantized
Tensor = tuple[Any, ...]


def write_gguf(path: Path, arch: str, kvs: Sequence[KV], tensors: Sequence[Tensor]) -> Path:
    """A GGUF written by the reference writer, tensors filled with random data."""
    rng = np.random.default_rng(len(tensors))
    w = gguf.GGUFWriter(path, arch)
    for key, value, vtype, *sub in kvs:
        w.add_key_value(key, value, vtype, *sub)
    for spec in tensors:
        if len(spec) == 2:
            w.add_tensor(spec[0], spec[1])
            continue
        name, shape, type_name = spec
        qtype = gguf.GGMLQuantizationType[type_name]
        if isinstance(shape, np.ndarray):  # values, quantized by the reference quantizer
            w.add_tensor(name, gguf.quants.quantize(shape, qtype), raw_dtype=qtype)
            continue
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        *rows, cols = shape
        raw = rng.integers(0, 256, (*rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def f32(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def f16(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def tokenizer(n: int, model: str = "llama") -> list[KV]:
    return [
        ("tokenizer.ggml.model", model, V.STRING),
        ("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n)], V.ARRAY, V.STRING),
        ("tokenizer.ggml.scores", [float(-i) for i in range(n)], V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", [1] * n, V.ARRAY, V.INT32),
    ]


def materialize(view: GGUFView, tmp_path: Path, cache: ComputeCache | None = None) -> Path:
    """The view's bytes in a file, read in odd-sized pieces (as a reader through FUSE would)."""
    fd = os.open(view.source, os.O_RDONLY)
    try:
        chunks, off = [], 0
        while off < view.size:
            chunk = view.read(fd, off, 4093, cache)
            assert chunk
            chunks.append(chunk)
            off += len(chunk)
    finally:
        os.close(fd)
    out = tmp_path / f"{view.kind}-view.gguf"
    out.write_bytes(b"".join(chunks))
    assert out.stat().st_size == view.size
    return out


def bpe_tokenizer(vocab: Any, pre: str, **ids: int) -> list[KV]:
    """A GPT-2 style tokenizer's KVs from `modelfs.demo.vocab.bpe_vocab`; `ids` are
    `tokenizer.ggml.<name>_token_id` values."""
    return [
        ("tokenizer.ggml.model", "gpt2", V.STRING),
        ("tokenizer.ggml.pre", pre, V.STRING),
        ("tokenizer.ggml.tokens", list(vocab.tokens), V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", list(vocab.types), V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", list(vocab.merges), V.ARRAY, V.STRING),
        *((f"tokenizer.ggml.{k}_token_id", v, V.UINT32) for k, v in ids.items()),
    ]


def llama_cpp_loads_only_the_view(src: Path, tmp_path: Path) -> Any:
    """llama.cpp (vocab-only) refuses the Ollama-layout file and loads its view."""
    llama_cpp = pytest.importorskip("llama_cpp")
    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
    view = materialize(views_of(src).model, tmp_path)
    return llama_cpp.Llama(model_path=str(view), vocab_only=True, verbose=False)


def fields(reader: Any) -> dict[str, Any]:
    out = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        out[f.name] = f.contents()
    return out


def field_type(reader: Any, key: str) -> list[Any]:
    return list(reader.fields[key].types)


def tensors(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def raw(t: Any) -> bytes:
    return np.asarray(t.data).tobytes()


def views_of(path: Path) -> CompatViews:
    views = compat_views(path, HEX)
    assert views is not None
    return views


def check_aligned(reader: Any, alignment: int = 32) -> None:
    assert reader.data_offset % alignment == 0
    for t in reader.tensors:
        assert (t.data_offset - reader.data_offset) % alignment == 0


# -- gemma3 -------------------------------------------------------------------------------

GEMMA3_VOCAB = 40  # token_embd rows; Ollama's tokenizer arrays hold 8 more (image tokens)


def gemma3_ollama(tmp_path: Path, *, vision: bool = True) -> Path:
    kvs: list[KV] = [
        ("gemma3.context_length", 131072, V.UINT32),
        ("gemma3.embedding_length", 64, V.UINT32),
        ("gemma3.block_count", 1, V.UINT32),
        ("gemma3.rope.global.freq_base", 500_000.0, V.FLOAT32),
        ("gemma3.rope.local.freq_base", 20_000.0, V.FLOAT32),
        ("gemma3.mm.tokens_per_image", 256, V.UINT32),
        ("gemma3.vision.block_count", 1, V.UINT32),
        ("gemma3.vision.embedding_length", 32, V.UINT32),
        ("gemma3.vision.feed_forward_length", 64, V.UINT32),
        ("gemma3.vision.image_size", 28, V.UINT32),
        ("gemma3.vision.patch_size", 14, V.UINT32),
        ("gemma3.vision.attention.head_count", 2, V.UINT32),
        ("gemma3.vision.attention.layer_norm_epsilon", 1e-5, V.FLOAT32),
        *tokenizer(GEMMA3_VOCAB + 8),
        ("tokenizer.ggml.add_padding_token", False, V.BOOL),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (GEMMA3_VOCAB, 64), "Q8_0"),
        ("blk.0.attn_q.weight", (64, 64), "Q8_0"),
        ("blk.0.attn_norm.weight", f32(64, seed=1)),
        ("output_norm.weight", f32(64, seed=2)),
    ]
    if vision:
        ts += [
            ("v.patch_embedding.weight", f16(32, 3, 14, 14, seed=3)),
            ("v.position_embedding.weight", f16(4, 32, seed=4)),
            ("v.blk.0.layer_norm1.weight", f32(32, seed=5)),
            ("v.blk.0.layer_norm2.weight", f32(32, seed=6)),
            ("v.blk.0.attn_output.weight", f16(32, 32, seed=7)),
            ("v.blk.0.mlp.fc1.weight", f16(64, 32, seed=8)),
            ("v.blk.0.mlp.fc2.weight", f16(32, 64, seed=9)),
            ("v.post_layernorm.weight", f32(32, seed=10)),
            ("mm.mm_input_projection.weight", f16(64, 32, seed=11)),
            ("mm.mm_soft_emb_norm.weight", f32(32, seed=12)),
        ]
    return write_gguf(tmp_path / "gemma3.gguf", "gemma3", kvs, ts)


def test_gemma3_text_view(tmp_path: Path) -> None:
    src = gemma3_ollama(tmp_path)
    views = views_of(src)
    assert views.model.handler == "handle_gemma3"
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    source = gguf.GGUFReader(src)
    kv = fields(reader)
    # Nested rope names copied to the flat ones (the old keys stay, as upstream's copy_kv).
    assert kv["gemma3.rope.freq_base"] == pytest.approx(500_000.0)
    assert kv["gemma3.rope.freq_base_swa"] == pytest.approx(20_000.0)
    assert kv["gemma3.rope.global.freq_base"] == pytest.approx(500_000.0)
    # Defaults injected where missing.
    assert kv["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert "<start_of_turn>" in kv["tokenizer.chat_template"]
    # A >= 128k context gets Gemma 3's linear rope scaling.
    assert kv["gemma3.rope.scaling.type"] == "linear"
    assert kv["gemma3.rope.scaling.factor"] == pytest.approx(8.0)
    # Tokenizer arrays cut to token_embd's rows, types as upstream writes them.
    assert kv["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(GEMMA3_VOCAB)]
    assert kv["tokenizer.ggml.scores"] == [float(-i) for i in range(GEMMA3_VOCAB)]
    assert kv["tokenizer.ggml.token_type"] == [1] * GEMMA3_VOCAB
    assert field_type(reader, "tokenizer.ggml.token_type") == [V.ARRAY, V.INT32]
    # Everything else is the source's.
    for key, value in fields(source).items():
        if not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.model":
            assert kv[key] == value, key
    # Vision and projector tensors hidden; the text ones byte for byte.
    got, want = tensors(reader), tensors(source)
    assert list(got) == [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_norm.weight",
        "output_norm.weight",
    ]
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type
        assert list(t.shape) == list(want[name].shape)
        assert raw(t) == raw(want[name])
    check_aligned(reader)
    assert not views.model.computed
    assert views.model.hidden == tuple(n for n in want if n.startswith(("v.", "mm.")))


def test_gemma3_text_view_serves_source_ranges(tmp_path: Path) -> None:
    """No tensor byte is copied into the view: the data pieces are ranges of the blob, and
    the tokenizer KVs that did not change are a range too."""
    views = views_of(gemma3_ollama(tmp_path))
    view = views.model
    literal = sum(p.length for p in view.pieces if p.offset < 0 and p.compute is None)
    ranged = sum(p.length for p in view.pieces if p.offset >= 0)
    data = sum(t.nbytes for t in view.tensors)
    assert ranged >= data
    assert literal < view.data_offset  # only header bytes and padding are ours


def test_gemma3_mmproj_view(tmp_path: Path) -> None:
    src = gemma3_ollama(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None and views.mmproj.handler == "handle_gemma3_clip"
    cache_root = tmp_path / "store" / ".modelfs" / "compat"
    cache = ComputeCache(cache_root)
    reader = gguf.GGUFReader(materialize(views.mmproj, tmp_path, cache))
    source = tensors(gguf.GGUFReader(src))
    kv = fields(reader)
    assert kv["general.architecture"] == "clip"
    assert kv["clip.projector_type"] == "gemma3"
    assert kv["clip.vision.block_count"] == 1
    assert kv["clip.vision.embedding_length"] == 32
    assert kv["clip.vision.feed_forward_length"] == 64
    assert kv["clip.vision.image_size"] == 28
    assert kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_mean"] == [0.5, 0.5, 0.5]
    assert kv["clip.vision.image_std"] == [0.5, 0.5, 0.5]
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    assert not any(k.startswith("tokenizer.") for k in kv)  # the clip loader reads none
    got = tensors(reader)
    renames = {
        "v.patch_embd.weight": "v.patch_embedding.weight",
        "v.position_embd.weight": "v.position_embedding.weight",
        "v.blk.0.ln1.weight": "v.blk.0.layer_norm1.weight",
        "v.blk.0.ln2.weight": "v.blk.0.layer_norm2.weight",
        "v.blk.0.attn_out.weight": "v.blk.0.attn_output.weight",
        "v.blk.0.ffn_down.weight": "v.blk.0.mlp.fc1.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.fc2.weight",
        "v.post_ln.weight": "v.post_layernorm.weight",
        "mm.input_projection.weight": "mm.mm_input_projection.weight",
        "mm.soft_emb_norm.weight": "mm.mm_soft_emb_norm.weight",
    }
    assert sorted(got) == sorted(renames)
    for new, old in renames.items():
        t, s = got[new], source[old]
        assert list(t.shape) == list(s.shape)
        if new in ("v.patch_embd.weight", "v.position_embd.weight"):
            # promote_tensor_to_f32: F16 widened to F32 on first read.
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.array_equal(
                np.asarray(t.data).ravel(), np.asarray(s.data, np.float32).ravel()
            )
        else:
            assert t.tensor_type == s.tensor_type
            assert raw(t) == raw(s)
    check_aligned(reader)
    # The computed tensors were cached under .modelfs/compat/<source hex>/, once each.
    cached = sorted(p.name for p in (cache_root / HEX).rglob("*") if p.is_file())
    assert len(cached) == 2 and all("f16_to_f32" in n for n in cached)
    # A second read is served from the cache files.
    first = (tmp_path / "mmproj-view.gguf").read_bytes()
    assert materialize(views.mmproj, tmp_path, cache).read_bytes() == first


def test_computed_tensors_without_a_writable_store(tmp_path: Path) -> None:
    """A store where the cache cannot be written (read-only stores exist): the computed
    tensors are kept in memory and the view reads the same."""
    src = gemma3_ollama(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")  # mkdir below a regular file fails, even for root
    cache = ComputeCache(blocker / ".modelfs" / "compat")
    data = materialize(views.mmproj, tmp_path, cache).read_bytes()
    assert data == materialize(views.mmproj, tmp_path, ComputeCache(None)).read_bytes()
    assert blocker.is_file()


def test_gemma3_converted_upstream_gets_no_view(tmp_path: Path) -> None:
    """A gemma3 GGUF from llama.cpp's converter (separate mmproj, epsilon present, no quirk
    keys) is left alone: no view at all."""
    kvs: list[KV] = [
        ("gemma3.context_length", 32768, V.UINT32),
        ("gemma3.embedding_length", 64, V.UINT32),
        ("gemma3.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
        *tokenizer(GEMMA3_VOCAB),
    ]
    src = write_gguf(
        tmp_path / "g.gguf", "gemma3", kvs, [("token_embd.weight", (GEMMA3_VOCAB, 64), "Q8_0")]
    )
    assert compat_views(src, HEX) is None


def test_other_architectures_get_no_view(tmp_path: Path) -> None:
    kvs: list[KV] = [("llama.context_length", 4096, V.UINT32), *tokenizer(8)]
    src = write_gguf(tmp_path / "l.gguf", "llama", kvs, [("token_embd.weight", f32(8, 32))])
    assert compat_views(src, HEX) is None
    # gemma4 as llama.cpp converts it: BPE tokenizer named gemma4, no embedded encoders.
    kvs = [("gemma4.block_count", 1, V.UINT32), *tokenizer(8, model="gemma4")]
    src = write_gguf(tmp_path / "g4.gguf", "gemma4", kvs, [("token_embd.weight", f32(8, 32))])
    assert compat_views(src, HEX) is None


# -- gemma4 -------------------------------------------------------------------------------


def gemma4_ollama(tmp_path: Path, *, sidecar_block: int | None = None) -> Path:
    kvs: list[KV] = [
        ("gemma4.block_count", 2, V.UINT32),
        ("gemma4.embedding_length", 64, V.UINT32),
        *tokenizer(16, model="llama"),
        ("tokenizer.ggml.pre", "gemma4", V.STRING),
    ]
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    for b in range(2):
        ts += [
            (f"blk.{b}.ffn_gate_exps.weight", (4, 32, 64), "Q8_0"),
            (f"blk.{b}.ffn_up_exps.weight", (4, 32, 64), "Q8_0"),
            (f"blk.{b}.ffn_down_exps.weight", (4, 64, 32), "Q8_0"),
            (f"blk.{b}.ffn_gate_inp.per_expert_scale", f32(4, seed=b)),
        ]
        if b == sidecar_block:
            ts.append((f"blk.{b}.ffn_up_exps.scale", f32(4, seed=9)))
    ts += [
        ("a.blk.0.attn_q.weight", f16(32, 32)),
        ("v.blk.0.attn_q.weight", f16(32, 32)),
        ("mm.a.input_projection.weight", f16(64, 32)),
        ("model.vision_tower.patch.weight", f16(32, 32)),
    ]
    return write_gguf(tmp_path / "gemma4.gguf", "gemma4", kvs, ts)


def test_gemma4_text_view(tmp_path: Path) -> None:
    src = gemma4_ollama(tmp_path)
    views = views_of(src)
    assert views.model.handler == "handle_gemma4"
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    source = tensors(gguf.GGUFReader(src))
    kv = fields(reader)
    assert kv["tokenizer.ggml.model"] == "gemma4"  # BPE, not SPM
    assert kv["tokenizer.ggml.pre"] == "gemma4"
    got = tensors(reader)
    assert list(got) == [
        "token_embd.weight",
        "blk.0.ffn_gate_up_exps.weight",
        "blk.0.ffn_down_exps.weight",
        "blk.0.ffn_down_exps.scale",
        "blk.1.ffn_gate_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
        "blk.1.ffn_down_exps.scale",
    ]
    for b in range(2):
        fused = got[f"blk.{b}.ffn_gate_up_exps.weight"]
        gate, up = source[f"blk.{b}.ffn_gate_exps.weight"], source[f"blk.{b}.ffn_up_exps.weight"]
        # ggml shape {n_embd, 2 * n_ff, n_expert}; per expert: that expert's gate, then up.
        assert list(fused.shape) == [64, 64, 4]
        g, u = raw(gate), raw(up)
        per = len(g) // 4
        want = b"".join(g[e * per : (e + 1) * per] + u[e * per : (e + 1) * per] for e in range(4))
        assert raw(fused) == want
        assert raw(got[f"blk.{b}.ffn_down_exps.scale"]) == raw(
            source[f"blk.{b}.ffn_gate_inp.per_expert_scale"]
        )
    assert not views.model.computed  # the fused tensor is served as ranges of the blob
    check_aligned(reader)


def test_gemma4_split_experts_with_sidecars_stay_split(tmp_path: Path) -> None:
    views = views_of(gemma4_ollama(tmp_path, sidecar_block=1))
    names = [t.name for t in views.model.tensors]
    assert "blk.0.ffn_gate_up_exps.weight" in names
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.ffn_up_exps.weight" in names
    assert "blk.1.ffn_up_exps.scale" in names


# -- qwen35 / qwen35moe -------------------------------------------------------------------


def qwen35_ollama(tmp_path: Path, arch: str) -> Path:
    kvs: list[KV] = [
        (f"{arch}.block_count", 2, V.UINT32),
        (f"{arch}.attention.head_count_kv", [0, 4], V.ARRAY, V.UINT32),
        (f"{arch}.rope.dimension_sections", [11, 11, 10], V.ARRAY, V.INT32),
        (f"{arch}.ssm.v_head_reordered", True, V.BOOL),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("blk.0.ssm_dt", f32(8, seed=1)),
        ("blk.0.attn_norm.weight", f32(64, seed=2)),
        ("blk.1.attn_norm.weight", f32(64, seed=3)),
        ("mtp.fc.weight", (64, 128), "Q8_0"),
        ("mtp.pre_fc_norm_embedding.weight", f32(64, seed=4)),
        ("mtp.pre_fc_norm_hidden.weight", f16(64, seed=5)),
        ("mtp.norm.weight", f32(64, seed=6)),
        ("mtp.layers.0.input_layernorm.weight", f32(64, seed=7)),
        ("mtp.layers.0.self_attn.q_proj.weight", (64, 64), "Q8_0"),
        ("v.blk.0.attn_q.weight", f16(32, 32)),
        ("mm.0.weight", f16(64, 32)),
    ]
    if arch == "qwen35moe":
        for e in range(3):
            for part in ("gate_proj", "up_proj"):
                ts.append((f"mtp.layers.0.mlp.experts.{e}.{part}.weight", (32, 64), "Q8_0"))
            ts.append((f"mtp.layers.0.mlp.experts.{e}.down_proj.weight", (64, 32), "Q8_0"))
    return write_gguf(tmp_path / f"{arch}.gguf", arch, kvs, ts)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_qwen35_text_view(tmp_path: Path, arch: str) -> None:
    src = qwen35_ollama(tmp_path, arch)
    views = views_of(src)
    assert views.model.handler == f"handle_{arch}"
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    source = tensors(gguf.GGUFReader(src))
    kv = fields(reader)
    # head_count_kv: the per-layer array collapsed to its largest value, as u32.
    assert kv[f"{arch}.attention.head_count_kv"] == 4
    assert field_type(reader, f"{arch}.attention.head_count_kv") == [V.UINT32]
    # M-RoPE sections padded to four.
    assert kv[f"{arch}.rope.dimension_sections"] == [11, 11, 10, 0]
    # One MTP layer appended after the two text blocks.
    assert kv[f"{arch}.block_count"] == 3
    assert kv[f"{arch}.nextn_predict_layers"] == 1
    got = tensors(reader)
    assert raw(got["blk.0.ssm_dt.bias"]) == raw(source["blk.0.ssm_dt"])
    # Renamed MTP tensors; norms become F32 holding w + 1 (computed), others byte for byte.
    plain = {
        "blk.2.nextn.eh_proj.weight": "mtp.fc.weight",
        "blk.2.self_attn.q_proj.weight": "mtp.layers.0.self_attn.q_proj.weight",
    }
    shifted = {
        "blk.2.nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
        "blk.2.nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
        "blk.2.nextn.shared_head_norm.weight": "mtp.norm.weight",
    }
    for new, old in plain.items():
        assert raw(got[new]) == raw(source[old])
        assert got[new].tensor_type == source[old].tensor_type
    for new, old in shifted.items():
        assert got[new].tensor_type == gguf.GGMLQuantizationType.F32
        want = np.asarray(source[old].data, np.float32) + 1.0
        assert np.array_equal(np.asarray(got[new].data), want)
    # input_layernorm does not end in _norm.weight: renamed, unchanged.
    assert raw(got["blk.2.input_layernorm.weight"]) == raw(
        source["mtp.layers.0.input_layernorm.weight"]
    )
    if arch == "qwen35moe":
        for src_part, dst in (
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ):
            merged = got[f"blk.2.{dst}.weight"]
            parts = [source[f"mtp.layers.0.mlp.experts.{e}.{src_part}.weight"] for e in range(3)]
            assert list(merged.shape) == [*parts[0].shape, 3]
            assert raw(merged) == b"".join(raw(p) for p in parts)
    assert not any(n.startswith(("v.", "mm.", "mtp.")) for n in got)
    check_aligned(reader)


# -- gptoss, mistral3, llama4 -------------------------------------------------------------


def gptoss_ollama(tmp_path: Path, kvs: Sequence[KV] = ()) -> Path:
    base: list[KV] = [
        ("gptoss.block_count", 1, V.UINT32),
        ("gptoss.context_length", 4096, V.UINT32),
        ("gptoss.expert_count", 4, V.UINT32),
        *tokenizer(16, model="gpt2"),
        ("tokenizer.ggml.pre", "default", V.STRING),
        *kvs,
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("blk.0.attn_out.weight", (64, 64), "Q8_0"),
        ("blk.0.attn_out.bias", f32(64, seed=1)),
        ("blk.0.attn_sinks", f32(8, seed=2)),
        ("blk.0.ffn_norm.weight", f32(64, seed=3)),
        ("blk.0.ffn_gate_exps.weight", (4, 96, 64), "Q8_0"),
    ]
    return write_gguf(tmp_path / "gptoss.gguf", "gptoss", base, ts)


def test_gptoss_view(tmp_path: Path) -> None:
    src = gptoss_ollama(tmp_path)
    views = views_of(src)
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    source = tensors(gguf.GGUFReader(src))
    kv = fields(reader)
    assert kv["general.architecture"] == "gpt-oss"
    # Every gptoss.* key has its gpt-oss.* copy (the old ones stay, as upstream).
    assert kv["gpt-oss.block_count"] == 1 and kv["gptoss.block_count"] == 1
    assert kv["gpt-oss.context_length"] == 4096 and kv["gpt-oss.expert_count"] == 4
    # n_ff_exp recovered from ffn_gate_exps {n_embd, n_ff_exp, n_expert}.
    assert kv["gpt-oss.expert_feed_forward_length"] == 96
    assert kv["gpt-oss.rope.scaling.type"] == "yarn"
    assert kv["tokenizer.ggml.pre"] == "gpt-4o"
    renames = {
        "token_embd.weight": "token_embd.weight",
        "blk.0.attn_output.weight": "blk.0.attn_out.weight",
        "blk.0.attn_output.bias": "blk.0.attn_out.bias",
        "blk.0.attn_sinks.weight": "blk.0.attn_sinks",
        "blk.0.post_attention_norm.weight": "blk.0.ffn_norm.weight",
        "blk.0.ffn_gate_exps.weight": "blk.0.ffn_gate_exps.weight",
    }
    got = tensors(reader)
    assert list(got) == list(renames)
    for new, old in renames.items():
        assert raw(got[new]) == raw(source[old])
        assert list(got[new].shape) == list(source[old].shape)


def test_gptoss_keeps_a_given_expert_ffn_length(tmp_path: Path) -> None:
    src = gptoss_ollama(tmp_path, [("gptoss.expert_feed_forward_length", 2880, V.UINT32)])
    reader = gguf.GGUFReader(materialize(views_of(src).model, tmp_path))
    assert fields(reader)["gpt-oss.expert_feed_forward_length"] == 2880


def test_mistral3_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("mistral3.block_count", 1, V.UINT32),
        ("mistral3.rope.scaling.beta_fast", 32.0, V.FLOAT32),
        ("mistral3.rope.scaling.beta_slow", 1.0, V.FLOAT32),
        ("mistral3.rope.scaling.mscale_all_dim", 1.0, V.FLOAT32),
        ("mistral3.rope.scaling_beta", 0.1, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("v.blk.0.attn_q.weight", f16(32, 32)),
        ("mm.linear_1.weight", f16(64, 32)),
    ]
    src = write_gguf(tmp_path / "m.gguf", "mistral3", kvs, ts)
    views = views_of(src)
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    kv = fields(reader)
    assert kv["mistral3.rope.scaling.yarn_beta_fast"] == pytest.approx(32.0)
    assert kv["mistral3.rope.scaling.yarn_beta_slow"] == pytest.approx(1.0)
    assert kv["mistral3.rope.scaling.yarn_log_multiplier"] == pytest.approx(1.0)
    assert kv["mistral3.attention.temperature_scale"] == pytest.approx(0.1)
    assert kv["mistral3.rope.scaling.beta_fast"] == pytest.approx(32.0)  # kept
    assert kv["tokenizer.ggml.pre"] == "tekken"  # was missing
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]


def test_llama4_view(tmp_path: Path) -> None:
    kvs: list[KV] = [("llama4.block_count", 1, V.UINT32), *tokenizer(16, model="gpt2")]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("blk.0.attn_q.weight", (64, 64), "Q8_0"),
        ("v.patch_embedding.weight", f16(32, 32)),
        ("mm.linear_1.weight", f16(64, 32)),
    ]
    src = write_gguf(tmp_path / "l4.gguf", "llama4", kvs, ts)
    views = views_of(src)
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    source = gguf.GGUFReader(src)
    assert fields(reader) == fields(source)  # nothing to change but the hidden tensors
    assert [t.name for t in reader.tensors] == ["token_embd.weight", "blk.0.attn_q.weight"]
    for t, s in zip(reader.tensors, source.tensors, strict=False):
        assert raw(t) == raw(s)
    # A llama4 GGUF without embedded vision needs no view.
    plain = write_gguf(tmp_path / "l4b.gguf", "llama4", kvs, ts[:2])
    assert compat_views(plain, HEX) is None


def test_general_alignment_is_kept(tmp_path: Path) -> None:
    kvs: list[KV] = [("llama4.block_count", 1, V.UINT32), ("general.alignment", 64, V.UINT32)]
    ts: list[Tensor] = [
        ("blk.0.attn_norm.weight", f32(3, seed=1)),
        ("v.x.weight", f32(5, seed=2)),
        ("blk.0.ffn_norm.weight", f32(7, seed=3)),
    ]
    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(path, "llama4")
    w.data_alignment = 64
    for key, value, vtype in kvs:
        if key != "general.alignment":
            w.add_key_value(key, value, vtype)
    w.add_custom_alignment(64)
    for name, arr in ts:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(materialize(views_of(path).model, tmp_path))
    assert reader.alignment == 64
    check_aligned(reader, 64)
    source = tensors(gguf.GGUFReader(path))
    for t in reader.tensors:
        assert raw(t) == raw(source[t.name])


# -- through a real mount, and llama.cpp itself ------------------------------------------


def decoder_tensors(
    n_vocab: int,
    e: int,
    heads: int,
    kv_heads: int,
    ff: int,
    *,
    hd: int | None = None,
    output: bool = True,
    extra: dict[str, tuple[int, ...]] | None = None,
) -> list[Tensor]:
    """One llama-style decoder block of width `e` and the embeddings around it (F32, small
    values): enough for llama.cpp to load and run a text model. `extra` adds tensors."""
    hd = hd or e // heads
    shapes = {
        "token_embd.weight": (n_vocab, e),
        "output_norm.weight": (e,),
        **({"output.weight": (n_vocab, e)} if output else {}),
        "blk.0.attn_norm.weight": (e,),
        "blk.0.attn_q.weight": (heads * hd, e),
        "blk.0.attn_k.weight": (kv_heads * hd, e),
        "blk.0.attn_v.weight": (kv_heads * hd, e),
        "blk.0.attn_output.weight": (e, heads * hd),
        "blk.0.ffn_norm.weight": (e,),
        "blk.0.ffn_gate.weight": (ff, e),
        "blk.0.ffn_up.weight": (ff, e),
        "blk.0.ffn_down.weight": (e, ff),
        **(extra or {}),
    }
    return [(k, f32(*s, seed=i) * 0.02) for i, (k, s) in enumerate(shapes.items())]


def gemma3_runnable(
    tmp_path: Path, vision: Sequence[Tensor] | None = None, vision_kvs: Sequence[KV] = ()
) -> Path:
    """A tiny but complete gemma3 (one block, F32 weights, an SPM vocabulary) in Ollama's
    layout: vision tensors inline, nested rope names, no rms epsilon, 8 image tokens past
    the embedding rows. Upstream llama.cpp refuses it; its view loads and generates.
    `vision` and `vision_kvs` replace its three vision tensors and add KVs."""
    vocab = spm_vocab(GEMMA_SPECIALS)
    n = len(vocab.tokens)
    e, heads, kv_heads, hd, ff = 64, 2, 1, 32, 128
    kvs: list[KV] = [
        ("gemma3.context_length", 131072, V.UINT32),
        ("gemma3.embedding_length", e, V.UINT32),
        ("gemma3.block_count", 1, V.UINT32),
        ("gemma3.feed_forward_length", ff, V.UINT32),
        ("gemma3.attention.head_count", heads, V.UINT32),
        ("gemma3.attention.head_count_kv", kv_heads, V.UINT32),
        ("gemma3.attention.key_length", hd, V.UINT32),
        ("gemma3.attention.value_length", hd, V.UINT32),
        ("gemma3.attention.sliding_window", 512, V.UINT32),
        ("gemma3.rope.global.freq_base", 1e6, V.FLOAT32),
        ("gemma3.mm.tokens_per_image", 256, V.UINT32),
        ("gemma3.vision.block_count", 1, V.UINT32),
        ("gemma3.vision.embedding_length", 32, V.UINT32),
        ("tokenizer.ggml.model", "llama", V.STRING),
        (
            "tokenizer.ggml.tokens",
            [*vocab.tokens, *(f"<img{i}>" for i in range(8))],
            V.ARRAY,
            V.STRING,
        ),
        ("tokenizer.ggml.scores", [*(vocab.scores or ()), *[0.0] * 8], V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", [*vocab.types, *[3] * 8], V.ARRAY, V.INT32),
        ("tokenizer.ggml.bos_token_id", vocab.specials["<bos>"], V.UINT32),
        ("tokenizer.ggml.eos_token_id", vocab.specials["<eos>"], V.UINT32),
        ("tokenizer.ggml.add_padding_token", False, V.BOOL),
        *vision_kvs,
    ]
    ts = decoder_tensors(
        n,
        e,
        heads,
        kv_heads,
        ff,
        hd=hd,
        output=False,
        extra={
            "blk.0.attn_q_norm.weight": (hd,),
            "blk.0.attn_k_norm.weight": (hd,),
            "blk.0.post_attention_norm.weight": (e,),
            "blk.0.post_ffw_norm.weight": (e,),
        },
    )
    ts += (
        [
            ("v.patch_embedding.weight", f16(32, 3, 14, 14, seed=90)),
            ("v.position_embedding.weight", f16(4, 32, seed=91)),
            ("mm.mm_input_projection.weight", f16(e, 32, seed=92)),
        ]
        if vision is None
        else vision
    )
    return write_gguf(tmp_path / "gemma3-runnable.gguf", "gemma3", kvs, ts)


def compat_store(tmp_path: Path) -> tuple[TinyStore, Path]:
    tiny = TinyStore(tmp_path / "models")
    src = gemma3_runnable(tmp_path)
    raw_manifest = tiny.manifest(
        [tiny.layer("model", src.read_bytes()), tiny.layer("license", b"Gemma")],
        {"model_format": "gguf", "model_family": "gemma3", "file_type": "F32"},
    )
    tiny.legacy("gemma3:tiny", raw_manifest)
    plain = write_gguf(
        tmp_path / "plain.gguf",
        "llama",
        [("llama.context_length", 4096, V.UINT32), *tokenizer(8)],
        [("token_embd.weight", f32(8, 32))],
    )
    tiny.legacy("plain:tiny", tiny.manifest([tiny.layer("model", plain.read_bytes())]))
    return tiny, src


def test_show_names_the_llama_cpp_files(tmp_path: Path) -> None:
    from modelfs.cli.show import render, show_record
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    index = scan_store(tiny.layout)
    records = {e.name.model: show_record(index, e) for e in index}
    lc = records["gemma3"]["variants"][0]["llama_cpp"]
    assert lc["model"] == "llama.cpp/model.gguf" and lc["mmproj"] == "llama.cpp/mmproj.gguf"
    assert lc["view"]["rules"] == "handle_gemma3" and lc["view"]["hidden"] == 3
    text = render(records["gemma3"])
    assert "llama.cpp: --model llama.cpp/model.gguf --mmproj llama.cpp/mmproj.gguf" in text
    plain = records["plain"]["variants"][0]["llama_cpp"]
    assert plain == {"model": "model.gguf", "mmproj": None, "view": None, "mmproj_view": None}


@fuse
def test_mount_shows_llama_cpp_views(tmp_path: Path) -> None:
    tiny, src = compat_store(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None
    want_model = materialize(views.model, tmp_path, ComputeCache(None)).read_bytes()
    want_mmproj = materialize(views.mmproj, tmp_path, ComputeCache(None)).read_bytes()
    child = tiny.manifest([tiny.layer("model", src.read_bytes())])
    tiny.v2("gemma3:listed", tiny.manifest_list([(child, "llamacpp", "gguf")]))
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "gemma3" / "tiny"
        assert sorted(os.listdir(d / "llama.cpp")) == ["mmproj.gguf", "model.gguf"]
        assert (d / "model.gguf").read_bytes() == src.read_bytes()  # raw stays raw
        assert (d / "llama.cpp" / "model.gguf").stat().st_size == len(want_model)
        assert (d / "llama.cpp" / "model.gguf").read_bytes() == want_model
        assert (d / "llama.cpp" / "mmproj.gguf").read_bytes() == want_mmproj
        digest = os.getxattr(d / "llama.cpp" / "model.gguf", "user.modelfs.compat.source")
        assert digest == os.getxattr(d / "model.gguf", "user.modelfs.digest")
        # The computed tensors of the projector view were cached by the mount.
        cached = list((tiny.root / ".modelfs" / "compat").rglob("*f16_to_f32*"))
        assert len(cached) == 2
        assert not (mnt / "plain" / "tiny" / "llama.cpp").exists()
        assert not (mnt / "gemma3" / "listed@llamacpp" / "llama.cpp").exists()
        assert (mnt / "gemma3" / "listed@llamacpp" / "model.gguf").is_file()
        assert "model.gguf" in os.listdir(mnt / "plain" / "tiny")


@fuse
@pytest.mark.slow
def test_llama_cpp_loads_the_view_it_refuses_raw(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    tiny, _ = compat_store(tmp_path)
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "gemma3" / "tiny"
        # Raw, llama.cpp stops at the missing gemma3.attention.layer_norm_rms_epsilon.
        with pytest.raises(ValueError):
            llama_cpp.Llama(model_path=str(d / "model.gguf"), n_ctx=64, verbose=False)
        # The view loads in full (every tensor, no vision ones left over) and runs.
        llm = llama_cpp.Llama(
            model_path=str(d / "llama.cpp" / "model.gguf"), n_ctx=64, verbose=False
        )
        assert llm.n_vocab() == len(spm_vocab(GEMMA_SPECIALS).tokens)  # image tokens cut
        tokens = llm.tokenize(b"hello world", add_bos=False)
        assert llm.detokenize(tokens).lstrip() == b"hello world"  # SPM: a leading space
        out = llm("hello", max_tokens=3, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1


def test_llamacpp_children_and_non_gguf_blobs_get_no_view(tmp_path: Path) -> None:
    """A manifest-list child made for llama.cpp is in its layout by definition (upstream runs
    those with its compat layer off); a blob that is no GGUF is never parsed as one."""
    from modelfs.cli.show import show_record
    from modelfs.store.compat import may_need_view
    from modelfs.store.scan import scan_store

    tiny, src = compat_store(tmp_path)
    child = tiny.manifest([tiny.layer("model", src.read_bytes())])
    tiny.v2("gemma3:listed", tiny.manifest_list([(child, "llamacpp", "gguf")]))
    index = scan_store(tiny.layout)
    entry = next(e for e in index if e.name.tag == "listed")
    lc = show_record(index, entry)["variants"][0]["llama_cpp"]
    assert lc == {"model": "model.gguf", "mmproj": None, "view": None, "mmproj_view": None}
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a gguf at all, but long enough to look")
    assert not may_need_view(junk)
    assert may_need_view(src)


@pytest.mark.slow
def test_llama_cpp_reads_the_gptoss_view_it_refuses_raw(tmp_path: Path) -> None:
    """llama.cpp knows no architecture "gptoss"; the view's gpt-oss hyperparameters and
    vocabulary load (vocab-only: its MXFP4 experts are not built here)."""
    from modelfs.demo.vocab import bpe_vocab

    vocab = bpe_vocab(("<|startoftext|>", "<|endoftext|>", "<|return|>"))
    hparams = {
        "context_length": 4096,
        "embedding_length": 64,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "expert_count": 4,
        "expert_used_count": 2,
        "attention.sliding_window": 128,
    }
    kvs: list[KV] = [(f"gptoss.{k}", v, V.UINT32) for k, v in hparams.items()]
    kvs += [
        ("gptoss.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("gptoss.rope.freq_base", 150000.0, V.FLOAT32),
        *bpe_tokenizer(
            vocab,
            "default",
            bos=vocab.specials["<|startoftext|>"],
            eos=vocab.specials["<|return|>"],
        ),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", f32(len(vocab.tokens), 64)),
        ("blk.0.ffn_gate_exps.weight", f32(4, 96, 64)),
        ("blk.0.attn_sinks", f32(2)),
    ]
    src = write_gguf(tmp_path / "gptoss.gguf", "gptoss", kvs, ts)
    llm = llama_cpp_loads_only_the_view(src, tmp_path)
    assert llm.n_vocab() == len(vocab.tokens)
    tokens = llm.tokenize(b" hello world", add_bos=False)
    assert len(tokens) == 2  # the merged words, with their leading spaces
    assert llm.detokenize(tokens) == b" hello world"


# -- clip (mmproj.gguf) views of the other monolithic architectures -----------------------


def mmproj_of(src: Path, tmp_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(view reader, its KVs, the source's tensors by name) of src's mmproj view."""
    views = views_of(src)
    assert views.mmproj is not None
    reader = gguf.GGUFReader(materialize(views.mmproj, tmp_path, ComputeCache(None)))
    check_aligned(reader)
    kv = fields(reader)
    assert kv["general.architecture"] == "clip"
    assert not any(k.startswith("tokenizer.") for k in kv)
    return reader, kv, tensors(gguf.GGUFReader(src))


def check_renamed(got: dict[str, Any], source: dict[str, Any], renames: dict[str, str]) -> None:
    """Each view tensor `new` is source tensor `old`, byte for byte, same type and shape."""
    for new, old in renames.items():
        t, s = got[new], source[old]
        assert t.tensor_type == s.tensor_type, new
        assert list(t.shape) == list(s.shape), new
        assert raw(t) == raw(s), new


def as_f32(t: Any) -> np.ndarray:
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    return np.asarray(t.data, np.float32)


def qwen35_vision(tmp_path: Path, arch: str) -> Path:
    """qwen35(moe) with its vision tower inline: separate q/k/v, a packed two-frame F16
    patch embedding, the merger under v.merger.*."""
    kvs: list[KV] = [
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.embedding_length", 64, V.UINT32),
        (f"{arch}.vision.block_count", 2, V.UINT32),
        (f"{arch}.vision.embedding_length", 8, V.UINT32),
        (f"{arch}.vision.attention.head_count", 2, V.UINT32),
        (f"{arch}.vision.patch_size", 2, V.UINT32),
        (f"{arch}.vision.spatial_merge_size", 2, V.UINT32),
        (f"{arch}.vision.num_channels", 3, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("mtp.fc.weight", f32(64, 4))]
    for b in range(2):
        for i, x in enumerate("qkv"):
            ts.append((f"v.blk.{b}.attn_{x}.weight", f16(8, 8, seed=10 * b + i)))
            ts.append((f"v.blk.{b}.attn_{x}.bias", f32(8, seed=20 + 10 * b + i)))
        ts += [
            (f"v.blk.{b}.attn_out.weight", f16(8, 8, seed=40 + b)),
            (f"v.blk.{b}.norm1.weight", f32(8, seed=42 + b)),
            (f"v.blk.{b}.norm2.weight", f32(8, seed=44 + b)),
            (f"v.blk.{b}.mlp.linear_fc1.weight", f16(16, 8, seed=46 + b)),
            (f"v.blk.{b}.mlp.linear_fc2.weight", f16(8, 16, seed=48 + b)),
        ]
    ts += [
        # numpy order [c_out*c_in, frames, h, w] = ggml [w, h, frames, packed]
        ("v.patch_embed.weight", f16(8 * 3, 2, 2, 2, seed=50)),
        ("v.pos_embed.weight", f16(4, 8, seed=51)),
        ("v.merger.norm.weight", f32(8, seed=52)),
        ("v.merger.linear_fc1.weight", f16(32, 32, seed=53)),
        ("v.merger.linear_fc2.weight", f16(64, 32, seed=54)),
    ]
    return write_gguf(tmp_path / f"{arch}-vision.gguf", arch, kvs, ts)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_qwen35_mmproj_view(tmp_path: Path, arch: str) -> None:
    src = qwen35_vision(tmp_path, arch)
    assert views_of(src).mmproj.handler == f"handle_{arch}_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen3vl_merger"
    assert kv["clip.vision.block_count"] == 2
    assert kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.patch_size"] == 2
    assert kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.projection_dim"] == 64
    # Defaults of the reference mmproj for what these files lack.
    assert kv["clip.vision.feed_forward_length"] == 4304
    assert kv["clip.vision.image_size"] == 768
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.image_mean"] == [0.5] * 3 and kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.vision.is_deepstack_layers"] == [False, False]
    assert field_type(reader, "clip.vision.is_deepstack_layers") == [V.ARRAY, V.BOOL]
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    for b in range(2):
        # q, k, v concatenated along the slow axis: [8, 8] x 3 -> [8, 24].
        w, bias = got[f"v.blk.{b}.attn_qkv.weight"], got[f"v.blk.{b}.attn_qkv.bias"]
        assert list(w.shape) == [8, 24] and list(bias.shape) == [24]
        assert w.tensor_type == gguf.GGMLQuantizationType.F16
        parts = [source[f"v.blk.{b}.attn_{x}.weight"] for x in "qkv"]
        assert raw(w) == b"".join(raw(p) for p in parts)
        bparts = [source[f"v.blk.{b}.attn_{x}.bias"] for x in "qkv"]
        assert raw(bias) == b"".join(raw(p) for p in bparts)
        for x in "qkv":
            assert f"v.blk.{b}.attn_{x}.weight" not in got  # merged: no orphans
    check_renamed(
        got,
        source,
        {
            "v.blk.0.ln1.weight": "v.blk.0.norm1.weight",
            "v.blk.1.ln2.weight": "v.blk.1.norm2.weight",
            "v.blk.0.ffn_up.weight": "v.blk.0.mlp.linear_fc1.weight",
            "v.blk.1.ffn_down.weight": "v.blk.1.mlp.linear_fc2.weight",
            "v.blk.0.attn_out.weight": "v.blk.0.attn_out.weight",
            "v.post_ln.weight": "v.merger.norm.weight",
            "mm.0.weight": "v.merger.linear_fc1.weight",
            "mm.2.weight": "v.merger.linear_fc2.weight",
        },
    )
    # The packed two-frame patch embedding -> one F32 [w, h, c_in, c_out] per frame.
    packed = np.asarray(source["v.patch_embed.weight"].data).reshape(24, 2, 2, 2)
    for name, frame in (("v.patch_embd.weight", 0), ("v.patch_embd.weight.1", 1)):
        assert list(got[name].shape) == [2, 2, 3, 8]
        want = packed[:, frame].astype(np.float32).reshape(8, 3, 2, 2)
        assert np.array_equal(as_f32(got[name]).reshape(8, 3, 2, 2), want)
    pos = got["v.position_embd.weight"]
    assert np.array_equal(as_f32(pos), np.asarray(source["v.pos_embed.weight"].data, np.float32))
    assert not any(n.startswith(("token_embd", "mtp.", "blk.")) for n in got)
    assert len(got) == 2 * 7 + 6  # per block 7; two patch slices, pos, post_ln, mm.0, mm.2


def test_mistral3_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("mistral3.block_count", 1, V.UINT32),
        ("mistral3.embedding_length", 64, V.UINT32),
        ("mistral3.spatial_merge_size", 2, V.UINT32),
        ("mistral3.vision.block_count", 1, V.UINT32),
        ("mistral3.vision.embedding_length", 16, V.UINT32),
        ("mistral3.vision.feed_forward_length", 32, V.UINT32),
        ("mistral3.vision.attention.head_count", 2, V.UINT32),
        ("mistral3.vision.image_size", 32, V.UINT32),
        ("mistral3.vision.patch_size", 4, V.UINT32),
        ("mistral3.vision.num_channels", 3, V.UINT32),
        ("mistral3.vision.rope.freq_base", 10000.0, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("output_norm.weight", f32(64, seed=1)),
        ("v.patch_conv.weight", f16(16, 3, 4, 4, seed=2)),
        ("v.encoder_norm.weight", f32(16, seed=3)),
        ("v.blk.0.attn_q.weight", f16(16, 16, seed=4)),
        ("v.blk.0.attn_k.weight", f16(16, 16, seed=5)),
        ("v.blk.0.attn_v.weight", f16(16, 16, seed=6)),
        ("v.blk.0.attn_output.weight", f16(16, 16, seed=7)),
        ("v.blk.0.attn_norm.weight", f32(16, seed=8)),
        ("v.blk.0.ffn_norm.weight", f32(16, seed=9)),
        ("mm.linear_1.weight", f16(64, 16, seed=10)),
        ("mm.linear_2.weight", f16(64, 64, seed=11)),
        ("mm.norm.weight", f32(16, seed=12)),
        ("mm.patch_merger.merging_layer.weight", f16(16, 64, seed=13)),
    ]
    src = write_gguf(tmp_path / "mistral3-vision.gguf", "mistral3", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "pixtral"
    for key, want in (
        ("block_count", 1),
        ("embedding_length", 16),
        ("feed_forward_length", 32),
        ("attention.head_count", 2),
        ("image_size", 32),
        ("patch_size", 4),
        ("num_channels", 3),
        ("spatial_merge_size", 2),
        ("projection_dim", 64),
    ):
        assert kv[f"clip.vision.{key}"] == want, key
    assert kv["clip.rope.freq_base"] == pytest.approx(10000.0)
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.image_mean"] == pytest.approx([0.48145467, 0.4578275, 0.40821072])
    assert kv["clip.vision.image_std"] == pytest.approx([0.26862955, 0.26130259, 0.2757771])
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    # Vision Q/K rows in llama.cpp's RoPE order: per head, [n_head, 2, hd/2] -> [n_head,
    # hd/2, 2] (what llama.cpp's converter does); V untouched.
    for x in "qk":
        w = np.asarray(source[f"v.blk.0.attn_{x}.weight"].data)
        want = w.reshape(2, 2, 4, 16).swapaxes(1, 2).reshape(16, 16)
        t = got[f"v.blk.0.attn_{x}.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F16
        assert np.array_equal(np.asarray(t.data), want)
    # [IMG_BREAK]'s embedding: zeros, F32 [n_embd], in output_norm's place.
    brk = got["v.token_embd.img_break"]
    assert list(brk.shape) == [64] and not as_f32(brk).any()
    patch = got["v.patch_embd.weight"]
    assert list(patch.shape) == list(source["v.patch_conv.weight"].shape)
    assert np.array_equal(as_f32(patch), np.asarray(source["v.patch_conv.weight"].data, np.float32))
    check_renamed(
        got,
        source,
        {
            "v.pre_ln.weight": "v.encoder_norm.weight",
            "v.blk.0.attn_v.weight": "v.blk.0.attn_v.weight",
            "v.blk.0.attn_out.weight": "v.blk.0.attn_output.weight",
            "v.blk.0.ln1.weight": "v.blk.0.attn_norm.weight",
            "v.blk.0.ln2.weight": "v.blk.0.ffn_norm.weight",
            "mm.1.weight": "mm.linear_1.weight",
            "mm.2.weight": "mm.linear_2.weight",
            "mm.input_norm.weight": "mm.norm.weight",
            "mm.patch_merger.weight": "mm.patch_merger.merging_layer.weight",
        },
    )
    assert len(got) == 13


def test_llama4_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("llama4.block_count", 1, V.UINT32),
        ("llama4.embedding_length", 64, V.UINT32),
        ("llama4.vision.block_count", 1, V.UINT32),
        ("llama4.vision.embedding_length", 16, V.UINT32),
        ("llama4.vision.feed_forward_length", 32, V.UINT32),
        ("llama4.vision.attention.head_count", 2, V.UINT32),
        ("llama4.vision.image_size", 28, V.UINT32),
        ("llama4.vision.patch_size", 14, V.UINT32),
        ("llama4.vision.layer_norm_epsilon", 1e-5, V.FLOAT32),
        ("llama4.vision.pixel_shuffle_ratio", 0.5, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.position_embd.weight": "v.positional_embedding_vlm",
        "v.patch_embd.weight": "v.patch_embedding.weight",
        "v.class_embd": "v.class_embedding",
        "v.pre_ln.weight": "v.layernorm_pre.weight",
        "v.post_ln.weight": "v.layernorm_post.weight",
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",
        "v.blk.0.attn_out.weight": "v.blk.0.attn_output.weight",
        "v.blk.0.ln1.weight": "v.blk.0.attn_norm.weight",
        "v.blk.0.ln2.weight": "v.blk.0.ffn_norm.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.fc1.weight",
        "v.blk.0.ffn_down.weight": "v.blk.0.mlp.fc2.weight",
        "mm.model.mlp.1.weight": "v.vision_adapter.mlp.fc1.weight",
        "mm.model.mlp.2.weight": "v.vision_adapter.mlp.fc2.weight",
        "mm.model.fc.weight": "mm.linear_1.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    ts += [(old, f16(4, 16, seed=i)) for i, old in enumerate(renames.values())]
    src = write_gguf(tmp_path / "llama4-vision.gguf", "llama4", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "llama4"
    assert kv["clip.vision.projector_type"] == "llama4"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 16
    assert kv["clip.vision.feed_forward_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.image_size"] == 28 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.projector.scale_factor"] == 2  # 1 / pixel_shuffle_ratio
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    assert sorted(got) == sorted(renames)
    check_renamed(got, source, renames)


def gemma4_multimodal(tmp_path: Path) -> Path:
    """gemma4 with its vision and audio encoders inline (Ollama's layout)."""
    kvs: list[KV] = [
        ("gemma4.block_count", 1, V.UINT32),
        ("gemma4.embedding_length", 64, V.UINT32),
        ("gemma4.vision.block_count", 1, V.UINT32),
        ("gemma4.vision.embedding_length", 16, V.UINT32),
        ("gemma4.vision.feed_forward_length", 32, V.UINT32),
        ("gemma4.vision.attention.head_count", 2, V.UINT32),
        ("gemma4.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("gemma4.vision.patch_size", 16, V.UINT32),
        ("gemma4.audio.block_count", 2, V.UINT32),
        ("gemma4.audio.embedding_length", 24, V.UINT32),
        ("gemma4.audio.feed_forward_length", 48, V.UINT32),
        ("gemma4.audio.attention.head_count", 4, V.UINT32),
        ("gemma4.audio.attention.layer_norm_epsilon", 1e-5, V.FLOAT32),
        *tokenizer(16, model="llama"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("v.patch_embd.weight", f16(16, 3, 4, 4, seed=1)),
        ("v.blk.0.attn_q.weight", f16(16, 16, seed=2)),
        ("v.blk.0.ln1.weight", f32(16, seed=3)),
        ("mm.input_projection.weight", f16(64, 16, seed=4)),
        ("a.pre_encode.out.weight", f16(24, 32, seed=5)),
        ("mm.a.fc.weight", f16(24, 24, seed=6)),
        ("mm.a.fc.bias", f32(24, seed=7)),
        ("mm.a.input_projection.weight", f16(64, 24, seed=8)),
        ("model.vision_tower.extra.weight", f32(4, seed=9)),
    ]
    for b in range(2):
        for i, leaf in enumerate(("ln1", "ln2", "layer_pre_norm", "linear_pos", "attn_q")):
            ts.append((f"a.blk.{b}.{leaf}.weight", f32(24, seed=10 + 10 * b + i)))
    return write_gguf(tmp_path / "gemma4-mm.gguf", "gemma4", kvs, ts)


def test_gemma4_mmproj_view(tmp_path: Path) -> None:
    src = gemma4_multimodal(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None and views.mmproj.handler == "handle_gemma4_clip"
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.vision.projector_type"] == "gemma4v"
    assert kv["clip.audio.projector_type"] == "gemma4a"
    assert "clip.projector_type" not in kv
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 16
    assert kv["clip.vision.feed_forward_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.patch_size"] == 16
    assert kv["clip.vision.image_size"] == 224
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_mean"] == [0.0] * 3 and kv["clip.vision.image_std"] == [1.0] * 3
    assert kv["clip.has_vision_encoder"] is True
    assert kv["clip.audio.block_count"] == 2 and kv["clip.audio.embedding_length"] == 24
    assert kv["clip.audio.feed_forward_length"] == 48
    assert kv["clip.audio.attention.head_count"] == 4
    assert kv["clip.audio.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.audio.num_mel_bins"] == 128
    assert kv["clip.audio.projection_dim"] == 64
    assert kv["clip.has_audio_encoder"] is True
    got = tensors(reader)
    patch = got["v.patch_embd.weight"]
    assert np.array_equal(as_f32(patch), np.asarray(source["v.patch_embd.weight"].data, np.float32))
    renames = {
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",
        "v.blk.0.ln1.weight": "v.blk.0.ln1.weight",  # vision blocks keep ln1/ln2
        "mm.input_projection.weight": "mm.input_projection.weight",
        "a.input_projection.weight": "a.pre_encode.out.weight",
        "a.pre_encode.out.weight": "mm.a.fc.weight",
        "a.pre_encode.out.bias": "mm.a.fc.bias",
        "mm.a.input_projection.weight": "mm.a.input_projection.weight",
    }
    for b in range(2):
        renames |= {
            f"a.blk.{b}.attn_pre_norm.weight": f"a.blk.{b}.ln1.weight",
            f"a.blk.{b}.attn_post_norm.weight": f"a.blk.{b}.ln2.weight",
            f"a.blk.{b}.ln2.weight": f"a.blk.{b}.layer_pre_norm.weight",
            f"a.blk.{b}.attn_k_rel.weight": f"a.blk.{b}.linear_pos.weight",
            f"a.blk.{b}.attn_q.weight": f"a.blk.{b}.attn_q.weight",
        }
    check_renamed(got, source, renames)
    assert sorted(got) == sorted([*renames, "v.patch_embd.weight"])  # no text, no extras


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def check_patch_pair(got: dict[str, Any], source: dict[str, Any]) -> None:
    """v.patch_embd_0/_1 (one per frame, F16) -> v.patch_embd.weight and .weight.1 in F32."""
    for name, old in (("v.patch_embd.weight", "_0"), ("v.patch_embd.weight.1", "_1")):
        src = source[f"v.patch_embd{old}.weight"]
        assert list(got[name].shape) == list(src.shape)
        assert np.array_equal(as_f32(got[name]), np.asarray(src.data, np.float32))


def test_qwen25vl_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("qwen25vl.block_count", 1, V.UINT32),
        ("qwen25vl.embedding_length", 64, V.UINT32),
        ("qwen25vl.rope.mrope_section", [16, 24, 24], V.ARRAY, V.INT32),
        ("qwen25vl.vision.block_count", 1, V.UINT32),
        ("qwen25vl.vision.embedding_length", 8, V.UINT32),
        ("qwen25vl.vision.attention.head_count", 2, V.UINT32),
        ("qwen25vl.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("qwen25vl.vision.num_channels", 3, V.UINT32),
        ("qwen25vl.vision.patch_size", 2, V.UINT32),
        ("qwen25vl.vision.spatial_merge_size", 2, V.UINT32),
        ("qwen25vl.vision.window_size", 112, V.UINT32),
        ("qwen25vl.vision.fullatt_block_indexes", [7, 15, 23, 31], V.ARRAY, V.INT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.post_ln.weight": "v.merger.ln_q.weight",
        "mm.0.weight": "v.merger.mlp.0.weight",
        "mm.0.bias": "v.merger.mlp.0.bias",
        "mm.2.weight": "v.merger.mlp.2.weight",
        "mm.2.bias": "v.merger.mlp.2.bias",
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",  # the tower's names already fit
        "v.blk.0.ffn_up.weight": "v.blk.0.ffn_up.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    ts += [(old, f32(4, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts[-1] = ("v.blk.0.ffn_up.weight", f16(24, 8, seed=30))  # ggml [8, n_ff=24]
    ts += [
        ("v.patch_embd_0.weight", f16(8, 3, 2, 2, seed=31)),
        ("v.patch_embd_1.weight", f16(8, 3, 2, 2, seed=32)),
    ]
    src = write_gguf(tmp_path / "qwen25vl-vision.gguf", "qwen25vl", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_qwen25vl_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen2.5vl_merger"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.num_channels"] == 3 and kv["clip.vision.patch_size"] == 2
    assert kv["clip.vision.spatial_merge_size"] == 2 and kv["clip.vision.window_size"] == 112
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.feed_forward_length"] == 24  # from ffn_up's shape
    assert kv["clip.vision.n_wa_pattern"] == 8  # fullatt_block_indexes[0] + 1
    assert kv["clip.vision.image_size"] == 560
    assert kv["clip.vision.image_mean"] == pytest.approx(CLIP_MEAN)
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    check_renamed(got, source, renames)
    check_patch_pair(got, source)
    assert sorted(got) == sorted([*renames, "v.patch_embd.weight", "v.patch_embd.weight.1"])


def qwen3vl_vision(tmp_path: Path, arch: str) -> Path:
    """qwen3vl(moe) with its vision tower inline: q and k F16 beside a Q8_0 v, a packed
    two-frame patch embedding, one deepstack adapter, the merger under v.merger.*."""
    kvs: list[KV] = [
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.embedding_length", 64, V.UINT32),
        (f"{arch}.vision.block_count", 2, V.UINT32),
        (f"{arch}.vision.embedding_length", 32, V.UINT32),
        (f"{arch}.vision.attention.head_count", 2, V.UINT32),
        (f"{arch}.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        (f"{arch}.vision.patch_size", 2, V.UINT32),
        (f"{arch}.vision.spatial_merge_size", 2, V.UINT32),
        (f"{arch}.vision.num_channels", 3, V.UINT32),
        (f"{arch}.vision.deepstack_visual_indexes", [1], V.ARRAY, V.INT32),
        (f"{arch}.vision.image_mean", [0.1, 0.2, 0.3], V.ARRAY, V.FLOAT32),
        (f"{arch}.vision.shortest_edge", 1024, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    for b in range(2):
        ts += [
            (f"v.blk.{b}.attn_q.weight", f16(32, 32, seed=10 * b)),
            (f"v.blk.{b}.attn_k.weight", f16(32, 32, seed=10 * b + 1)),
            (f"v.blk.{b}.attn_v.weight", f32(32, 32, seed=10 * b + 2), "Q8_0"),
        ]
        ts += [
            (f"v.blk.{b}.attn_{x}.bias", f32(32, seed=30 + 10 * b + i)) for i, x in enumerate("qkv")
        ]
        ts += [
            (f"v.blk.{b}.attn_out.weight", f16(32, 32, seed=60 + b)),
            (f"v.blk.{b}.norm1.weight", f32(32, seed=62 + b)),
            (f"v.blk.{b}.norm2.weight", f32(32, seed=64 + b)),
            (f"v.blk.{b}.mlp.linear_fc1.weight", f16(64, 32, seed=66 + b)),  # ggml [32, 64]
            (f"v.blk.{b}.mlp.linear_fc2.weight", f16(32, 64, seed=68 + b)),
        ]
    ts += [
        # numpy [c_out*c_in, frames, h, w] = ggml [w, h, frames, packed]
        ("v.patch_embed.weight", f16(32 * 3, 2, 2, 2, seed=70)),
        ("v.patch_embed.bias", f32(32, seed=71)),
        ("v.pos_embed.weight", f16(16, 32, seed=72)),  # 16 positions: a 4 x 4 grid
        ("v.merger.norm.weight", f32(32, seed=73)),
        ("v.merger.norm.bias", f32(32, seed=74)),
        ("v.merger.linear_fc1.weight", f16(128, 128, seed=75)),
        ("v.merger.linear_fc1.bias", f32(128, seed=76)),
        ("v.merger.linear_fc2.weight", f16(64, 128, seed=77)),
        ("v.merger.linear_fc2.bias", f32(64, seed=78)),
    ]
    for i, leaf in enumerate(("norm", "linear_fc1", "linear_fc2")):
        ts.append((f"v.deepstack_merger.0.{leaf}.weight", f16(8, 8, seed=80 + i)))
        ts.append((f"v.deepstack_merger.0.{leaf}.bias", f32(8, seed=85 + i)))
    return write_gguf(tmp_path / f"{arch}-vision.gguf", arch, kvs, ts)


def dequantized(t: Any) -> np.ndarray:
    """A source tensor's values as F32 (the reference dequantizer for quantized types)."""
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data, np.float32).reshape(-1)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)


@pytest.mark.parametrize("arch", ["qwen3vl", "qwen3vlmoe"])
def test_qwen3vl_mmproj_view(tmp_path: Path, arch: str) -> None:
    src = qwen3vl_vision(tmp_path, arch)
    assert views_of(src).mmproj.handler == "handle_qwen3vl_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen3vl_merger"
    assert kv["clip.vision.block_count"] == 2 and kv["clip.vision.embedding_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.patch_size"] == 2 and kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.temporal_patch_size"] == 2
    assert kv["clip.vision.rope.freq_base"] == pytest.approx(10_000.0)
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.feed_forward_length"] == 64  # from mlp.linear_fc1's shape
    assert kv["clip.vision.image_size"] == 8  # sqrt(16 positions) * patch 2
    assert kv["clip.vision.image_mean"] == pytest.approx([0.1, 0.2, 0.3])  # the file's
    assert kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.vision.image_min_pixels"] == 1024
    assert kv["clip.vision.image_max_pixels"] == 16777216
    assert kv["clip.vision.is_deepstack_layers"] == [False, True]
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    for b in range(2):
        # q, k (F16) and v (Q8_0) each made F32, then one after another: [32, 96] F32.
        w, bias = got[f"v.blk.{b}.attn_qkv.weight"], got[f"v.blk.{b}.attn_qkv.bias"]
        assert list(w.shape) == [32, 96] and list(bias.shape) == [96]
        want = np.concatenate([dequantized(source[f"v.blk.{b}.attn_{x}.weight"]) for x in "qkv"])
        assert np.array_equal(as_f32(w).reshape(-1), want)
        want = np.concatenate([dequantized(source[f"v.blk.{b}.attn_{x}.bias"]) for x in "qkv"])
        assert np.array_equal(as_f32(bias), want)
        for x in "qkv":
            assert f"v.blk.{b}.attn_{x}.weight" not in got  # merged: no orphans
    renames = {
        "v.blk.1.ln1.weight": "v.blk.1.norm1.weight",
        "v.blk.0.ln2.weight": "v.blk.0.norm2.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.linear_fc1.weight",
        "v.blk.1.ffn_down.weight": "v.blk.1.mlp.linear_fc2.weight",
        "v.blk.1.attn_out.weight": "v.blk.1.attn_out.weight",
        "v.post_ln.weight": "v.merger.norm.weight",
        "v.post_ln.bias": "v.merger.norm.bias",
        "mm.0.weight": "v.merger.linear_fc1.weight",
        "mm.0.bias": "v.merger.linear_fc1.bias",
        "mm.2.weight": "v.merger.linear_fc2.weight",
        "mm.2.bias": "v.merger.linear_fc2.bias",
        "v.patch_embd.bias": "v.patch_embed.bias",
    }
    for leaf_from, leaf_to in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        for suffix in ("weight", "bias"):
            # The adapter of deepstack_visual_indexes[0] = 1, by its clip layer.
            renames[f"v.deepstack.1.{leaf_to}.{suffix}"] = (
                f"v.deepstack_merger.0.{leaf_from}.{suffix}"
            )
    check_renamed(got, source, renames)
    packed = np.asarray(source["v.patch_embed.weight"].data).reshape(96, 2, 2, 2)
    for name, frame in (("v.patch_embd.weight", 0), ("v.patch_embd.weight.1", 1)):
        assert list(got[name].shape) == [2, 2, 3, 32]
        want = packed[:, frame].astype(np.float32).reshape(32, 3, 2, 2)
        assert np.array_equal(as_f32(got[name]).reshape(32, 3, 2, 2), want)
    pos = got["v.position_embd.weight"]
    assert np.array_equal(as_f32(pos), np.asarray(source["v.pos_embed.weight"].data, np.float32))
    assert not any(n.startswith(("token_embd", "blk.", "v.deepstack_merger")) for n in got)
    # Per block 7; two patch slices, patch bias, position, post_ln x2, mm.* x4, deepstack 6.
    assert len(got) == 2 * 7 + 10 + 6


def test_glmocr_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("glmocr.block_count", 1, V.UINT32),
        ("glmocr.vision.block_count", 1, V.UINT32),
        ("glmocr.vision.embedding_length", 8, V.UINT32),
        ("glmocr.vision.intermediate_size", 24, V.UINT32),
        ("glmocr.vision.attention.head_count", 2, V.UINT32),
        ("glmocr.vision.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("glmocr.vision.image_size", 336, V.UINT32),
        ("glmocr.vision.patch_size", 14, V.UINT32),
        ("glmocr.vision.spatial_merge_size", 2, V.UINT32),
        ("glmocr.vision.out_hidden_size", 64, V.UINT32),
        ("glmocr.vision.image_mean", CLIP_MEAN, V.ARRAY, V.FLOAT32),
        ("glmocr.vision.image_std", CLIP_STD, V.ARRAY, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    names = (
        "v.blk.0.attn_qkv.weight",
        "v.blk.0.attn_out.weight",
        "v.blk.0.ln1.weight",
        "v.blk.0.ffn_gate.weight",
        "v.post_ln.weight",
        "mm.model.fc.weight",
        "mm.up.weight",
        "mm.patch_merger.weight",
    )
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("blk.0.ffn_gate.weight", f32(8, 8)),
    ]
    ts += [(n, f16(8, 8, seed=i)) for i, n in enumerate(names)]
    ts += [
        ("v.patch_embd_0.weight", f16(8, 3, 2, 2, seed=20)),
        ("v.patch_embd_1.weight", f16(8, 3, 2, 2, seed=21)),
    ]
    src = write_gguf(tmp_path / "glmocr-vision.gguf", "glmocr", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_glmocr_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "glm4v"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.feed_forward_length"] == 24
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.image_size"] == 336 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_mean"] == pytest.approx(CLIP_MEAN)
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    check_renamed(got, source, {n: n for n in names})  # already llama.cpp's names
    check_patch_pair(got, source)
    assert sorted(got) == sorted([*names, "v.patch_embd.weight", "v.patch_embd.weight.1"])


def test_deepseekocr_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("deepseekocr.block_count", 1, V.UINT32),
        ("deepseekocr.vision.block_count", 1, V.UINT32),
        ("deepseekocr.vision.embedding_length", 8, V.UINT32),
        ("deepseekocr.vision.head_count", 2, V.UINT32),
        ("deepseekocr.vision.image_size", 224, V.UINT32),
        ("deepseekocr.vision.patch_size", 14, V.UINT32),
        ("deepseekocr.sam.block_count", 1, V.UINT32),
        ("deepseekocr.sam.embedding_length", 16, V.UINT32),
        ("deepseekocr.sam.head_count", 4, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.sam.blk.0.attn.qkv.weight": "s.blk.0.attn.qkv.weight",
        "v.sam.blk.0.attn.out.weight": "s.blk.0.attn.proj.weight",
        "v.sam.blk.0.attn.pos_h.weight": "s.blk.0.attn.rel_pos_h",
        "v.sam.blk.0.attn.pos_w.weight": "s.blk.0.attn.rel_pos_w",
        "v.sam.blk.0.pre_ln.weight": "s.blk.0.norm1.weight",
        "v.sam.blk.0.post_ln.weight": "s.blk.0.norm2.weight",
        "v.sam.pos_embd.weight": "s.position_embd",
        "v.blk.0.attn_qkv.weight": "v.blk.0.self_attn.qkv_proj.weight",
        "v.blk.0.attn_out.weight": "v.blk.0.self_attn.out_proj.weight",
        "v.blk.0.ln1.weight": "v.blk.0.layer_norm1.weight",
        "v.blk.0.ln2.weight": "v.blk.0.layer_norm2.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.fc1.weight",
        "v.blk.0.ffn_down.weight": "v.blk.0.mlp.fc2.weight",
        "v.pre_ln.weight": "v.pre_layrnorm.weight",
        "mm.model.fc.weight": "mm.layers.weight",
        "v.image_newline": "mm.image_newline",
        "v.view_seperator": "mm.view_seperator",
    }
    promoted = {
        "v.patch_embd.weight": "v.patch_embd.weight",
        "v.sam.patch_embd.weight": "s.patch_embd.weight",
        "v.position_embd.weight": "v.position_embd.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("blk.0.attn_q.weight", f32(8, 8))]
    ts += [(old, f16(8, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts += [(old, f16(8, 3, 2, 2, seed=40 + i)) for i, old in enumerate(promoted.values())]
    src = write_gguf(tmp_path / "deepseekocr-vision.gguf", "deepseekocr", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "deepseekocr"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.image_size"] == 224 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.sam.block_count"] == 1
    assert kv["clip.vision.sam.embedding_length"] == 16
    assert kv["clip.vision.sam.head_count"] == 4
    # Defaults of the reference mmproj.
    assert kv["clip.vision.feed_forward_length"] == 64
    assert kv["clip.vision.projection_dim"] == 1280
    assert kv["clip.vision.projector.scale_factor"] == 1
    assert kv["clip.vision.window_size"] == 14
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.image_mean"] == [0.5] * 3 and kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    check_renamed(got, source, renames)
    for new, old in promoted.items():
        assert np.array_equal(as_f32(got[new]), np.asarray(source[old].data, np.float32))
    assert sorted(got) == sorted([*renames, *promoted])  # no text tensors


def resample_reference(grid: np.ndarray, side: int) -> np.ndarray:
    """Bilinear, corners aligned, weights as C floats: [side, side, E] from [n, n, E]."""
    n = grid.shape[0]
    out = np.zeros((side, side, grid.shape[2]), np.float32)
    one = np.float32(1)
    for y in range(side):
        sy = y * (n - 1) / (side - 1)
        y0 = int(np.floor(sy))
        y1, wy = min(y0 + 1, n - 1), np.float32(sy - y0)
        for x in range(side):
            sx = x * (n - 1) / (side - 1)
            x0 = int(np.floor(sx))
            x1, wx = min(x0 + 1, n - 1), np.float32(sx - x0)
            top = grid[y0, x0] * (one - wx) + grid[y0, x1] * wx
            bottom = grid[y1, x0] * (one - wx) + grid[y1, x1] * wx
            out[y, x] = top * (one - wy) + bottom * wy
    return out


def test_nemotron_h_omni_mmproj_view(tmp_path: Path) -> None:
    e = 8
    kvs: list[KV] = [
        ("nemotron_h_omni.block_count", 1, V.UINT32),
        ("nemotron_h_omni.embedding_length", 64, V.UINT32),
        ("nemotron_h_omni.vision.block_count", 1, V.UINT32),
        ("nemotron_h_omni.vision.embedding_length", e, V.UINT32),
        ("nemotron_h_omni.vision.patch_size", 2, V.UINT32),
        ("nemotron_h_omni.vision.image_size", 8, V.UINT32),  # a 4 x 4 grid of patches
        ("nemotron_h_omni.vision.num_channels", 3, V.UINT32),
        ("nemotron_h_omni.vision.image_mean", [0.1, 0.2, 0.3], V.ARRAY, V.FLOAT32),
        ("nemotron_h_omni.vision.image_token_id", 18, V.UINT32),
        ("nemotron_h_omni.audio.block_count", 1, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "mm.model.mlp.0.weight": "mm.norm.weight",
        "mm.model.mlp.1.weight": "mm.1.weight",
        "mm.model.mlp.3.weight": "mm.2.weight",
        "v.blk.0.attn_qkv.weight": "v.blk.0.attn_qkv.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("blk.0.attn_q.weight", f32(8, 8))]
    ts += [(old, f16(8, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts += [
        ("v.cls_embd", f16(e, seed=10)),
        ("v.position_embd", f16(9, e, seed=11)),  # ggml [E, 9]: a 3 x 3 grid, no .weight
        ("v.patch_embd.weight", f16(e, 2 * 2 * 3, seed=12)),  # flat ggml [12, E]
        ("a.blk.0.attn_q.weight", f16(8, 8, seed=13)),
        ("mm.a.fc.weight", f16(8, 8, seed=14)),
    ]
    src = write_gguf(tmp_path / "omni-vision.gguf", "nemotron_h_omni", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_nemotron_h_omni_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.vision.projector_type"] == "nemotron_v2_vl"
    assert "clip.projector_type" not in kv
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == e
    assert kv["clip.vision.patch_size"] == 2 and kv["clip.vision.image_size"] == 8
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_token_id"] == 18
    assert kv["clip.vision.image_mean"] == pytest.approx([0.1, 0.2, 0.3])  # the file's
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    # Defaults for what the file lacks.
    assert kv["clip.vision.feed_forward_length"] == 4 * e
    assert kv["clip.vision.attention.head_count"] == 16
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.projector.scale_factor"] == 2
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    assert kv["clip.has_audio_encoder"] is False  # audio stays off
    got = tensors(reader)
    check_renamed(got, source, renames)
    cls = got["v.class_embd"]
    assert np.array_equal(as_f32(cls), np.asarray(source["v.cls_embd"].data, np.float32))
    # The 3 x 3 position grid resampled to the 4 x 4 the image size makes, as F32 [E, 16].
    pos = got["v.position_embd.weight"]
    assert list(pos.shape) == [e, 16]
    grid = np.asarray(source["v.position_embd"].data, np.float32).reshape(3, 3, e)
    resampled = as_f32(pos).reshape(4, 4, e)
    np.testing.assert_allclose(resampled, resample_reference(grid, 4), rtol=1e-6, atol=1e-7)
    for y, x in ((0, 0), (0, 3), (3, 0), (3, 3)):  # corners aligned: taken as they are
        assert np.array_equal(resampled[y, x], grid[y // 3 * 2, x // 3 * 2])
    # The flat patch kernel as the conv weight [2, 2, 3, E] in F32, elements in place.
    patch = got["v.patch_embd.weight"]
    assert list(patch.shape) == [2, 2, 3, e]
    want = np.asarray(source["v.patch_embd.weight"].data, np.float32).reshape(-1)
    assert np.array_equal(as_f32(patch).reshape(-1), want)
    # Text, audio and the audio projector are not in the view.
    assert sorted(got) == sorted(
        [*renames, "v.class_embd", "v.position_embd.weight", "v.patch_embd.weight"]
    )


# -- further text handlers ----------------------------------------------------------------


def text_view(
    tmp_path: Path, arch: str, kvs: Sequence[KV], ts: Sequence[Tensor]
) -> tuple[CompatViews, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(views, the model view's KVs, its tensors, the source's tensors)."""
    src = write_gguf(tmp_path / f"{arch}.gguf", arch, kvs, ts)
    views = views_of(src)
    reader = gguf.GGUFReader(materialize(views.model, tmp_path))
    check_aligned(reader)
    return views, fields(reader), tensors(reader), tensors(gguf.GGUFReader(src))


def test_embeddinggemma_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("gemma3.block_count", 1, V.UINT32),
        ("gemma3.embedding_length", 32, V.UINT32),
        ("gemma3.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
        ("gemma3.attention.causal", False, V.BOOL),
        ("gemma3.attention.sliding_window_pattern", [True, False], V.ARRAY, V.BOOL),
        *tokenizer(16),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 32), "Q8_0"),
        ("norm.weight", f32(32, seed=1)),
        ("dense.0.weight", f32(96, 32, seed=2)),  # ggml [n_embd, 96]
        ("dense.1.weight", f32(32, 96, seed=3)),  # ggml [96, n_embd]
    ]
    views, kv, got, source = text_view(tmp_path, "gemma3", kvs, ts)
    assert views.model.handler == "handle_embeddinggemma"  # and not handle_gemma3 after it
    assert views.mmproj is None
    assert kv["general.architecture"] == "gemma-embedding"
    assert kv["gemma-embedding.block_count"] == 1 and kv["gemma3.block_count"] == 1
    assert kv["gemma-embedding.embedding_length"] == 32
    assert "gemma-embedding.attention.causal" not in kv
    assert "gemma-embedding.attention.sliding_window_pattern" not in kv
    assert kv["gemma-embedding.rope.freq_base_swa"] == pytest.approx(10000.0)
    assert kv["gemma-embedding.dense_2_feat_in"] == 32
    assert kv["gemma-embedding.dense_2_feat_out"] == 96
    assert kv["gemma-embedding.dense_3_feat_in"] == 96
    assert kv["gemma-embedding.dense_3_feat_out"] == 32
    assert "tokenizer.chat_template" not in kv  # gemma3's rule did not run
    check_renamed(
        got,
        source,
        {
            "token_embd.weight": "token_embd.weight",
            "output_norm.weight": "norm.weight",
            "dense_2.weight": "dense.0.weight",
            "dense_3.weight": "dense.1.weight",
        },
    )


def test_gemma3n_view(tmp_path: Path) -> None:
    words = ["<pad>", "<eos>", "<0x41>", "<unused0>", "hello", *[f"t{i}" for i in range(15)]]
    kvs: list[KV] = [
        ("gemma3n.block_count", 1, V.UINT32),
        ("tokenizer.ggml.model", "gemma3n", V.STRING),
        ("tokenizer.ggml.tokens", words, V.ARRAY, V.STRING),
        ("tokenizer.ggml.scores", [float(-i) for i in range(20)], V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", [3, 3, 1, 5, 1, *[1] * 15], V.ARRAY, V.INT32),
        ("tokenizer.ggml.eos_token_ids", [1], V.ARRAY, V.INT32),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (20, 64), "Q8_0"),  # 4 multimodal rows past the text vocab
        ("per_layer_token_embd.weight", (16, 32), "Q8_0"),
        ("v.blk.0.attn_q.weight", f16(8, 8)),
    ]
    views, kv, got, source = text_view(tmp_path, "gemma3n", kvs, ts)
    assert views.model.handler == "handle_gemma3n"
    assert kv["tokenizer.ggml.model"] == "llama"
    assert kv["tokenizer.ggml.tokens"] == words[:16]
    assert kv["tokenizer.ggml.scores"] == [float(-i) for i in range(16)]
    # <0xNN> tokens become BYTE (6), <unused*> NORMAL (1); the rest as they were.
    assert kv["tokenizer.ggml.token_type"] == [3, 3, 6, 1, 1, *[1] * 11]
    assert kv["tokenizer.ggml.eos_token_ids"] == [1, 106]
    emb = got["token_embd.weight"]
    assert list(emb.shape) == [64, 16]
    assert raw(emb) == raw(source["token_embd.weight"])[: len(raw(emb))]  # first 16 rows
    # Upstream hides nothing here: embedded encoder tensors stay visible.
    assert "v.blk.0.attn_q.weight" in got


def test_gemma3n_without_eos_ids_gets_the_defaults(tmp_path: Path) -> None:
    kvs: list[KV] = [("gemma3n.block_count", 1, V.UINT32), *tokenizer(20)]
    ts: list[Tensor] = [
        ("token_embd.weight", (20, 32), "Q8_0"),
        ("per_layer_token_embd.weight", (16, 32), "Q8_0"),
    ]
    _, kv, _, _ = text_view(tmp_path, "gemma3n", kvs, ts)
    assert kv["tokenizer.ggml.eos_token_ids"] == [1, 106]


def test_snowflake_arctic_embed2_view(tmp_path: Path) -> None:
    import base64

    charsmap = bytes(range(256)) * 20 + b"tail"  # 5124 bytes: more than a header keeps
    encoded = base64.b64encode(charsmap).decode()
    kvs: list[KV] = [
        ("bert.block_count", 1, V.UINT32),
        ("tokenizer.ggml.model", "t5", V.STRING),
        ("tokenizer.ggml.precompiled_charsmap", list(encoded), V.ARRAY, V.STRING),
    ]
    views, kv, _, _ = text_view(tmp_path, "bert", kvs, [("token_embd.weight", f32(8, 32))])
    assert views.model.handler == "handle_snowflake_arctic_embed2"
    assert bytes(kv["tokenizer.ggml.precompiled_charsmap"]) == charsmap
    reader = gguf.GGUFReader(tmp_path / "model-view.gguf")
    assert field_type(reader, "tokenizer.ggml.precompiled_charsmap") == [V.ARRAY, V.UINT8]
    # A bert whose charsmap is already bytes (llama.cpp's converter) needs no view.
    kvs[2] = ("tokenizer.ggml.precompiled_charsmap", list(charsmap), V.ARRAY, V.UINT8)
    ok = write_gguf(tmp_path / "b2.gguf", "bert", kvs, [("token_embd.weight", f32(8, 32))])
    assert compat_views(ok, HEX) is None


def test_qwen3next_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("qwen3next.block_count", 2, V.UINT32),
        ("qwen3next.attention.head_count_kv", [0, 2], V.ARRAY, V.UINT32),
    ]
    ts: list[Tensor] = [("blk.0.ssm_dt", f32(4, seed=1)), ("blk.1.attn_q.weight", f32(8, 8))]
    views, kv, got, source = text_view(tmp_path, "qwen3next", kvs, ts)
    assert views.model.handler == "handle_qwen3next"
    assert kv["qwen3next.attention.head_count_kv"] == 2
    check_renamed(got, source, {"blk.0.ssm_dt.bias": "blk.0.ssm_dt"})


def test_laguna_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("laguna.block_count", 2, V.UINT32),
        ("laguna.rope.swa.dimension_count", 64, V.UINT32),
        ("laguna.rope.swa.freq_base", 10000.0, V.FLOAT32),
    ]
    ts: list[Tensor] = [("blk.0.attn_g.weight", f32(8, 8)), ("blk.1.attn_g.weight", f32(8, 8))]
    views, kv, got, source = text_view(tmp_path, "laguna", kvs, ts)
    assert views.model.handler == "handle_laguna"
    assert kv["laguna.rope.dimension_count_swa"] == 64
    assert kv["laguna.rope.freq_base_swa"] == pytest.approx(10000.0)
    check_renamed(
        got,
        source,
        {f"blk.{b}.attn_gate.weight": f"blk.{b}.attn_g.weight" for b in range(2)},
    )


def test_lfm2_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("lfm2.block_count", 1, V.UINT32),
        ("lfm2.feed_forward_length", 12288, V.UINT32),
        *tokenizer(8, model="gpt2"),
    ]
    ts: list[Tensor] = [("output_norm.weight", f32(32)), ("blk.0.ffn_gate.weight", f32(48, 32))]
    views, kv, got, source = text_view(tmp_path, "lfm2", kvs, ts)
    assert views.model.handler == "handle_lfm2"
    assert kv["tokenizer.ggml.pre"] == "lfm2"
    assert kv["lfm2.feed_forward_length"] == 48  # from ffn_gate's shape
    check_renamed(got, source, {"token_embd_norm.weight": "output_norm.weight"})


def test_olmo3_view(tmp_path: Path) -> None:
    kvs: list[KV] = [("olmo3.block_count", 1, V.UINT32), ("olmo3.context_length", 65536, V.UINT32)]
    views, kv, _, _ = text_view(tmp_path, "olmo3", kvs, [("token_embd.weight", f32(8, 32))])
    assert views.model.handler == "handle_olmo3"
    assert kv["general.architecture"] == "olmo2"
    assert kv["olmo2.block_count"] == 1 and kv["olmo2.context_length"] == 65536


def test_qwen25vl_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("qwen25vl.block_count", 1, V.UINT32),
        ("qwen25vl.rope.mrope_section", [16, 24, 24], V.ARRAY, V.INT32),
    ]
    ts: list[Tensor] = [("token_embd.weight", f32(8, 32)), ("v.blk.0.attn_q.weight", f16(8, 8))]
    views, kv, got, _ = text_view(tmp_path, "qwen25vl", kvs, ts)
    assert views.model.handler == "handle_qwen25vl"
    assert views.mmproj is not None and views.mmproj.handler == "handle_qwen25vl_clip"
    assert kv["general.architecture"] == "qwen2vl"
    assert kv["qwen2vl.block_count"] == 1
    assert kv["qwen2vl.rope.dimension_sections"] == [16, 24, 24, 0]
    assert list(got) == ["token_embd.weight"]


@pytest.mark.parametrize("arch", ["qwen3vl", "qwen3vlmoe"])
def test_qwen3vl_view(tmp_path: Path, arch: str) -> None:
    kvs: list[KV] = [
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.vision.deepstack_visual_indexes", [5, 11, 17], V.ARRAY, V.UINT32),
    ]
    ts: list[Tensor] = [("token_embd.weight", f32(8, 32)), ("mm.0.weight", f16(8, 8))]
    views, kv, got, _ = text_view(tmp_path, arch, kvs, ts)
    assert views.model.handler == "handle_qwen3vl"
    assert kv[f"{arch}.rope.dimension_sections"] == [24, 20, 20, 0]
    assert kv[f"{arch}.n_deepstack_layers"] == 3
    assert list(got) == ["token_embd.weight"]
    # With the sections present (llama.cpp's converter) no view is needed.
    kvs.append((f"{arch}.rope.dimension_sections", [24, 20, 20, 0], V.ARRAY, V.INT32))
    ok = write_gguf(tmp_path / "ok.gguf", arch, kvs, ts[:1])
    assert compat_views(ok, HEX) is None


def test_glm4moelite_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("glm4moelite.block_count", 1, V.UINT32),
        ("glm4moelite.attention.head_count_kv", 20, V.UINT32),
        ("glm4moelite.attention.key_length", 256, V.UINT32),
        ("glm4moelite.attention.value_length", 256, V.UINT32),
        ("glm4moelite.attention.kv_lora_rank", 512, V.UINT32),
        ("glm4moelite.rope.dimension_count", 64, V.UINT32),
        *tokenizer(8, model="gpt2"),
        ("tokenizer.ggml.eos_token_ids", [3, 5, 7], V.ARRAY, V.INT32),
    ]
    views, kv, _, _ = text_view(tmp_path, "glm4moelite", kvs, [("token_embd.weight", f32(8, 32))])
    assert views.model.handler == "handle_glm4moelite"
    assert kv["general.architecture"] == "deepseek2"
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length"] == 576  # kv_lora_rank + rope dims
    assert kv["deepseek2.attention.value_length"] == 512
    assert kv["deepseek2.attention.key_length_mla"] == 256
    assert kv["deepseek2.attention.value_length_mla"] == 256
    assert kv["deepseek2.expert_group_count"] == 1
    assert kv["deepseek2.expert_group_used_count"] == 1
    assert kv["tokenizer.ggml.pre"] == "glm4"
    assert kv["tokenizer.ggml.eot_token_id"] == 5 and kv["tokenizer.ggml.eom_token_id"] == 7


def test_deepseekocr_view(tmp_path: Path) -> None:
    kvs: list[KV] = [("deepseekocr.block_count", 2, V.UINT32)]
    ts: list[Tensor] = [
        ("blk.0.ffn_down.weight", f32(32, 64)),
        ("blk.1.ffn_down_exps.weight", f32(4, 32, 16)),  # ggml [n_ff_exp=16, n_embd, 4]
        ("blk.1.ffn_down_shexp.weight", f32(32, 32)),  # ggml [2 * 16, n_embd]
        ("s.blk.0.attn.qkv.weight", f16(8, 8)),
        ("v.blk.0.attn_q.weight", f16(8, 8)),
        ("mm.layers.weight", f16(8, 8)),
    ]
    views, kv, got, _ = text_view(tmp_path, "deepseekocr", kvs, ts)
    assert kv["general.architecture"] == "deepseek2-ocr"
    assert kv["deepseek2-ocr.block_count"] == 2
    assert kv["deepseek2-ocr.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["deepseek2-ocr.expert_feed_forward_length"] == 16
    assert kv["deepseek2-ocr.expert_shared_count"] == 2
    assert list(got) == [t[0] for t in ts[:3]]
    assert views.mmproj is not None and views.mmproj.handler == "handle_deepseekocr_clip"


def test_nemotron_h_omni_and_moe_views(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("nemotron_h_omni.block_count", 2, V.UINT32),
        ("nemotron_h_omni.expert_count", 8, V.UINT32),
        ("nemotron_h_omni.vision.block_count", 4, V.UINT32),
        ("nemotron_h_omni.audio.block_count", 4, V.UINT32),
    ]
    ts: list[Tensor] = [
        ("blk.1.ffn_latent_in.weight", f32(24, 64)),  # ggml [n_embd, latent=24]
        ("blk.1.ffn_latent_out.weight", f32(64, 24)),
        ("mtp.layers.0.mixer.experts.0.up_proj.weight", f32(8, 8)),
        ("v.blk.0.attn_q.weight", f16(8, 8)),
        ("a.blk.0.attn_q.weight", f16(8, 8)),
        ("mm.0.weight", f16(8, 8)),
    ]
    views, kv, got, source = text_view(tmp_path, "nemotron_h_omni", kvs, ts)
    assert views.model.handler.startswith("handle_nemotron_h_omni, handle_nemotron_h_moe")
    assert kv["general.architecture"] == "nemotron_h_moe"
    assert kv["nemotron_h_moe.block_count"] == 2 and kv["nemotron_h_moe.expert_count"] == 8
    assert "nemotron_h_moe.vision.block_count" not in kv
    assert "nemotron_h_moe.audio.block_count" not in kv
    assert kv["nemotron_h_moe.moe_latent_size"] == 24
    check_renamed(
        got,
        source,
        {
            "blk.1.ffn_latent_down.weight": "blk.1.ffn_latent_in.weight",
            "blk.1.ffn_latent_up.weight": "blk.1.ffn_latent_out.weight",
        },
    )
    assert len(got) == 2  # MTP, vision, audio and projector hidden
    # Without experts the text side is nemotron_h.
    kvs[1] = ("nemotron_h_omni.expert_count", 0, V.UINT32)
    _, kv, _, _ = text_view(tmp_path, "nemotron_h_omni", kvs, ts[3:])
    assert kv["general.architecture"] == "nemotron_h" and kv["nemotron_h.block_count"] == 2


def llama3_tokens() -> list[str]:
    """A Llama 3 sized vocabulary: the specials where Llama 3 has them."""
    words = [f"w{i}" for i in range(128256)]
    words[128000], words[128001] = "<|begin_of_text|>", "<|end_of_text|>"
    words[128006], words[128007] = "<|start_header_id|>", "<|end_header_id|>"
    words[128009] = "<|eot_id|>"
    return words


def test_llama3_metadata_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("llama.block_count", 1, V.UINT32),
        ("tokenizer.ggml.model", "gpt2", V.STRING),
        ("tokenizer.ggml.tokens", llama3_tokens(), V.ARRAY, V.STRING),
        ("tokenizer.ggml.eos_token_id", 128001, V.UINT32),
    ]
    src = write_gguf(tmp_path / "llama3.gguf", "llama", kvs, [("token_embd.weight", f32(8, 32))])
    views = views_of(src)
    assert views.model.handler == "handle_llama3_metadata"
    # Read back with our own header reader: gguf.GGUFReader takes seconds over 128k tokens.
    view = read_gguf_header_path(materialize(views.model, tmp_path))
    kv = view.kv
    assert kv["tokenizer.ggml.pre"] == "llama-bpe"
    assert kv["tokenizer.ggml.eos_token_id"] == 128009
    assert kv["tokenizer.ggml.eot_token_id"] == 128009
    assert kv["tokenizer.ggml.eos_token_ids"] == [128009]
    assert view.spans["tokenizer.ggml.eos_token_ids"].item_type == V.INT32
    # The vocabulary is served from the source as it was.
    assert kv["tokenizer.ggml.tokens"].length == 128256
    with open(tmp_path / "model-view.gguf", "rb") as f:
        assert read_array(f, view.spans["tokenizer.ggml.tokens"], 128006, 4) == [
            "<|start_header_id|>",
            "<|end_header_id|>",
            "w128008",
            "<|eot_id|>",
        ]
    # A Llama 3 file with the right metadata is left alone.
    kvs[3] = ("tokenizer.ggml.eos_token_id", 128009, V.UINT32)
    kvs.append(("tokenizer.ggml.pre", "llama-bpe", V.STRING))
    ok = write_gguf(tmp_path / "ok.gguf", "llama", kvs, [("token_embd.weight", f32(8, 32))])
    assert compat_views(ok, HEX) is None


def test_plain_llama_files_are_not_parsed_for_a_view(tmp_path: Path) -> None:
    """A llama GGUF whose vocabulary is too small to be Llama 3's is told from its first
    bytes (no full header read at mount time); a Llama 3 sized one is looked at."""
    from modelfs.store.compat import may_need_view, peek_token_count

    kvs: list[KV] = [
        ("llama.block_count", 1, V.UINT32),
        ("llama.rope.freq_factors", [1.0, 2.0], V.ARRAY, V.FLOAT32),
        *tokenizer(32000),
    ]
    small = write_gguf(tmp_path / "l2.gguf", "llama", kvs, [("token_embd.weight", f32(8, 32))])
    with open(small, "rb") as f:
        assert peek_token_count(f) == 32000
    assert not may_need_view(small)
    kvs[2:] = [("tokenizer.ggml.tokens", llama3_tokens(), V.ARRAY, V.STRING)]
    big = write_gguf(tmp_path / "l3.gguf", "llama", kvs, [("token_embd.weight", f32(8, 32))])
    assert may_need_view(big)


def test_glmocr_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("glmocr.block_count", 1, V.UINT32),
        ("glmocr.attention.key_length", 128, V.UINT32),
        ("glmocr.rope.mrope_section", [8, 12, 12], V.ARRAY, V.INT32),
        *tokenizer(8, model="gpt2"),
        ("tokenizer.ggml.pre", "llama-bpe", V.STRING),
    ]
    ts: list[Tensor] = [
        ("blk.0.attn_out.weight", f32(32, 32, seed=1)),
        ("blk.0.post_attn_norm.weight", f32(32, seed=2)),
        ("blk.0.post_ffn_norm.weight", f32(32, seed=3)),
        ("blk.0.ffn_gate.weight", (48, 32), "Q8_0"),
        ("blk.0.ffn_up.weight", (48, 32), "Q8_0"),
        ("v.blk.0.attn_qkv.weight", f16(8, 8)),
    ]
    views, kv, got, source = text_view(tmp_path, "glmocr", kvs, ts)
    assert views.model.handler == "handle_glmocr"
    assert kv["general.architecture"] == "glm4" and kv["glm4.block_count"] == 1
    assert kv["glm4.rope.dimension_sections"] == [8, 12, 12, 0]
    assert kv["glm4.rope.dimension_count"] == 128
    assert kv["tokenizer.ggml.pre"] == "chatglm-bpe"
    check_renamed(
        got,
        source,
        {
            "blk.0.attn_output.weight": "blk.0.attn_out.weight",
            "blk.0.post_attention_norm.weight": "blk.0.post_attn_norm.weight",
            "blk.0.post_ffw_norm.weight": "blk.0.post_ffn_norm.weight",
        },
    )
    # GLM4's fused FFN: ffn_up = [gate | up], twice as wide; the gate itself hidden.
    up = got["blk.0.ffn_up.weight"]
    assert list(up.shape) == [32, 96] and up.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert raw(up) == raw(source["blk.0.ffn_gate.weight"]) + raw(source["blk.0.ffn_up.weight"])
    assert "blk.0.ffn_gate.weight" not in got and not any(n.startswith("v.") for n in got)
    assert not views.model.computed


@pytest.mark.slow
def test_llama_cpp_reads_the_qwen25vl_view_it_refuses_raw(tmp_path: Path) -> None:
    """llama.cpp knows no architecture "qwen25vl"; the view's qwen2vl hyperparameters (M-RoPE
    sections padded to four) and vocabulary load (vocab-only)."""
    from modelfs.demo.vocab import bpe_vocab

    vocab = bpe_vocab(("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    hparams = {
        "context_length": 4096,
        "embedding_length": 64,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
    }
    kvs: list[KV] = [(f"qwen25vl.{k}", v, V.UINT32) for k, v in hparams.items()]
    kvs += [
        ("qwen25vl.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
        ("qwen25vl.rope.freq_base", 1e6, V.FLOAT32),
        ("qwen25vl.rope.mrope_section", [4, 6, 6], V.ARRAY, V.INT32),
        *bpe_tokenizer(vocab, "qwen2", eos=vocab.specials["<|im_end|>"]),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", f32(len(vocab.tokens), 64)),
        ("v.blk.0.attn_q.weight", f16(32, 32)),
        ("v.merger.mlp.0.weight", f16(64, 32)),
    ]
    src = write_gguf(tmp_path / "qwen25vl.gguf", "qwen25vl", kvs, ts)
    llm = llama_cpp_loads_only_the_view(src, tmp_path)
    assert llm.n_vocab() == len(vocab.tokens)
    assert llm.token_eos() == vocab.specials["<|im_end|>"]
    tokens = llm.tokenize(b" hello world", add_bos=False)
    assert llm.detokenize(tokens) == b" hello world"


def test_a_lazy_model_dir_counts_its_llama_cpp_dir_before_it_is_filled(tmp_path: Path) -> None:
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import DirNode, InodeTable
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    short = tree.root.children["gemma3"].children["tiny"]
    assert isinstance(short, DirNode) and "llama.cpp" in short.children
    lazy = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "gemma3", "tiny"):
        lazy = lazy.children[part]
    assert isinstance(lazy, DirNode) and not lazy.loaded
    before = lazy.nlink
    assert sorted(lazy.children) == sorted(short.children)
    assert lazy.nlink == before == short.nlink
    plain = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "plain", "tiny"):
        plain = plain.children[part]
    before = plain.nlink
    assert "llama.cpp" not in plain.children and plain.nlink == before


def test_a_later_mount_reads_no_header_until_llama_cpp_is_looked_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import modelfs.fsd.compat_dirs as fsd_compat_dirs
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import CompatNode, DirNode, InodeTable
    from modelfs.store.compat.decisions import Decisions
    from modelfs.store.names import parse_name
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    first = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    first_dir = first.root.children["gemma3"].children["tiny"].children["llama.cpp"]
    first_view = first_dir.children["model.gguf"]
    assert isinstance(first_view, CompatNode)
    decided = json.loads((tiny.layout.state / "compat-decisions.json").read_bytes())
    assert sorted(decided["decisions"].values()) == ["model+mmproj", "none"]  # gemma3, plain

    # The next mount: nothing reads a GGUF header while building, link counts included.
    made: list[Path] = []
    real_views, real_peek = fsd_compat_dirs.compat_views, fsd_compat_dirs.may_need_view

    def watched(path: Path, source_hex: str) -> object:
        made.append(path)
        return real_views(path, source_hex)

    def no_peek(path: Path) -> bool:
        raise AssertionError(f"peeked at {path}")

    monkeypatch.setattr(fsd_compat_dirs, "compat_views", watched)
    monkeypatch.setattr(fsd_compat_dirs, "may_need_view", no_peek)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    short = tree.root.children["gemma3"].children["tiny"]
    assert isinstance(short, DirNode) and short.nlink == 4  # .., .ollama/, llama.cpp/
    assert "llama.cpp" in short.children and "llama.cpp" not in (
        tree.root.children["plain"].children["tiny"].children
    )
    holder = short.children["llama.cpp"]
    assert isinstance(holder, DirNode) and not holder.loaded and made == []
    monkeypatch.setattr(fsd_compat_dirs, "may_need_view", real_peek)
    # Made ahead of first use (the mount does this in a thread once it is ready) ...
    assert tree.make_views() == 1 and len(made) == 1
    assert tree.make_views() == 0
    view = holder.children["model.gguf"]  # ... so the first use only places the nodes
    assert len(made) == 1 and isinstance(view, CompatNode)
    assert view.size == first_view.size and view.inode != 0
    fd = os.open(view.path, os.O_RDONLY)
    try:
        assert view.read(fd, 0, view.size) == first_view.read(fd, 0, first_view.size)
    finally:
        os.close(fd)

    # A damaged file is decided again, and rewritten with only the blobs still met.
    monkeypatch.undo()
    path = tiny.layout.state / "compat-decisions.json"
    good = path.read_bytes()
    assert Decisions(tiny.layout).get("model", view.digest) == "model+mmproj"
    path.write_bytes(good.replace(b'"rules": "', b'"rules": "other modelfs '))
    assert Decisions(tiny.layout).get("model", view.digest) is None  # other rules decided
    path.write_bytes(b"{broken")
    assert Decisions(tiny.layout).get("model", view.digest) is None
    tiny.layout.legacy_manifest(parse_name("plain:tiny")).unlink()
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    assert "llama.cpp" in tree.root.children["gemma3"].children["tiny"].children
    assert json.loads(path.read_bytes())["decisions"] == {
        f"model:{view.digest.hex}": "model+mmproj"
    }


# -- separate projectors (LLaVA's, without clip.projector_type) ---------------------------


def llava_projector(
    tmp_path: Path,
    *extra: KV,
    vision: bool = True,
    name: str = "llava-projector",
    width: int = 16,
    blocks: int = 1,
    tensors: Sequence[Tensor] | None = None,
) -> Path:
    """A LLaVA-style projector as Ollama ships it in a `projector` layer: a clip GGUF with
    a vision encoder and a LLaVA projector, but no projector type. `tensors` replace its
    few (a tower of `blocks` blocks of `width`)."""
    kvs: list[KV] = [
        ("clip.has_text_encoder", False, V.BOOL),
        ("clip.has_vision_encoder", vision, V.BOOL),
        ("clip.has_llava_projector", True, V.BOOL),
        ("clip.vision.image_size", 28, V.UINT32),
        ("clip.vision.patch_size", 14, V.UINT32),
        ("clip.vision.embedding_length", width, V.UINT32),
        ("clip.vision.block_count", blocks, V.UINT32),
        ("clip.vision.image_mean", CLIP_MEAN, V.ARRAY, V.FLOAT32),
        *extra,
    ]
    ts: list[Tensor] = (
        [
            ("v.patch_embd.weight", f16(16, 3, 14, 14, seed=1)),
            ("v.position_embd.weight", f16(5, 16, seed=2)),
            ("v.blk.0.attn_q.weight", f16(16, 16, seed=3)),
            ("mm.0.weight", f16(32, 16, seed=4)),
            ("mm.0.bias", f32(32, seed=5)),
            ("mm.2.weight", f16(32, 32, seed=6)),
        ]
        if tensors is None
        else list(tensors)
    )
    return write_gguf(tmp_path / f"{name}.gguf", "clip", kvs, ts)


def test_llava_projector_without_type_gets_a_view(tmp_path: Path) -> None:
    from modelfs.store.compat import may_need_mmproj_view, mmproj_view

    src = llava_projector(tmp_path)
    assert compat_views(src, HEX) is None  # no text rule reads a clip file
    assert may_need_mmproj_view(src)
    view = mmproj_view(src, HEX)
    assert view is not None and view.handler == "handle_missing_llava_projector_type"
    reader = gguf.GGUFReader(materialize(view, tmp_path))
    check_aligned(reader)
    kv, source = fields(reader), gguf.GGUFReader(src)
    assert kv["clip.projector_type"] == "mlp"
    assert {k: v for k, v in kv.items() if k != "clip.projector_type"} == fields(source)
    got, want = tensors(reader), tensors(source)
    assert list(got) == list(want)
    check_renamed(got, want, {n: n for n in want})  # every tensor, byte for byte
    assert not view.computed
    # A projector that names its type, or has no vision encoder, is loaded as it is.
    typed = llava_projector(tmp_path, ("clip.projector_type", "mlp", V.STRING), name="typed")
    assert mmproj_view(typed, HEX) is None
    typed = llava_projector(tmp_path, ("clip.vision.projector_type", "ldp", V.STRING), name="v")
    assert mmproj_view(typed, HEX) is None
    assert mmproj_view(llava_projector(tmp_path, vision=False, name="blind"), HEX) is None
    # A text model used as a projector file has no projector view unless a clip rule reads it.
    plain = write_gguf(
        tmp_path / "plain.gguf", "llama", tokenizer(8), [("token_embd.weight", f32(8, 32))]
    )
    assert mmproj_view(plain, HEX) is None


def llava_store(tmp_path: Path) -> tuple[TinyStore, Path]:
    """llava:tiny, a plain llama text model (no view) with a LLaVA projector layer."""
    tiny = TinyStore(tmp_path / "models")
    text = write_gguf(
        tmp_path / "llava-text.gguf",
        "llama",
        [("llama.context_length", 4096, V.UINT32), *tokenizer(8)],
        [("token_embd.weight", f32(8, 32))],
    )
    projector = llava_projector(tmp_path)
    raw_manifest = tiny.manifest(
        [tiny.layer("model", text.read_bytes()), tiny.layer("projector", projector.read_bytes())],
        {"model_format": "gguf", "model_family": "llama", "file_type": "F32"},
    )
    tiny.legacy("llava:tiny", raw_manifest)
    return tiny, projector


def test_a_llava_model_gets_its_projector_view(tmp_path: Path) -> None:
    from modelfs.cli.show import render, show_record
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import CompatNode, DirNode, InodeTable
    from modelfs.store.scan import scan_store

    tiny, projector = llava_store(tmp_path)
    index = scan_store(tiny.root)
    tree = TreeBuilder(InodeTable()).build(index)
    short = tree.root.children["llava"].children["tiny"]
    assert isinstance(short, DirNode)
    assert "mmproj.gguf" in short.children  # the raw layer stays
    holder = short.children["llama.cpp"]
    assert isinstance(holder, DirNode) and sorted(holder.children) == ["mmproj.gguf"]
    node = holder.children["mmproj.gguf"]
    assert isinstance(node, CompatNode) and node.view is not None
    assert node.view.handler == "handle_missing_llava_projector_type"
    assert node.size == mmproj_view_of(projector).size
    assert node.xattrs["user.modelfs.compat.source"] == str(node.digest).encode()
    assert node.digest == short.children["mmproj.gguf"].digest  # type: ignore[attr-defined]
    # The lazy .by-name/ directory counts llama.cpp/ before it is filled.
    lazy = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "llava", "tiny"):
        lazy = lazy.children[part]
    assert isinstance(lazy, DirNode) and not lazy.loaded
    before = lazy.nlink
    assert sorted(lazy.children) == sorted(short.children)
    assert lazy.nlink == before == short.nlink
    # `modelfs show` names the files to pass.
    record = show_record(index, next(iter(index)))
    lc = record["variants"][0]["llama_cpp"]
    assert lc["model"] == "model.gguf" and lc["mmproj"] == "llama.cpp/mmproj.gguf"
    assert lc["view"] is None
    assert lc["mmproj_view"]["rules"] == "handle_missing_llava_projector_type"
    text = render(record)
    assert "llama.cpp: --model model.gguf --mmproj llama.cpp/mmproj.gguf" in text
    assert "mmproj view by handle_missing_llava_projector_type" in text


def mmproj_view_of(path: Path) -> GGUFView:
    from modelfs.store.compat import mmproj_view

    view = mmproj_view(path, HEX)
    assert view is not None
    return view


@fuse
def test_mount_shows_a_llava_projector_view(tmp_path: Path) -> None:
    tiny, projector = llava_store(tmp_path)
    want = materialize(mmproj_view_of(projector), tmp_path).read_bytes()
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "llava" / "tiny"
        assert os.listdir(d / "llama.cpp") == ["mmproj.gguf"]
        assert (d / "mmproj.gguf").read_bytes() == projector.read_bytes()  # raw stays raw
        assert (d / "llama.cpp" / "mmproj.gguf").read_bytes() == want
        digest = os.getxattr(d / "llama.cpp" / "mmproj.gguf", "user.modelfs.compat.source")
        assert digest == os.getxattr(d / "mmproj.gguf", "user.modelfs.digest")
        lazy = mnt / ".by-name" / "registry.ollama.ai" / "library" / "llava" / "tiny"
        before = os.stat(lazy).st_nlink
        assert "llama.cpp" in os.listdir(lazy)
        assert os.stat(lazy).st_nlink == before == os.stat(d).st_nlink
        assert (d / ".ollama" / "status").read_text() == "ok\n"
