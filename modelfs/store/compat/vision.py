"""The rules for qwen25vl, qwen3vl, qwen3vlmoe, glm4moelite, deepseekocr: part of the port of
ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @ fb30760) that store.compat.handlers
dispatches to; each detector and handler names the upstream function it mirrors.
"""

from __future__ import annotations

import math

from modelfs.store.compat.draft import Draft
from modelfs.store.compat.markers import VISION_PREFIXES, Markers
from modelfs.store.compat.qwen35 import merge_qkv, split_patch_embed
from modelfs.store.formats.gguf import (
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_INT32,
    T_UINT32,
    ArraySummary,
)

# --------------------------------------------------------------------------------------
# qwen25vl, qwen3vl / qwen3vlmoe, glm4moelite, deepseekocr
# --------------------------------------------------------------------------------------


def pad_sections(d: Draft, src: str, dst: str, exactly_three: bool) -> None:
    """An M-RoPE section array of three (or more) -> four int32 sections, the last 0."""
    items = d.array_items(src)
    if items is None or len(items) < 3 or (exactly_three and len(items) != 3):
        return
    d.set(dst, T_ARRAY, [_i32(v) for v in items[:3]] + [0], T_INT32)


def _i32(v: int) -> int:
    """The item read as a C int32 (upstream reads the array data as int32)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


detect_qwen25vl = Markers("qwen25vl", always=True)  # detect_ollama_qwen25vl


def handle_qwen25vl(d: Draft) -> None:
    """handle_qwen25vl: qwen25vl -> qwen2vl (llama.cpp loads Qwen2 and 2.5-VL as one)."""
    d.arch = "qwen2vl"
    d.set_str("general.architecture", "qwen2vl")
    d.rename_kv_prefix("qwen25vl.", "qwen2vl.")
    pad_sections(d, "qwen2vl.rope.mrope_section", "qwen2vl.rope.dimension_sections", False)
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


QWEN3VL_MROPE = (24, 20, 20, 0)  # handle_qwen3vl: Qwen3-VL's sections (head_dim 128)


def qwen3vl_markers(arch: str) -> Markers:
    """detect_ollama_qwen3vl: no rope.dimension_sections."""
    return Markers(arch, missing=(f"{arch}.rope.dimension_sections",))


def handle_qwen3vl(d: Draft) -> None:
    """handle_qwen3vl (qwen3vl and qwen3vlmoe)"""
    arch = d.arch
    d.set(f"{arch}.rope.dimension_sections", T_ARRAY, list(QWEN3VL_MROPE), T_INT32)
    indexes = d.kv.get(f"{arch}.vision.deepstack_visual_indexes")
    n_ds = 0
    if indexes is not None and indexes.vtype == T_ARRAY:
        value = indexes.value
        n_ds = value.length if isinstance(value, ArraySummary) else len(value)
    d.inject_u32(f"{arch}.n_deepstack_layers", n_ds)
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


# handle_qwen25vl_clip: qwen25vl.* -> clip.vision.* (u32 unless marked f32).
QWEN25VL_CLIP_COPIES = (
    ("qwen25vl.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    (
        "qwen25vl.vision.attention.layer_norm_epsilon",
        "clip.vision.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
    ("qwen25vl.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("qwen25vl.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("qwen25vl.vision.num_channels", "clip.vision.num_channels", T_UINT32),
    ("qwen25vl.vision.patch_size", "clip.vision.patch_size", T_UINT32),
    ("qwen25vl.vision.spatial_merge_size", "clip.vision.spatial_merge_size", T_UINT32),
    ("qwen25vl.vision.window_size", "clip.vision.window_size", T_UINT32),
    ("qwen25vl.embedding_length", "clip.vision.projection_dim", T_UINT32),
)
# handle_qwen25vl_clip: exact renames (the merger and the two-frame patch embedding).
QWEN25VL_CLIP_RENAMES = (
    ("v.merger.ln_q.weight", "v.post_ln.weight"),
    ("v.merger.mlp.0.weight", "mm.0.weight"),
    ("v.merger.mlp.0.bias", "mm.0.bias"),
    ("v.merger.mlp.2.weight", "mm.2.weight"),
    ("v.merger.mlp.2.bias", "mm.2.bias"),
    ("v.patch_embd_0.weight", "v.patch_embd.weight"),
    ("v.patch_embd_1.weight", "v.patch_embd.weight.1"),
)
# CLIP's image statistics (handle_qwen25vl_clip, handle_nemotron_h_omni_clip write them to
# a float's precision; so do these).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def handle_qwen25vl_clip(d: Draft) -> None:
    """handle_qwen25vl_clip: the Qwen2.5-VL vision tower and merger of a monolithic
    qwen25vl GGUF (qwen2.5vl_merger)."""
    for src, dst, vtype in QWEN25VL_CLIP_COPIES:
        d.copy_kv(src, dst, vtype)
    up = d.tensor("v.blk.0.ffn_up.weight")
    if not d.has_key("clip.vision.feed_forward_length") and up is not None and len(up.shape) > 1:
        d.set_u32("clip.vision.feed_forward_length", up.shape[1])
    # Window attention repeats every fullatt_block_indexes[0] + 1 blocks (as llama.cpp's
    # Qwen2.5-VL converter writes it); upstream reads the array as int32.
    full = d.array_items("qwen25vl.vision.fullatt_block_indexes")
    if full:
        d.set_u32("clip.vision.n_wa_pattern", (_i32(full[0]) + 1) & 0xFFFFFFFF)
    d.inject_u32("clip.vision.n_wa_pattern", 8)
    d.inject_u32("clip.vision.image_size", 560)  # Qwen2VLVisionModel's default
    d.inject_f32_array("clip.vision.image_mean", CLIP_MEAN)
    d.inject_f32_array("clip.vision.image_std", CLIP_STD)
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_silu", True)
    d.set_str("clip.projector_type", "qwen2.5vl_merger")
    d.set_str("general.architecture", "clip")
    for old, new in QWEN25VL_CLIP_RENAMES:
        d.rename_tensor(old, new)
    d.promote_to_f32("v.patch_embd.weight")
    d.promote_to_f32("v.patch_embd.weight.1")


def detect_qwen3vl(d: Draft) -> bool:
    """detect_ollama_qwen3vl: either Qwen3-VL architecture, without rope.dimension_sections."""
    return any(qwen3vl_markers(arch)(d) for arch in ("qwen3vl", "qwen3vlmoe"))


# handle_qwen3vl_clip: <arch><suffix> -> clip.vision.* (u32 unless marked f32).
QWEN3VL_CLIP_COPIES = (
    (".vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    (
        ".vision.attention.layer_norm_epsilon",
        "clip.vision.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
    (".vision.block_count", "clip.vision.block_count", T_UINT32),
    (".vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    (".vision.num_channels", "clip.vision.num_channels", T_UINT32),
    (".vision.patch_size", "clip.vision.patch_size", T_UINT32),
    (".vision.spatial_merge_size", "clip.vision.spatial_merge_size", T_UINT32),
    (".vision.temporal_patch_size", "clip.vision.temporal_patch_size", T_UINT32),
    (".vision.rope.freq_base", "clip.vision.rope.freq_base", T_FLOAT32),
    (".embedding_length", "clip.vision.projection_dim", T_UINT32),
)
# handle_qwen3vl_clip: exact renames of the merger, patch bias and position embedding; they
# run before the block-leaf substring renames so `.linear_fc1` only matches inside blocks.
QWEN3VL_CLIP_RENAMES = (
    ("v.merger.norm.weight", "v.post_ln.weight"),
    ("v.merger.norm.bias", "v.post_ln.bias"),
    ("v.merger.linear_fc1.weight", "mm.0.weight"),
    ("v.merger.linear_fc1.bias", "mm.0.bias"),
    ("v.merger.linear_fc2.weight", "mm.2.weight"),
    ("v.merger.linear_fc2.bias", "mm.2.bias"),
    ("v.patch_embed.bias", "v.patch_embd.bias"),
    ("v.pos_embed.weight", "v.position_embd.weight"),
)
# handle_qwen3vl_clip: deepstack adapter leaves, v.deepstack_merger.X.<from> ->
# v.deepstack.<layer>.<to>.
QWEN3VL_DEEPSTACK_LEAVES = (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2"))
QWEN3VL_CLIP_BLOCK_RENAMES = (
    (".norm1", ".ln1"),
    (".norm2", ".ln2"),
    (".mlp.linear_fc1", ".ffn_up"),
    (".mlp.linear_fc2", ".ffn_down"),
)


def handle_qwen3vl_clip(d: Draft) -> None:
    """handle_qwen3vl_clip: the Qwen3-VL vision tower, deepstack adapters and merger of a
    monolithic qwen3vl / qwen3vlmoe GGUF (qwen3vl_merger)."""
    arch = d.arch
    for suffix, dst, vtype in QWEN3VL_CLIP_COPIES:
        d.copy_kv(arch + suffix, dst, vtype)
    d.inject_u32("clip.vision.num_channels", 3)
    d.inject_u32("clip.vision.temporal_patch_size", 2)
    d.inject_f32("clip.vision.rope.freq_base", 10_000.0)
    fc1 = d.tensor("v.blk.0.mlp.linear_fc1.weight")
    if not d.has_key("clip.vision.feed_forward_length") and fc1 is not None and len(fc1.shape) > 1:
        d.set_u32("clip.vision.feed_forward_length", fc1.shape[1])
    # image_size: the side of the square position grid, in pixels.
    pos = d.tensor("v.pos_embed.weight")
    patch = d.u32_value(arch + ".vision.patch_size")
    if not d.has_key("clip.vision.image_size") and pos is not None and patch is not None:
        positions = pos.shape[1] if len(pos.shape) > 1 else 1
        d.set_u32("clip.vision.image_size", (math.isqrt(positions) * patch) & 0xFFFFFFFF)
    d.copy_kv(arch + ".vision.image_mean", "clip.vision.image_mean")
    d.copy_kv(arch + ".vision.image_std", "clip.vision.image_std")
    d.copy_kv(arch + ".vision.shortest_edge", "clip.vision.image_min_pixels", T_UINT32)
    d.copy_kv(arch + ".vision.longest_edge", "clip.vision.image_max_pixels", T_UINT32)
    d.inject_u32("clip.vision.image_min_pixels", 65536)
    d.inject_u32("clip.vision.image_max_pixels", 16777216)
    d.inject_f32_array("clip.vision.image_mean", (0.5, 0.5, 0.5))
    d.inject_f32_array("clip.vision.image_std", (0.5, 0.5, 0.5))
    # Deepstack indexes are read as int32, whatever their stored type.
    indexes = [_i32(v) for v in d.array_items(arch + ".vision.deepstack_visual_indexes") or []]
    if not d.has_key("clip.vision.is_deepstack_layers"):
        n_layers = d.u32_value("clip.vision.block_count") or 0
        mask = [False] * n_layers
        for i in indexes:
            if 0 <= i < n_layers:
                mask[i] = True
        if mask:
            d.set("clip.vision.is_deepstack_layers", T_ARRAY, mask, T_BOOL)
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_gelu", True)
    d.set_str("clip.projector_type", "qwen3vl_merger")
    d.set_str("general.architecture", "clip")
    # QKV merged in F32, then the patch split (which takes blk.0's orphaned attn_k slot),
    # both finding their sources by name: before any rename.
    n_blocks = d.u32_value("clip.vision.block_count")
    for b in range(27 if n_blocks is None else n_blocks):
        merge_qkv(d, b, to_f32=True)
    channels = d.u32_value(arch + ".vision.num_channels")  # register_qwen3vl_patch_embed_split
    split_patch_embed(d, 3 if channels is None else channels)
    if d.tensor("v.blk.0.attn_qkv.weight") is not None:
        d.drop_tensor("v.blk.0.attn_k.weight")  # merged, and not reclaimed
    for old, new in QWEN3VL_CLIP_RENAMES:
        d.rename_tensor(old, new)
    for i, layer in enumerate(indexes):
        for leaf_from, leaf_to in QWEN3VL_DEEPSTACK_LEAVES:
            for suffix in ("weight", "bias"):
                d.rename_tensor(
                    f"v.deepstack_merger.{i}.{leaf_from}.{suffix}",
                    f"v.deepstack.{layer}.{leaf_to}.{suffix}",
                )
    for needle, replacement in QWEN3VL_CLIP_BLOCK_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    d.promote_to_f32("v.position_embd.weight")  # resized at run time: precision matters


detect_glm4moelite = Markers("glm4moelite", always=True)  # detect_ollama_glm4moelite


def handle_glm4moelite(d: Draft) -> None:
    """handle_glm4moelite: GLM-4.x-Flash onto llama.cpp's deepseek2 loader, per-head K/V
    lengths turned into MLA-absorbed ones."""
    d.arch = "deepseek2"
    d.set_str("general.architecture", "deepseek2")
    d.rename_kv_prefix("glm4moelite.", "deepseek2.")
    d.set_u32("deepseek2.attention.head_count_kv", 1)  # MLA absorbs every KV head
    kv_lora = d.u32_value("deepseek2.attention.kv_lora_rank")
    rope_dim = d.u32_value("deepseek2.rope.dimension_count")
    if kv_lora is not None and rope_dim is not None:
        d.set_u32("deepseek2.attention.key_length", kv_lora + rope_dim)
        d.set_u32("deepseek2.attention.value_length", kv_lora)
    head_dim = d.u32_value("glm4moelite.attention.key_length")  # the per-head dim
    if head_dim is not None:
        d.set_u32("deepseek2.attention.key_length_mla", head_dim)
        d.set_u32("deepseek2.attention.value_length_mla", head_dim)
    d.inject_u32("deepseek2.expert_group_count", 1)
    d.inject_u32("deepseek2.expert_group_used_count", 1)
    d.set_str("tokenizer.ggml.pre", "glm4")
    _glm4moelite_eog_ids(d)


def _glm4moelite_eog_ids(d: Draft) -> None:
    """fix_glm4moelite_eog_token_ids: EOT and EOM from eos_token_ids[1] and [2]."""
    need_eot = not d.has_key("tokenizer.ggml.eot_token_id")
    need_eom = not d.has_key("tokenizer.ggml.eom_token_id")
    item = d.kv.get("tokenizer.ggml.eos_token_ids")
    if not (need_eot or need_eom) or item is None or item.vtype != T_ARRAY:
        return
    ids: list[int] = []
    if item.item_type == T_INT32:
        ids = [v for v in d.array_items("tokenizer.ggml.eos_token_ids") or [] if v >= 0]
    elif item.item_type == T_UINT32:
        ids = list(d.array_items("tokenizer.ggml.eos_token_ids") or [])
    if need_eot and len(ids) >= 2:
        d.set_u32("tokenizer.ggml.eot_token_id", ids[1])
    if need_eom and len(ids) >= 3:
        d.set_u32("tokenizer.ggml.eom_token_id", ids[2])


detect_deepseekocr = Markers("deepseekocr", always=True)  # detect_ollama_deepseekocr


def handle_deepseekocr(d: Draft) -> None:
    """handle_deepseekocr: deepseekocr -> deepseek2-ocr, MoE sizes recovered from shapes,
    the SAM (s.), vision and projector tensors hidden."""
    d.arch = "deepseek2-ocr"
    d.set_str("general.architecture", "deepseek2-ocr")
    d.rename_kv_prefix("deepseekocr.", "deepseek2-ocr.")
    d.inject_f32("deepseek2-ocr.attention.layer_norm_rms_epsilon", 1e-6)
    # blk.0 is dense; blk.1 is the first MoE block. ffn_down_exps ne[0] = n_ff_exp.
    down = d.tensor("blk.1.ffn_down_exps.weight")
    if not d.has_key("deepseek2-ocr.expert_feed_forward_length") and down is not None:
        d.set_u32("deepseek2-ocr.expert_feed_forward_length", down.shape[0])
    shexp = d.tensor("blk.1.ffn_down_shexp.weight")
    n_ff_exp = d.u32_value("deepseek2-ocr.expert_feed_forward_length")
    if not d.has_key("deepseek2-ocr.expert_shared_count") and shexp is not None and n_ff_exp:
        d.set_u32("deepseek2-ocr.expert_shared_count", shexp.shape[0] // n_ff_exp)
    for prefix in ("s.", "v.", "mm."):
        d.add_skip_prefix(prefix)


# handle_deepseekocr_clip: deepseekocr.* -> clip.vision.* (u32).
DEEPSEEKOCR_CLIP_COPIES = (
    ("deepseekocr.vision.block_count", "clip.vision.block_count"),
    ("deepseekocr.vision.embedding_length", "clip.vision.embedding_length"),
    ("deepseekocr.vision.head_count", "clip.vision.attention.head_count"),
    ("deepseekocr.vision.image_size", "clip.vision.image_size"),
    ("deepseekocr.vision.patch_size", "clip.vision.patch_size"),
    ("deepseekocr.sam.block_count", "clip.vision.sam.block_count"),
    ("deepseekocr.sam.embedding_length", "clip.vision.sam.embedding_length"),
    ("deepseekocr.sam.head_count", "clip.vision.sam.head_count"),
)
# handle_deepseekocr_clip: defaults of llama.cpp's reference DeepSeek-OCR mmproj.
DEEPSEEKOCR_CLIP_DEFAULTS_U32 = (
    ("clip.vision.feed_forward_length", 64),
    ("clip.vision.projection_dim", 1280),
    ("clip.vision.projector.scale_factor", 1),
    ("clip.vision.window_size", 14),
)
# kDeepseekocrClipRenames: substring renames, in this order, first occurrence each: CLIP
# block leaves, SAM block leaves (once under v.sam.), then the projector.
DEEPSEEKOCR_CLIP_RENAMES = (
    (".self_attn.out_proj", ".attn_out"),
    (".self_attn.qkv_proj", ".attn_qkv"),
    (".layer_norm1", ".ln1"),
    (".layer_norm2", ".ln2"),
    (".mlp.fc1", ".ffn_up"),
    (".mlp.fc2", ".ffn_down"),
    ("v.pre_layrnorm", "v.pre_ln"),  # sic: the published spelling
    (".attn.proj", ".attn.out"),
    (".attn.rel_pos_h", ".attn.pos_h.weight"),
    (".attn.rel_pos_w", ".attn.pos_w.weight"),
    (".norm1", ".pre_ln"),
    (".norm2", ".post_ln"),
    ("mm.layers", "mm.model.fc"),
    ("mm.image_newline", "v.image_newline"),
    ("mm.view_seperator", "v.view_seperator"),  # sic: llama.cpp's name
)


def handle_deepseekocr_clip(d: Draft) -> None:
    """handle_deepseekocr_clip: the SAM encoder (s.), CLIP encoder (v.) and projector (mm.)
    of a monolithic deepseekocr GGUF as one deepseekocr mmproj."""
    for src, dst in DEEPSEEKOCR_CLIP_COPIES:
        d.copy_kv(src, dst, T_UINT32)
    for key, value in DEEPSEEKOCR_CLIP_DEFAULTS_U32:
        d.inject_u32(key, value)
    d.inject_f32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    d.inject_f32_array("clip.vision.image_mean", (0.5, 0.5, 0.5))
    d.inject_f32_array("clip.vision.image_std", (0.5, 0.5, 0.5))
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_gelu", True)
    d.set_str("clip.projector_type", "deepseekocr")
    d.set_str("general.architecture", "clip")
    # SAM moves under v.sam. by its leading "s." only (a substring rename would also hit
    # names like mm.layers.weight).
    for name in [n for n in d.tensors if n.startswith("s.")]:
        d.rename_tensor(name, "v.sam." + name[2:])
    d.rename_tensor("v.sam.position_embd", "v.sam.pos_embd.weight")  # no .weight suffix
    for needle, replacement in DEEPSEEKOCR_CLIP_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    for name in ("v.patch_embd.weight", "v.sam.patch_embd.weight", "v.position_embd.weight"):
        d.promote_to_f32(name)
