"""The rules for mistral3, llama4, gptoss: part of the port of ollama/ollama `llama/compat/llama-
ollama-compat.cpp` (main @ fb30760) that store.compat.handlers dispatches to; each detector and
handler names the upstream function it mirrors.
"""

from __future__ import annotations

import math
import struct

from modelfs.store.compat.draft import GGML_F16, GGML_F32, Compute, Draft
from modelfs.store.compat.markers import VISION_PREFIXES, Markers
from modelfs.store.formats.gguf import (
    T_FLOAT32,
    T_UINT32,
)

# --------------------------------------------------------------------------------------
# mistral3, llama4, gptoss
# --------------------------------------------------------------------------------------

# handle_mistral3: YaRN and temperature keys under the names llama.cpp reads (copies; the
# old keys stay, as upstream's copy_kv leaves them).
MISTRAL3_COPIES = (
    ("mistral3.rope.scaling.beta_fast", "mistral3.rope.scaling.yarn_beta_fast"),
    ("mistral3.rope.scaling.beta_slow", "mistral3.rope.scaling.yarn_beta_slow"),
    ("mistral3.rope.scaling.mscale_all_dim", "mistral3.rope.scaling.yarn_log_multiplier"),
    ("mistral3.rope.scaling_beta", "mistral3.attention.temperature_scale"),
)


# detect_ollama_mistral3: vision inline, or the old YaRN / temperature key names.
detect_mistral3 = Markers(
    "mistral3",
    keys=(
        "mistral3.rope.scaling.beta_fast",
        "mistral3.rope.scaling.mscale_all_dim",
        "mistral3.rope.scaling_beta",
    ),
    prefixes=VISION_PREFIXES,
)


def handle_mistral3(d: Draft) -> None:
    """handle_mistral3 (text side)."""
    for src, dst in MISTRAL3_COPIES:
        d.copy_kv(src, dst)
    if d.string_missing_or_default("tokenizer.ggml.pre"):
        d.set_str("tokenizer.ggml.pre", "tekken")
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


# kMistral3ClipRenames: substring renames (Pixtral projector), in this order.
MISTRAL3_CLIP_RENAMES = (
    ("v.patch_conv", "v.patch_embd"),
    ("v.encoder_norm", "v.pre_ln"),
    (".attn_output", ".attn_out"),
    (".attn_norm", ".ln1"),
    (".ffn_norm", ".ln2"),
    ("mm.linear_1", "mm.1"),
    ("mm.linear_2", "mm.2"),
    ("mm.patch_merger.merging_layer", "mm.patch_merger"),
    ("mm.norm", "mm.input_norm"),
)
# handle_mistral3_clip: mistral3.* -> clip.* (u32 unless marked f32).
MISTRAL3_CLIP_COPIES = (
    ("mistral3.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("mistral3.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("mistral3.vision.feed_forward_length", "clip.vision.feed_forward_length", T_UINT32),
    ("mistral3.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    ("mistral3.vision.image_size", "clip.vision.image_size", T_UINT32),
    ("mistral3.vision.patch_size", "clip.vision.patch_size", T_UINT32),
    ("mistral3.vision.num_channels", "clip.vision.num_channels", T_UINT32),
    ("mistral3.spatial_merge_size", "clip.vision.spatial_merge_size", T_UINT32),
    ("mistral3.vision.rope.freq_base", "clip.rope.freq_base", T_FLOAT32),
    # pixtral reads its output width from mm.2; any non-zero value does.
    ("mistral3.embedding_length", "clip.vision.projection_dim", T_UINT32),
)
# handle_mistral3_clip: Pixtral's (CLIP's) image statistics.
PIXTRAL_MEAN = (0.48145467, 0.45782750, 0.40821072)
PIXTRAL_STD = (0.26862955, 0.26130259, 0.27577710)


def rope_permute_order(rows: int, n_head: int) -> list[int] | None:
    """register_mistral3_vision_qk_permute: LLaMA's RoPE permutation of Q/K output rows
    (what llama.cpp's converter does to vision Q/K and Ollama's did not). Row
    h*hd + 2*i + j of the result is row h*hd + j*hd/2 + i of the source."""
    if n_head <= 0 or rows % n_head:
        return None
    hd = rows // n_head
    half = hd // 2
    return [(r // hd) * hd + (r % 2) * half + (r % hd) // 2 for r in range(rows)]


def handle_mistral3_clip(d: Draft) -> None:
    """handle_mistral3_clip: the Pixtral vision tower and projector of a monolithic
    mistral3 GGUF."""
    for src, dst, vtype in MISTRAL3_CLIP_COPIES:
        d.copy_kv(src, dst, vtype)
    d.inject_f32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    d.inject_f32_array("clip.vision.image_mean", PIXTRAL_MEAN)
    d.inject_f32_array("clip.vision.image_std", PIXTRAL_STD)
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_silu", True)
    d.set_str("clip.projector_type", "pixtral")
    d.set_str("general.architecture", "clip")
    # pixtral needs v.token_embd.img_break (the [IMG_BREAK] embedding row), which these
    # files do not ship: zeros in output_norm.weight's slot make its insertion a no-op.
    lm_embd = d.u32_value("mistral3.embedding_length") or 0
    if lm_embd > 0 and d.tensor("output_norm.weight") is not None:
        zeros = Compute("zeros", (), (), 4 * lm_embd)
        d.reclaim("output_norm.weight", "v.token_embd.img_break", (lm_embd,), GGML_F32, zeros)
    # Vision Q/K rows in llama.cpp's RoPE order (F16 only, as upstream), before renames.
    n_head = d.u32_value("mistral3.vision.attention.head_count")
    n_blocks = d.u32_value("mistral3.vision.block_count")
    if n_head is not None and n_blocks is not None:
        for b in range(n_blocks):
            for x in "qk":
                t = d.tensor(f"v.blk.{b}.attn_{x}.weight")
                if t is None or t.ggml_type != GGML_F16 or len(t.shape) < 2:
                    continue
                order = rope_permute_order(t.shape[1], n_head)
                if order is not None:
                    d.permute_rows(t.name, order)
    for needle, replacement in MISTRAL3_CLIP_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    d.promote_to_f32("v.patch_embd.weight")


# detect_ollama_llama4: vision inline.
detect_llama4 = Markers("llama4", prefixes=VISION_PREFIXES)


def handle_llama4(d: Draft) -> None:
    """handle_llama4: text names already match; only the embedded vision is hidden."""
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


# kLlama4ClipRenames: substring renames, in this order (the adapter's mlp.fc1/fc2 first,
# so the generic .mlp.fc renames below cannot take them).
LLAMA4_CLIP_RENAMES = (
    ("v.vision_adapter.mlp.fc1", "mm.model.mlp.1"),
    ("v.vision_adapter.mlp.fc2", "mm.model.mlp.2"),
    ("mm.linear_1", "mm.model.fc"),
    ("v.class_embedding", "v.class_embd"),
    ("v.layernorm_post", "v.post_ln"),
    ("v.layernorm_pre", "v.pre_ln"),
    ("v.patch_embedding", "v.patch_embd"),
    (".attn_output", ".attn_out"),
    (".attn_norm", ".ln1"),
    (".ffn_norm", ".ln2"),
    (".mlp.fc1", ".ffn_up"),
    (".mlp.fc2", ".ffn_down"),
)
# handle_llama4_clip: llama4.* -> clip.vision.* (u32 unless marked f32).
LLAMA4_CLIP_COPIES = (
    ("llama4.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("llama4.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("llama4.vision.feed_forward_length", "clip.vision.feed_forward_length", T_UINT32),
    ("llama4.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    ("llama4.vision.image_size", "clip.vision.image_size", T_UINT32),
    ("llama4.vision.patch_size", "clip.vision.patch_size", T_UINT32),
    ("llama4.vision.layer_norm_epsilon", "clip.vision.attention.layer_norm_epsilon", T_FLOAT32),
    ("llama4.embedding_length", "clip.vision.projection_dim", T_UINT32),
)


def handle_llama4_clip(d: Draft) -> None:
    """handle_llama4_clip: the ViT and 3-layer projector of a monolithic llama4 GGUF."""
    for src, dst, vtype in LLAMA4_CLIP_COPIES:
        d.copy_kv(src, dst, vtype)
    # The projector's scale factor is 1 / pixel_shuffle_ratio (2 when unknown).
    scale = 2
    ratio = d.kv.get("llama4.vision.pixel_shuffle_ratio")
    if ratio is not None and ratio.vtype == T_FLOAT32 and ratio.value > 0:
        scale = _round_half_away(_f32(1.0 / ratio.value)) or 2
    d.inject_u32("clip.vision.projector.scale_factor", scale)
    d.inject_f32_array("clip.vision.image_mean", (0.5, 0.5, 0.5))
    d.inject_f32_array("clip.vision.image_std", (0.5, 0.5, 0.5))
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_gelu", True)
    d.set_str("clip.projector_type", "llama4")
    d.set_str("clip.vision.projector_type", "llama4")
    d.set_str("general.architecture", "clip")
    d.rename_tensor("v.positional_embedding_vlm", "v.position_embd.weight")  # no .weight
    for needle, replacement in LLAMA4_CLIP_RENAMES:
        d.rename_tensors_containing(needle, replacement)


def _f32(x: float) -> float:
    """x as a C float (upstream computes 1.0f / ratio in single precision)."""
    single: float = struct.unpack("<f", struct.pack("<f", x))[0]
    return single


def _round_half_away(x: float) -> int:
    """std::round: halves away from zero (Python's round() goes to even)."""
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


# handle_gptoss: substring renames, first occurrence (the needles do not overlap).
GPTOSS_TENSOR_RENAMES = (
    (".attn_out", ".attn_output"),
    (".attn_sinks", ".attn_sinks.weight"),
    (".ffn_norm", ".post_attention_norm"),
)


# detect_ollama_gptoss: the arch name alone (llama.cpp spells it gpt-oss).
detect_gptoss = Markers("gptoss", always=True)


def handle_gptoss(d: Draft) -> None:
    """handle_gptoss"""
    d.set_str("general.architecture", "gpt-oss")
    d.rename_kv_prefix("gptoss.", "gpt-oss.")
    d.arch = "gpt-oss"
    if not d.has_key("gpt-oss.expert_feed_forward_length"):
        gate = d.tensor("blk.0.ffn_gate_exps.weight")
        if gate is not None and len(gate.shape) >= 2:
            d.set_u32("gpt-oss.expert_feed_forward_length", gate.shape[1])
    d.inject_str("gpt-oss.rope.scaling.type", "yarn")
    d.set_str("tokenizer.ggml.pre", "gpt-4o")  # Harmony headers need gpt-4o pre-tokenizing
    for needle, replacement in GPTOSS_TENSOR_RENAMES:
        d.rename_tensors_containing(needle, replacement)
