"""llama.cpp views of Ollama-layout GGUFs for the further text handlers (embeddinggemma, gemma3n,
qwen3next, lfm2, olmo3, glm, deepseekocr, nemotron and more): per handler, a small
GGUF in the Ollama layout built here, its view read back with the reference reader
(`gguf.GGUFReader`), checked against what Ollama's upstream handler (ollama/ollama
llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf")

from modelfs.store.compat import CompatViews, compat_views  # noqa: E402
from modelfs.store.formats.gguf import read_array, read_gguf_header_path  # noqa: E402
from tests.compat_gguf import (  # noqa: E402
    HEX,
    KV,
    Tensor,
    V,
    check_aligned,
    check_renamed,
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
