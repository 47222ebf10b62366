"""llama.cpp views of Ollama-layout GGUFs for gemma3, gemma4, qwen35, gpt-oss, mistral3 and llama4:
per handler, a small
GGUF in the Ollama layout built here, its view read back with the reference reader
(`gguf.GGUFReader`), checked against what Ollama's upstream handler (ollama/ollama
llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modelfs.store.compat import compat_views  # noqa: E402
from modelfs.store.compat.compute import ComputeCache  # noqa: E402
from tests.compat_gguf import (  # noqa: E402
    HEX,
    KV,
    Tensor,
    V,
    check_aligned,
    f16,
    f32,
    field_type,
    fields,
    materialize,
    raw,
    tensors,
    tokenizer,
    views_of,
    write_gguf,
)

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
