"""The rules for nemotron_h_omni, nemotron_h_moe, llama (Llama 3 markers), glmocr: part of the port
of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @ fb30760) that
store.compat.handlers dispatches to; each detector and handler names the upstream function it
mirrors.
"""

from __future__ import annotations

import math

from modelfs.store.compat.draft import GGML_F32, Compute, Draft
from modelfs.store.compat.markers import VISION_PREFIXES, Markers
from modelfs.store.compat.vision import CLIP_MEAN, CLIP_STD, pad_sections
from modelfs.store.formats.gguf import (
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_INT32,
    T_UINT32,
)

# --------------------------------------------------------------------------------------
# nemotron_h_omni, nemotron_h_moe, llama (Llama 3 markers), glmocr
# --------------------------------------------------------------------------------------

# detect_ollama_nemotron_h_omni: the unified text+vision+audio blob.
detect_nemotron_h_omni = Markers("nemotron_h_omni", prefixes=("v.", "a.", "mm."))


def handle_nemotron_h_omni(d: Draft) -> None:
    """handle_nemotron_h_omni: the text side as nemotron_h_moe (with experts) or nemotron_h,
    every non-vision, non-audio key copied under that prefix; encoders hidden."""
    counts = ("expert_count", "expert_used_count")
    experts = any((d.u32_value(f"nemotron_h_omni.{k}") or 0) > 0 for k in counts)
    text_arch = "nemotron_h_moe" if experts else "nemotron_h"  # nemotron_h_omni_text_arch
    d.set_str("general.architecture", text_arch)
    d.arch = text_arch
    old = "nemotron_h_omni."
    for key in [k for k in d.kv if k.startswith(old)]:  # copy_nemotron_h_omni_text_kvs
        if not key[len(old) :].startswith(("vision.", "audio.")):
            d.copy_kv(key, f"{text_arch}.{key[len(old) :]}")
    for prefix in ("a.", "v.", "mm."):
        d.add_skip_prefix(prefix)
    if text_arch == "nemotron_h_moe" and detect_nemotron_h_moe(d):
        handle_nemotron_h_moe(d)


# handle_nemotron_h_omni_clip: nemotron_h_omni.* -> clip.vision.* (typed copies: u32
# unless marked f32; None keeps the source's type, arrays included).
NEMOTRON_OMNI_CLIP_COPIES = (
    ("vision.block_count", "block_count", T_UINT32),
    ("vision.embedding_length", "embedding_length", T_UINT32),
    ("vision.feed_forward_length", "feed_forward_length", T_UINT32),
    ("vision.attention.head_count", "attention.head_count", T_UINT32),
    ("vision.attention.layer_norm_epsilon", "attention.layer_norm_epsilon", T_FLOAT32),
    ("vision.patch_size", "patch_size", T_UINT32),
    ("vision.image_size", "image_size", T_UINT32),
    ("vision.num_channels", "num_channels", T_UINT32),
    ("vision.projector.scale_factor", "projector.scale_factor", T_UINT32),
    ("embedding_length", "projection_dim", T_UINT32),
    ("vision.image_mean", "image_mean", None),
    ("vision.image_std", "image_std", None),
    ("vision.image_token_id", "image_token_id", None),
    ("vision.image_start_token_id", "image_start_token_id", None),
    ("vision.image_end_token_id", "image_end_token_id", None),
    ("vision.max_tiles", "max_tiles", None),
    ("vision.min_num_patches", "min_num_patches", None),
    ("vision.max_num_patches", "max_num_patches", None),
)
# handle_nemotron_h_omni_clip: the projector MLP under the names nemotron_v2_vl reads.
NEMOTRON_OMNI_CLIP_RENAMES = (
    ("mm.norm.weight", "mm.model.mlp.0.weight"),
    ("mm.1.weight", "mm.model.mlp.1.weight"),
    ("mm.2.weight", "mm.model.mlp.3.weight"),
)


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape as ggml_n_dims sees it: trailing 1s dropped (at least one dimension)."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return shape[:n]


def _square_side(n: int) -> int:
    """nemotron3_square_side: the side of an n-position square grid, else 0."""
    side = math.isqrt(n)
    return side if side * side == n else 0


def _position_layout(shape: tuple[int, ...]) -> tuple[int, int, str] | None:
    """nemotron3_position_layout: (embedding, positions, which index runs fastest) of a
    position embedding held as [E, P], [P, E], [1, P, E] or [E, P, 1] (ggml order)."""
    if len(shape) == 2:
        if _square_side(shape[1]):
            return shape[0], shape[1], "ep"
        if _square_side(shape[0]):
            return shape[1], shape[0], "pe"
    elif len(shape) == 3:
        if shape[0] == 1 and _square_side(shape[1]):
            return shape[2], shape[1], "ep"  # read embedding-fastest, as upstream does
        if shape[2] == 1 and _square_side(shape[1]):
            return shape[0], shape[1], "pe"
    return None


def _nemotron_positions(d: Draft, embedding: int, target_side: int) -> None:
    """register_nemotron3_position_embedding: the square grid of position embeddings
    resampled to the grid the configured image size makes, as F32 [E, side^2]; computed
    on first read. The source may lack the .weight suffix."""
    bare = d.tensor("v.position_embd") is not None
    name = "v.position_embd" if bare else "v.position_embd.weight"
    t = d.tensor(name)
    if t is None or target_side == 0 or isinstance(t.data, Compute) or len(t.data) != 1:
        return
    shape = _dims(t.shape)
    layout = _position_layout(shape)
    if layout is None:
        return
    found, positions, order = layout
    embedding = embedding or found
    source_side = _square_side(positions)
    if embedding == 0 or source_side == 0:
        return
    # Upstream reads a 2-D grid embedding-fastest only when its first axis is the
    # configured width; a width that disagrees with the tensor fails its load.
    if len(shape) == 2:
        order = "ep" if shape[0] == embedding else "pe"
    n = math.prod(t.shape)
    if n != embedding * positions:
        d.notes.append(f"{name}: {shape} does not hold {embedding}-wide embeddings; left as is")
        return
    resampled = Compute(
        "resample_positions",
        t.data,
        (t.ggml_type, n, order, embedding, positions, source_side, target_side),
        4 * embedding * target_side * target_side,
    )
    if name != "v.position_embd.weight":
        d.rename_tensor(name, "v.position_embd.weight")
    d.set_shape("v.position_embd.weight", (embedding, target_side * target_side), GGML_F32)
    t.data = resampled


def _nemotron_patch_embd(d: Draft, patch: int, channels: int, embedding: int) -> None:
    """register_nemotron3_patch_embedding: the flat [patch*patch*channels, E] kernel as the
    conv weight [patch, patch, channels, E] in F32. The element order is already the
    destination's, so only the type changes (an F32 source is served as it is)."""
    t = d.tensor("v.patch_embd.weight")
    if t is None or t.computed or not (patch and channels and embedding):
        return
    if _dims(t.shape) != (patch * patch * channels, embedding):
        return
    data = t.data if t.ggml_type == GGML_F32 else d.concat_to_f32([t.name])
    if data is None:
        return
    d.set_shape(t.name, (patch, patch, channels, embedding), GGML_F32)
    t.data = data


def handle_nemotron_h_omni_clip(d: Draft) -> None:
    """handle_nemotron_h_omni_clip: the vision encoder and projector of a monolithic
    nemotron_h_omni GGUF (nemotron_v2_vl). Audio stays off, as upstream has it."""
    d.set_str("general.architecture", "clip")
    for src, dst, vtype in NEMOTRON_OMNI_CLIP_COPIES:
        d.copy_kv("nemotron_h_omni." + src, "clip.vision." + dst, vtype)

    def u32(key: str, fallback: int) -> int:  # read_u32_kv
        value = d.u32_value(key)
        return fallback if value is None else value

    image_size = u32("clip.vision.image_size", 512)
    patch = u32("clip.vision.patch_size", 16)
    embedding = u32("clip.vision.embedding_length", 1280)
    channels = u32("clip.vision.num_channels", 3)
    target_side = image_size // patch if patch else 0
    d.inject_u32("clip.vision.block_count", 32)
    d.inject_u32("clip.vision.embedding_length", embedding)
    d.inject_u32("clip.vision.feed_forward_length", (embedding * 4) & 0xFFFFFFFF)
    d.inject_u32("clip.vision.attention.head_count", 16)
    d.inject_f32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    d.inject_u32("clip.vision.patch_size", patch)
    d.inject_u32("clip.vision.image_size", image_size)
    d.inject_u32("clip.vision.num_channels", channels)
    d.inject_u32("clip.vision.projector.scale_factor", 2)
    d.inject_f32_array("clip.vision.image_mean", CLIP_MEAN)
    d.inject_f32_array("clip.vision.image_std", CLIP_STD)
    d.inject_bool("clip.has_vision_encoder", True)
    d.set_str("clip.vision.projector_type", "nemotron_v2_vl")
    d.inject_bool("clip.use_gelu", True)
    d.set("clip.has_audio_encoder", T_BOOL, False)
    d.rename_tensor("v.cls_embd", "v.class_embd")
    d.promote_to_f32("v.class_embd")
    _nemotron_positions(d, embedding, target_side)
    _nemotron_patch_embd(d, patch, channels, embedding)
    for old, new in NEMOTRON_OMNI_CLIP_RENAMES:
        d.rename_tensor(old, new)


# detect_ollama_nemotron_h_moe: latent-FFN tensors under Ollama's names, or MTP tensors.
detect_nemotron_h_moe = Markers(
    "nemotron_h_moe", prefixes=("blk.1.ffn_latent_in", "blk.0.ffn_latent_in", "mtp.")
)


def handle_nemotron_h_moe(d: Draft) -> None:
    """handle_nemotron_h_moe"""
    if not d.has_key("nemotron_h_moe.moe_latent_size"):
        for b in range(1024):
            t = d.tensor(f"blk.{b}.ffn_latent_in.weight")
            if t is not None and len(t.shape) >= 2:
                d.set_u32("nemotron_h_moe.moe_latent_size", t.shape[1])
                break
    d.rename_tensors_containing(".ffn_latent_in", ".ffn_latent_down")
    d.rename_tensors_containing(".ffn_latent_out", ".ffn_latent_up")
    d.add_skip_prefix("mtp.")


LLAMA3_EOT, LLAMA3_END_OF_TEXT, LLAMA3_START_HEADER = 128009, 128001, 128006


def _u32_or_nonneg_i32(d: Draft, key: str) -> int | None:
    """get_u32_kv: a u32, or an i32 that is not negative."""
    item = d.kv.get(key)
    if item is None:
        return None
    if item.vtype == T_UINT32 or (item.vtype == T_INT32 and item.value >= 0):
        return int(item.value)
    return None


def detect_llama3(d: Draft) -> bool:
    """detect_ollama_llama3_metadata_gap: a Llama 3 vocabulary and chat markers, with the
    pre-tokenizer missing or the EOS at <|end_of_text|>."""
    if not d.string_equals("general.architecture", "llama"):
        return False
    if d.token_at(LLAMA3_EOT) != "<|eot_id|>":
        return False
    chat = (
        d.token_at(LLAMA3_START_HEADER) == "<|start_header_id|>"
        or d.string_contains("tokenizer.chat_template", "<|start_header_id|>")
        or d.string_contains("tokenizer.chat_template", "<|eot_id|>")
    )
    eos_end_of_text = _u32_or_nonneg_i32(d, "tokenizer.ggml.eos_token_id") == LLAMA3_END_OF_TEXT
    return chat and (d.string_missing_or_default("tokenizer.ggml.pre") or eos_end_of_text)


def handle_llama3(d: Draft) -> None:
    """handle_llama3_metadata: llama-bpe pre-tokenizer, <|eot_id|> as EOS and EOT."""
    if d.string_missing_or_default("tokenizer.ggml.pre"):
        d.set_str("tokenizer.ggml.pre", "llama-bpe")
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _u32_or_nonneg_i32(d, key)
        if value is None or value == LLAMA3_END_OF_TEXT:
            d.set_u32(key, LLAMA3_EOT)
    d.set("tokenizer.ggml.eos_token_ids", T_ARRAY, [LLAMA3_EOT], T_INT32)


detect_glmocr = Markers("glmocr", always=True)  # detect_ollama_glmocr

# handle_glmocr: substring renames (each leaf once per block, no overlaps).
GLMOCR_RENAMES = (
    (".attn_out.", ".attn_output."),
    (".post_attn_norm.", ".post_attention_norm."),
    (".post_ffn_norm.", ".post_ffw_norm."),
)


def handle_glmocr(d: Draft) -> None:
    """handle_glmocr: glmocr -> glm4, M-RoPE sections, chatglm-bpe, and GLM4's fused FFN:
    ffn_up becomes [gate | up] (twice as wide, served as the two source ranges)."""
    d.arch = "glm4"
    d.set_str("general.architecture", "glm4")
    d.rename_kv_prefix("glmocr.", "glm4.")
    pad_sections(d, "glm4.rope.mrope_section", "glm4.rope.dimension_sections", True)
    if not d.has_key("glm4.rope.dimension_count"):
        key_length = d.u32_value("glm4.attention.key_length")
        if key_length is not None:
            d.set_u32("glm4.rope.dimension_count", key_length)
    pre = d.kv.get("tokenizer.ggml.pre")
    if pre is not None and pre.value != "chatglm-bpe":
        d.set_str("tokenizer.ggml.pre", "chatglm-bpe")
    for needle, replacement in GLMOCR_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    n_blocks = d.u32_value("glm4.block_count")
    for b in range(16 if n_blocks is None else n_blocks):
        _glm4_ffn_concat(d, b)  # register_glm4_ffn_concat
        d.add_skip_prefix(f"blk.{b}.ffn_gate.")
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


def _glm4_ffn_concat(d: Draft, b: int) -> None:
    gate, up = d.tensor(f"blk.{b}.ffn_gate.weight"), d.tensor(f"blk.{b}.ffn_up.weight")
    if gate is None or up is None:
        return
    if gate.ggml_type != up.ggml_type or gate.shape != up.shape or gate.computed or up.computed:
        d.notes.append(f"blk.{b}: ffn_gate and ffn_up differ in type or shape; not fused")
        return
    up.data = d.concat_ranges([gate.name, up.name])  # gate first: silu(gate) * up
    up.shape = (up.shape[0], up.shape[1] * 2, *up.shape[2:])


# handle_glmocr_clip: glmocr.vision.* -> clip.vision.* (u32 unless marked f32).
GLMOCR_CLIP_COPIES = (
    ("glmocr.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("glmocr.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("glmocr.vision.intermediate_size", "clip.vision.feed_forward_length", T_UINT32),
    ("glmocr.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    (
        "glmocr.vision.attention.layer_norm_rms_epsilon",
        "clip.vision.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
    ("glmocr.vision.image_size", "clip.vision.image_size", T_UINT32),
    ("glmocr.vision.patch_size", "clip.vision.patch_size", T_UINT32),
    ("glmocr.vision.spatial_merge_size", "clip.vision.spatial_merge_size", T_UINT32),
    ("glmocr.vision.out_hidden_size", "clip.vision.projection_dim", T_UINT32),
)


def handle_glmocr_clip(d: Draft) -> None:
    """handle_glmocr_clip: the GLM4V vision tower and projector of a monolithic glmocr
    GGUF; its tensor names already match, but for the two-frame patch embedding."""
    for src, dst, vtype in GLMOCR_CLIP_COPIES:
        d.copy_kv(src, dst, vtype)
    # The file's own image statistics, as F32 arrays (upstream writes the raw items as
    # F32; for an array of F32, the copy).
    for stat in ("image_mean", "image_std"):
        item = d.kv.get(f"glmocr.vision.{stat}")
        if item is not None and item.vtype == T_ARRAY and item.item_type == T_FLOAT32:
            d.copy_kv(f"glmocr.vision.{stat}", f"clip.vision.{stat}")
        elif item is not None:
            d.notes.append(f"glmocr.vision.{stat} is not an F32 array; not copied")
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_silu", True)
    d.set_str("clip.projector_type", "glm4v")
    d.set_str("general.architecture", "clip")
    d.rename_tensor("v.patch_embd_0.weight", "v.patch_embd.weight")
    d.rename_tensor("v.patch_embd_1.weight", "v.patch_embd.weight.1")
    d.promote_to_f32("v.patch_embd.weight")
    d.promote_to_f32("v.patch_embd.weight.1")
