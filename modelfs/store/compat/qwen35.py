"""The rules for qwen35, qwen35moe: part of the port of ollama/ollama `llama/compat/llama-ollama-
compat.cpp` (main @ fb30760) that store.compat.handlers dispatches to; each detector and handler
names the upstream function it mirrors.
"""

from __future__ import annotations

import re

from modelfs.store.compat.draft import GGML_F16, GGML_F32, Compute, Draft
from modelfs.store.compat.markers import Markers
from modelfs.store.formats.gguf import (
    T_ARRAY,
    T_BOOL,
    T_INT32,
    T_UINT32,
    ArraySummary,
)

# --------------------------------------------------------------------------------------
# qwen35 / qwen35moe
# --------------------------------------------------------------------------------------

_QWEN35_KEYS = (
    ".vision.block_count",
    ".image_token_id",
    ".ssm.v_head_reordered",
    ".rope.mrope_interleaved",
)
# detect_ollama_qwen35moe (which also takes feed_forward_length) and detect_ollama_qwen35.
detect_qwen35moe = Markers(
    "qwen35moe",
    keys=tuple("qwen35moe" + k for k in (*_QWEN35_KEYS, ".feed_forward_length")),
    prefixes=("mtp.", "v."),
)
detect_qwen35 = Markers(
    "qwen35", keys=tuple("qwen35" + k for k in _QWEN35_KEYS), prefixes=("mtp.", "v.")
)
QWEN35_HIDDEN = ("v.", "mm.", "mtp.")
# rename_qwen35_mtp_tensors (one MTP layer): shared MTP tensors -> blk.<base>.<name>.
QWEN35_MTP_SHARED = (
    ("mtp.fc.weight", "nextn.eh_proj.weight"),
    ("mtp.pre_fc_norm_embedding.weight", "nextn.enorm.weight"),
    ("mtp.pre_fc_norm_hidden.weight", "nextn.hnorm.weight"),
    ("mtp.embed_tokens.weight", "nextn.embed_tokens.weight"),
    ("mtp.shared_head.head.weight", "nextn.shared_head_head.weight"),
    ("mtp.shared_head.norm.weight", "nextn.shared_head_norm.weight"),
    ("mtp.norm.weight", "nextn.shared_head_norm.weight"),
)
# merge_qwen35moe_mtp_expert_tensors: per-expert MTP tensors -> one stacked tensor.
QWEN35MOE_MTP_EXPERTS = (
    ("gate_proj.weight", "ffn_gate_exps.weight"),
    ("up_proj.weight", "ffn_up_exps.weight"),
    ("down_proj.weight", "ffn_down_exps.weight"),
)

_INDEXED = re.compile(r"(\d+)\.(.*)\Z", re.S)


def _index(name: str, prefix: str) -> tuple[int, str] | None:
    """parse_tensor_index: `<prefix><N>.<suffix>` -> (N, suffix)."""
    if not name.startswith(prefix):
        return None
    m = _INDEXED.match(name, len(prefix))
    return (int(m.group(1)), m.group(2)) if m else None


def collapse_to_max(d: Draft, key: str, fallback: int) -> None:
    """collapse_u32_array_to_max: a per-layer array becomes its largest value (as u32)."""
    item = d.kv.get(key)
    if item is None or item.vtype != T_ARRAY or isinstance(item.value, ArraySummary):
        return
    top = max((v & 0xFFFFFFFF for v in item.value), default=0) or fallback
    if top:
        d.set_u32(key, top)


def _qwen35_block_count(d: Draft, arch: str) -> int:
    """qwen35_text_block_count: one past the highest blk.N, else <arch>.block_count."""
    found = [i[0] for n in d.tensors if (i := _index(n, "blk.")) is not None]
    if found:
        return max(found) + 1
    return d.u32_value(f"{arch}.block_count") or 0


def _qwen35_mtp_layers(d: Draft) -> int:
    """qwen35_mtp_layer_count"""
    layers = [i[0] for n in d.tensors if (i := _index(n, "mtp.layers.")) is not None and i[1]]
    if layers:
        return max(layers) + 1
    return 1 if d.any_tensor_with_prefix("mtp.") else 0


def _shift_norm(name: str) -> bool:
    """qwen35_should_shift_norm_after_rename: these norms are stored as w - 1 by Ollama."""
    if name.endswith(".ssm_norm.weight"):
        return False
    return name.endswith(("_norm.weight", ".nextn.enorm.weight", ".nextn.hnorm.weight"))


def _rename_mtp(d: Draft, src: str, dst: str) -> None:
    """rename_qwen35_mtp_tensor"""
    if d.tensor(src) is None or d.tensor(dst) is not None:
        return
    d.rename_tensor(src, dst)
    if _shift_norm(dst):
        d.add_one_as_f32(dst)


def _merge_mtp_experts(d: Draft, layer: int, block: int, src_suffix: str, dst_suffix: str) -> bool:
    """register_qwen35moe_mtp_expert_merge: experts 0..n-1 stacked along a third axis."""
    prefix = f"mtp.layers.{layer}.mlp.experts."
    sources = sorted(
        (i[0], n) for n in d.tensors if (i := _index(n, prefix)) is not None and i[1] == src_suffix
    )
    if not sources or [e for e, _ in sources] != list(range(len(sources))):
        return False
    names = [n for _, n in sources]
    first = d.tensors[names[0]]
    if len(first.shape) != 2:
        return False
    for n in names:
        t = d.tensors[n]
        if t.ggml_type != first.ggml_type or t.shape != first.shape or t.computed:
            return False
    dest = f"blk.{block}.{dst_suffix}"
    ranges = d.concat_ranges(names)
    d.rename_tensor(names[0], dest)
    merged = d.tensors[dest]
    merged.data = ranges
    merged.shape = (*first.shape, len(names))
    return True


def _qwen35_mtp(d: Draft, arch: str) -> None:
    """apply_qwen35_mtp_fixes + rename_qwen35_mtp_tensors: legacy `mtp.*` tensors become the
    extra blocks llama.cpp's qwen3.5 loader reads as next-token-prediction layers."""
    nextn = _qwen35_mtp_layers(d)
    if nextn == 0:
        return
    if any(n.startswith("blk.") and ".nextn." in n for n in d.tensors):
        return  # already in llama.cpp's layout
    base = _qwen35_block_count(d, arch)
    if base == 0:
        d.notes.append("cannot infer the text block count; MTP tensors left hidden")
        return
    d.set_u32(f"{arch}.nextn_predict_layers", nextn)
    d.set_u32(f"{arch}.block_count", base + nextn)
    if arch == "qwen35moe":
        for i in range(nextn):
            for src, dst in QWEN35MOE_MTP_EXPERTS:
                _merge_mtp_experts(d, i, base + i, src, dst)
    renames = []
    for n in d.tensors:
        indexed = _index(n, "mtp.layers.")
        if indexed is None or not indexed[1] or indexed[0] >= nextn:
            continue
        if arch == "qwen35moe" and indexed[1].startswith("mlp.experts."):
            continue
        renames.append((n, f"blk.{base + indexed[0]}.{indexed[1]}"))
    for src, dst in renames:
        _rename_mtp(d, src, dst)
    if nextn != 1:
        if any(d.tensor(src) is not None for src, _ in QWEN35_MTP_SHARED):
            d.notes.append(f"shared MTP tensors cannot be shared across {nextn} layers; hidden")
        return
    for src, dst in QWEN35_MTP_SHARED:
        _rename_mtp(d, src, f"blk.{base}.{dst}")


def _qwen35_text(d: Draft, arch: str) -> None:
    """apply_qwen35_text_fixes"""
    # 1. head_count_kv: a per-layer array (0 for SSM layers) -> its largest value.
    collapse_to_max(d, f"{arch}.attention.head_count_kv", 2)
    # 2. M-RoPE sections: llama.cpp reads four; published files can hold three.
    key = f"{arch}.rope.dimension_sections"
    item = d.kv.get(key)
    if item is not None and isinstance(item.value, list) and len(item.value) == 3:
        d.set(key, T_ARRAY, [*item.value, 0], T_INT32)
    # 3. blk.N.ssm_dt -> blk.N.ssm_dt.bias (rename_qwen_ssm_dt_bias_tensors).
    for n in [n for n in d.tensors if n.endswith(".ssm_dt")]:
        d.rename_tensor(n, n + ".bias")
    # 4. embedded MTP tensors -> llama.cpp's nextn blocks.
    _qwen35_mtp(d, arch)
    # 5. vision, projector and untranslated MTP tensors are not the text model's.
    for prefix in QWEN35_HIDDEN:
        d.add_skip_prefix(prefix)


def handle_qwen35moe(d: Draft) -> None:
    """handle_qwen35moe"""
    _qwen35_text(d, "qwen35moe")


def handle_qwen35(d: Draft) -> None:
    """handle_qwen35"""
    _qwen35_text(d, "qwen35")


# kQwen35moeClipRenames: substring renames, in this order, first occurrence each.
QWEN35_CLIP_RENAMES = (
    ("v.pos_embed", "v.position_embd"),
    ("v.patch_embed", "v.patch_embd"),
    ("v.merger.norm", "v.post_ln"),
    ("v.merger.linear_fc1", "mm.0"),
    ("v.merger.linear_fc2", "mm.2"),
    (".mlp.linear_fc1", ".ffn_up"),
    (".mlp.linear_fc2", ".ffn_down"),
    (".norm1", ".ln1"),
    (".norm2", ".ln2"),
)
# handle_qwen35_like_clip: <arch>.<suffix> -> clip.vision.* (u32).
QWEN35_CLIP_COPIES = (
    (".vision.block_count", "clip.vision.block_count"),
    (".vision.embedding_length", "clip.vision.embedding_length"),
    (".vision.attention.head_count", "clip.vision.attention.head_count"),
    (".vision.patch_size", "clip.vision.patch_size"),
    (".vision.spatial_merge_size", "clip.vision.spatial_merge_size"),
    (".vision.num_channels", "clip.vision.num_channels"),
    (".embedding_length", "clip.vision.projection_dim"),
)
# handle_qwen35_like_clip: defaults of the Qwen3.5-35B-A3B reference mmproj.
QWEN35_CLIP_DEFAULTS_U32 = (
    ("clip.vision.feed_forward_length", 4304),
    ("clip.vision.image_size", 768),
)


def merge_qkv(d: Draft, b: int, to_f32: bool = False) -> None:
    """register_qwen35moe_qkv_merge: vision block b's separate q, k, v (weights, and biases
    when present) become one attn_qkv, q's slot widened threefold along its slow axis, the
    bytes q then k then v (served as ranges of the source). k and v are then orphans.

    With `to_f32` (handle_qwen3vl_clip's loop), each part is made F32 from its own type
    first (register_concat_load_to_f32: Qwen3-VL files mix F16 q/k with a Q8_0 v), so the
    merged tensor is F32 and computed on first read."""
    for part in ("weight", "bias"):
        names = [f"v.blk.{b}.attn_{x}.{part}" for x in "qkv"]
        ts = [d.tensor(n) for n in names]
        if ts[0] is None:
            if part == "weight":
                return  # no vision block at this index
            continue
        if any(t is None or t.computed for t in ts):
            d.notes.append(f"v.blk.{b}: attn q/k/v {part} incomplete; not merged")
            continue
        if any(t.shape != ts[0].shape for t in ts):  # type: ignore[union-attr]
            d.notes.append(f"v.blk.{b}: attn q/k/v {part} differ in shape; not merged")
            continue
        data = d.concat_to_f32(names) if to_f32 else d.concat_ranges(names)
        if data is None:
            continue
        dest = f"v.blk.{b}.attn_qkv.{part}"
        d.rename_tensor(names[0], dest)
        t = d.tensors[dest]
        t.data = data
        if to_f32:
            t.ggml_type = GGML_F32
        axis = 1 if part == "weight" else 0  # the slow axis
        t.shape = tuple(n * 3 if i == axis else n for i, n in enumerate(t.shape))
        for orphan in names[1:]:
            if not (b == 0 and orphan.endswith("attn_k.weight")):  # reclaimed below
                d.drop_tensor(orphan)


def split_patch_embed(d: Draft, channels: int) -> None:
    """register_qwen35moe_patch_embed_split (and its qwen3vl twin): the F16 patch embedding
    [w, h, 2, c_out*c_in] becomes two F32 tensors [w, h, c_in, c_out], one per temporal
    slice: v.patch_embd.weight, and v.patch_embd.weight.1 in v.blk.0.attn_k.weight's slot."""
    name = "v.patch_embed.weight"
    t = d.tensor(name)
    if t is None:
        return
    if t.ggml_type != GGML_F16 or isinstance(t.data, Compute):
        d.notes.append(f"{name}: type {t.ggml_type}, expected F16; not split")
        return
    if len(t.shape) != 4:
        d.notes.append(f"{name}: shape {t.shape}; not split")
        return
    width, height, frames, packed = t.shape
    if channels <= 0 or frames != 2 or packed % channels:
        d.notes.append(f"{name}: shape {t.shape} with {channels} channels; not split")
        return
    shape = (width, height, channels, packed // channels)
    ((offset, length),) = t.data

    def piece(slice_idx: int) -> Compute:
        return Compute(
            "patch_embed_slice",
            ((offset, length),),
            (slice_idx, width * height, frames, packed),
            4 * width * height * packed,
        )

    d.rename_tensor(name, "v.patch_embd.weight")
    d.set_shape("v.patch_embd.weight", shape, GGML_F32)
    d.tensors["v.patch_embd.weight"].data = piece(0)
    d.reclaim("v.blk.0.attn_k.weight", "v.patch_embd.weight.1", shape, GGML_F32, piece(1))


def handle_qwen35_like_clip(d: Draft, arch: str) -> None:
    """handle_qwen35_like_clip: the Qwen3-VL-merger style projector of qwen35/qwen35moe."""
    for suffix, dst in QWEN35_CLIP_COPIES:
        d.copy_kv(arch + suffix, dst, T_UINT32)
    for key, value in QWEN35_CLIP_DEFAULTS_U32:
        d.inject_u32(key, value)
    d.inject_f32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    d.inject_f32_array("clip.vision.image_mean", (0.5, 0.5, 0.5))
    d.inject_f32_array("clip.vision.image_std", (0.5, 0.5, 0.5))
    # No deepstack layers, but the mask must be as long as the vision tower.
    n_blocks = d.u32_value("clip.vision.block_count")
    if not d.has_key("clip.vision.is_deepstack_layers") and n_blocks:
        d.set("clip.vision.is_deepstack_layers", T_ARRAY, [False] * n_blocks, T_BOOL)
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_gelu", True)
    d.set_str("clip.projector_type", "qwen3vl_merger")
    d.set_str("general.architecture", "clip")
    # The QKV merge and the patch split find their sources by name: before the renames.
    for b in range(27 if n_blocks is None else n_blocks):
        merge_qkv(d, b)
    split_patch_embed(d, d.u32_value("clip.vision.num_channels") or 3)
    if d.tensor("v.blk.0.attn_qkv.weight") is not None:
        d.drop_tensor("v.blk.0.attn_k.weight")  # merged, and not reclaimed
    for needle, replacement in QWEN35_CLIP_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    d.promote_to_f32("v.position_embd.weight")


def handle_qwen35moe_clip(d: Draft) -> None:
    """handle_qwen35moe_clip"""
    handle_qwen35_like_clip(d, "qwen35moe")


def handle_qwen35_clip(d: Draft) -> None:
    """handle_qwen35_clip"""
    handle_qwen35_like_clip(d, "qwen35")
