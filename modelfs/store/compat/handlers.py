"""Per-architecture rules: which Ollama-layout GGUFs upstream llama.cpp refuses, and how to
translate them. A port of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @
fb30760): each detector and handler names the upstream function it mirrors; the tables are
the data those functions hold in code.

Text handlers run in the order of upstream's `translate_metadata` dispatch, each on the
architecture name as earlier handlers left it (gptoss renames itself to gpt-oss, so no later
rule sees "gptoss"). Clip handlers run in the order of `translate_clip_metadata`, the first
detector that matches wins; handle_missing_llava_projector_type runs before them, on a
separate projector file. Handlers not ported yet would be listed in NOT_PORTED (none now); a
file only such a handler reads gets no view (it is served raw).
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from modelfs.store.compat.draft import GGML_F16, GGML_F32, Compute, Draft
from modelfs.store.gguf import (
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_INT32,
    T_STRING,
    T_UINT8,
    T_UINT32,
    ArraySummary,
    tensor_nbytes,
)


@dataclass(frozen=True, slots=True)
class Markers:
    """What marks a GGUF of `arch` as Ollama's layout (a detect_ollama_<arch> as data): any
    one of these keys present, a tensor under one of these prefixes, one of these keys
    missing, or a string key holding one of these values."""

    arch: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    strings: tuple[tuple[str, str], ...] = ()
    always: bool = False  # the architecture name alone is the marker

    def __call__(self, d: Draft) -> bool:
        if d.str_value("general.architecture") != self.arch:
            return False
        return (
            self.always
            or any(d.has_key(k) for k in self.keys)
            or any(d.any_tensor_with_prefix(p) for p in self.prefixes)
            or any(not d.has_key(k) for k in self.missing)
            or any(d.string_equals(k, v) for k, v in self.strings)
        )


# --------------------------------------------------------------------------------------
# gemma3
# --------------------------------------------------------------------------------------

# Injected only when a file has no chat template. Upstream injects Gemma 3's own template;
# this one renders the same turns (<start_of_turn>role ... <end_of_turn>), which is also
# what llama.cpp's built-in template detection keys on.
GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# handle_gemma3: KV defaults injected when missing (standard Gemma 3 values).
GEMMA3_DEFAULTS_F32 = (
    ("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
    ("gemma3.rope.freq_base", 1_000_000.0),
    ("gemma3.rope.freq_base_swa", 10_000.0),
)
# handle_gemma3: nested rope names some converters wrote -> the flat names llama.cpp reads.
GEMMA3_ROPE_COPIES = (
    ("gemma3.rope.global.freq_base", "gemma3.rope.freq_base"),
    ("gemma3.rope.local.freq_base", "gemma3.rope.freq_base_swa"),
)
VISION_PREFIXES = ("v.", "mm.")


# detect_ollama_gemma3: one of the quirks of Ollama's converters (vision inline, nested
# rope names, extra tokenizer flags, no rms epsilon).
detect_gemma3 = Markers(
    "gemma3",
    keys=(
        "gemma3.mm.tokens_per_image",
        "gemma3.rope.global.freq_base",
        "gemma3.rope.local.freq_base",
        "tokenizer.ggml.add_padding_token",
        "tokenizer.ggml.add_unknown_token",
    ),
    prefixes=VISION_PREFIXES,
    missing=("gemma3.attention.layer_norm_rms_epsilon",),
)


def handle_gemma3(d: Draft) -> None:
    """handle_gemma3 (text side)."""
    for src, dst in GEMMA3_ROPE_COPIES:
        d.copy_kv(src, dst, T_FLOAT32)
    for key, value in GEMMA3_DEFAULTS_F32:
        d.inject_f32(key, value)
    d.inject_str("tokenizer.chat_template", GEMMA_TURN_TEMPLATE)
    # 4B/12B/27B extend a 16k context to 128k with linear rope scaling; 1B has none.
    ctx = d.u32_value("gemma3.context_length")
    if ctx is not None and ctx >= 131072:
        d.inject_str("gemma3.rope.scaling.type", "linear")
        d.inject_f32("gemma3.rope.scaling.factor", 8.0)
    # Ollama leaves multimodal tokens in the tokenizer arrays: cut them to token_embd's rows.
    embd = d.tensor("token_embd.weight")
    if embd is not None and len(embd.shape) >= 2:
        rows = embd.shape[1]
        d.truncate_array("tokenizer.ggml.tokens", rows)
        d.truncate_array("tokenizer.ggml.scores", rows, T_FLOAT32)
        d.truncate_array("tokenizer.ggml.token_type", rows, T_INT32)
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


# kGemma3ClipRenames: substring renames, applied in this order, first occurrence each.
GEMMA3_CLIP_RENAMES = (
    ("v.patch_embedding", "v.patch_embd"),
    ("v.position_embedding", "v.position_embd"),
    ("v.post_layernorm", "v.post_ln"),
    (".layer_norm1", ".ln1"),
    (".layer_norm2", ".ln2"),
    (".attn_output", ".attn_out"),
    (".mlp.fc1", ".ffn_down"),
    (".mlp.fc2", ".ffn_up"),
    ("mm.mm_input_projection", "mm.input_projection"),
    ("mm.mm_soft_emb_norm", "mm.soft_emb_norm"),
)
# handle_gemma3_clip: gemma3.* -> clip.vision.* (u32 unless marked f32).
GEMMA3_CLIP_COPIES = (
    ("gemma3.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("gemma3.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("gemma3.vision.feed_forward_length", "clip.vision.feed_forward_length", T_UINT32),
    ("gemma3.vision.image_size", "clip.vision.image_size", T_UINT32),
    ("gemma3.vision.patch_size", "clip.vision.patch_size", T_UINT32),
    ("gemma3.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    (
        "gemma3.vision.attention.layer_norm_epsilon",
        "clip.vision.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
    # The projector's output is the language model's input.
    ("gemma3.embedding_length", "clip.vision.projection_dim", T_UINT32),
)


def handle_gemma3_clip(d: Draft) -> None:
    """handle_gemma3_clip: the clip (mmproj) view of a monolithic gemma3 GGUF."""
    for src, dst, vtype in GEMMA3_CLIP_COPIES:
        d.copy_kv(src, dst, vtype)
    d.inject_f32_array("clip.vision.image_mean", (0.5, 0.5, 0.5))
    d.inject_f32_array("clip.vision.image_std", (0.5, 0.5, 0.5))
    d.inject_bool("clip.has_vision_encoder", True)
    d.inject_bool("clip.use_gelu", True)
    d.set_str("clip.projector_type", "gemma3")
    d.set_str("general.architecture", "clip")
    for needle, replacement in GEMMA3_CLIP_RENAMES:
        d.rename_tensors_containing(needle, replacement)
    # Upstream-converted projectors keep these two in F32 (Metal's IM2COL needs it).
    d.promote_to_f32("v.patch_embd.weight")
    d.promote_to_f32("v.position_embd.weight")


# --------------------------------------------------------------------------------------
# gemma4
# --------------------------------------------------------------------------------------

GEMMA4_HIDDEN = ("a.", "v.", "mm.", "model.vision_tower.")


# detect_ollama_gemma4: embedded audio/vision tensors, or the SPM tokenizer name. Split
# expert gate/up tensors alone are valid upstream and do not count.
detect_gemma4 = Markers(
    "gemma4", prefixes=GEMMA4_HIDDEN, strings=(("tokenizer.ggml.model", "llama"),)
)


def _gemma4_has_sidecars(d: Draft, b: int) -> bool:
    """has_gemma4_split_expert_sidecars: per-expert scales pin the split layout."""
    return any(
        d.tensor(f"blk.{b}.{name}") is not None
        for name in (
            "ffn_gate_exps.scale",
            "ffn_gate_exps.input_scale",
            "ffn_up_exps.scale",
            "ffn_up_exps.input_scale",
        )
    )


def _gemma4_fuse_gate_up(d: Draft, gate_n: str, up_n: str, fused_n: str) -> bool:
    """register_gemma4_moe_gate_up_load: gate and up experts interleaved per expert
    ([gate_0, up_0, gate_1, up_1, ...]) as one tensor of twice the FFN width. Each piece is
    a whole expert of a source tensor, so the fused tensor is served as source ranges."""
    gate, up = d.tensor(gate_n), d.tensor(up_n)
    if gate is None or up is None or d.tensor(fused_n) is not None:
        return False
    if gate.ggml_type != up.ggml_type or len(gate.shape) != 3 or gate.shape != up.shape:
        return False
    n_embd, n_ff, n_expert = gate.shape
    if n_expert <= 0 or gate.computed or up.computed:
        return False
    size = gate.nbytes
    if size != up.nbytes or size % n_expert:
        return False
    per = size // n_expert
    g_off, u_off = gate.source.offset, up.source.offset  # neither computed nor re-laid yet
    ranges: list[tuple[int, int]] = []
    for e in range(n_expert):
        ranges += [(g_off + e * per, per), (u_off + e * per, per)]
    d.rename_tensor(gate_n, fused_n)
    fused = d.tensors[fused_n]
    fused.data = tuple(ranges)
    fused.shape = (n_embd, 2 * n_ff, n_expert)
    return True


def handle_gemma4(d: Draft) -> None:
    """handle_gemma4 (text side)."""
    # Gemma 4 is BPE: llama.cpp's converter names its tokenizer "gemma4"; "llama" (SPM)
    # splits the control tokens. Ollama already ships merges and pre = gemma4.
    if d.string_equals("tokenizer.ggml.model", "llama"):
        d.set_str("tokenizer.ggml.model", "gemma4")
    for prefix in GEMMA4_HIDDEN:
        d.add_skip_prefix(prefix)
    blocks = d.u32_value("gemma4.block_count") or 0
    for b in range(blocks):
        gate, up = f"blk.{b}.ffn_gate_exps.weight", f"blk.{b}.ffn_up_exps.weight"
        if not _gemma4_has_sidecars(d, b) and _gemma4_fuse_gate_up(
            d, gate, up, f"blk.{b}.ffn_gate_up_exps.weight"
        ):
            d.add_skip_prefix(up)
        d.rename_tensor(f"blk.{b}.ffn_gate_inp.per_expert_scale", f"blk.{b}.ffn_down_exps.scale")


# handle_gemma4_clip: gemma4.vision.* -> clip.vision.* (u32 unless marked f32).
GEMMA4_CLIP_VISION_COPIES = (
    ("gemma4.vision.block_count", "clip.vision.block_count", T_UINT32),
    ("gemma4.vision.embedding_length", "clip.vision.embedding_length", T_UINT32),
    ("gemma4.vision.feed_forward_length", "clip.vision.feed_forward_length", T_UINT32),
    ("gemma4.vision.attention.head_count", "clip.vision.attention.head_count", T_UINT32),
    (
        "gemma4.vision.attention.layer_norm_epsilon",
        "clip.vision.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
    ("gemma4.vision.patch_size", "clip.vision.patch_size", T_UINT32),
)
# handle_gemma4_clip: gemma4.audio.* -> clip.audio.*.
GEMMA4_CLIP_AUDIO_COPIES = (
    ("gemma4.audio.block_count", "clip.audio.block_count", T_UINT32),
    ("gemma4.audio.embedding_length", "clip.audio.embedding_length", T_UINT32),
    ("gemma4.audio.feed_forward_length", "clip.audio.feed_forward_length", T_UINT32),
    ("gemma4.audio.attention.head_count", "clip.audio.attention.head_count", T_UINT32),
    (
        "gemma4.audio.attention.layer_norm_epsilon",
        "clip.audio.attention.layer_norm_epsilon",
        T_FLOAT32,
    ),
)
# handle_gemma4_clip: exact renames of the audio encoder's input/output projections, in
# this order (the first frees the name the second takes).
GEMMA4_CLIP_AUDIO_RENAMES = (
    ("a.pre_encode.out.weight", "a.input_projection.weight"),
    ("mm.a.fc.weight", "a.pre_encode.out.weight"),
    ("mm.a.fc.bias", "a.pre_encode.out.bias"),
)
# handle_gemma4_clip: per audio block a.blk.N.<from>.weight -> a.blk.N.<to>.weight, in this
# order (ln2 must move before layer_pre_norm takes its name).
GEMMA4_CLIP_AUDIO_BLOCK_RENAMES = (
    ("ln1", "attn_pre_norm"),
    ("ln2", "attn_post_norm"),
    ("layer_pre_norm", "ln2"),
    ("linear_pos", "attn_k_rel"),
)


def handle_gemma4_clip(d: Draft) -> None:
    """handle_gemma4_clip: the vision (gemma4v) and audio (gemma4a) encoders of a
    monolithic gemma4 GGUF as one mmproj."""
    d.set_str("general.architecture", "clip")
    has_vision, has_audio = d.any_tensor_with_prefix("v."), d.any_tensor_with_prefix("a.")
    if has_vision:
        for src, dst, vtype in GEMMA4_CLIP_VISION_COPIES:
            d.copy_kv(src, dst, vtype)
        d.inject_u32("clip.vision.image_size", 224)  # fixed 224x224 patches
        d.copy_kv("gemma4.embedding_length", "clip.vision.projection_dim", T_UINT32)
        # Gemma 4 normalizes images itself (v.std_bias / v.std_scale): identity stats.
        d.inject_f32_array("clip.vision.image_mean", (0.0, 0.0, 0.0))
        d.inject_f32_array("clip.vision.image_std", (1.0, 1.0, 1.0))
        d.inject_bool("clip.has_vision_encoder", True)
        d.set_str("clip.vision.projector_type", "gemma4v")
        d.promote_to_f32("v.patch_embd.weight")
    if has_audio:
        for src, dst, vtype in GEMMA4_CLIP_AUDIO_COPIES:
            d.copy_kv(src, dst, vtype)
        d.inject_u32("clip.audio.num_mel_bins", 128)
        d.copy_kv("gemma4.embedding_length", "clip.audio.projection_dim", T_UINT32)
        d.inject_bool("clip.has_audio_encoder", True)
        d.set_str("clip.audio.projector_type", "gemma4a")
        d.notes.append(
            "gemma4a audio: upstream llama.cpp sizes its output without Ollama's "
            "clip_n_mmproj_embd hook"
        )
        for old, new in GEMMA4_CLIP_AUDIO_RENAMES:
            d.rename_tensor(old, new)
        n_audio = d.u32_value("gemma4.audio.block_count")
        for b in range(12 if n_audio is None else n_audio):
            for old, new in GEMMA4_CLIP_AUDIO_BLOCK_RENAMES:
                d.rename_tensor(f"a.blk.{b}.{old}.weight", f"a.blk.{b}.{new}.weight")


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


def _collapse_to_max(d: Draft, key: str, fallback: int) -> None:
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
    _collapse_to_max(d, f"{arch}.attention.head_count_kv", 2)
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


# --------------------------------------------------------------------------------------
# embeddinggemma, gemma3n, snowflake-arctic-embed2 (bert)
# --------------------------------------------------------------------------------------


# detect_ollama_embeddinggemma: a gemma3 with the sentence-transformers dense head.
detect_embeddinggemma = Markers("gemma3", prefixes=("dense.0.weight",))

# handle_embeddinggemma: tensor renames to what llama.cpp's gemma-embedding loader reads.
EMBEDDINGGEMMA_RENAMES = (
    ("dense.0.weight", "dense_2.weight"),
    ("dense.1.weight", "dense_3.weight"),
    ("norm.weight", "output_norm.weight"),
)


def handle_embeddinggemma(d: Draft) -> None:
    """handle_embeddinggemma: gemma3 -> gemma-embedding (bidirectional attention, the dense
    projection loaded by name). Runs before handle_gemma3, which then no longer applies."""
    d.arch = "gemma-embedding"
    d.set_str("general.architecture", "gemma-embedding")
    d.rename_kv_prefix("gemma3.", "gemma-embedding.")  # copies; the gemma3.* keys stay
    d.remove("gemma-embedding.attention.causal")
    d.remove("gemma-embedding.attention.sliding_window_pattern")
    d.inject_f32("gemma-embedding.rope.freq_base_swa", 10_000.0)
    d0, d1 = d.tensor("dense.0.weight"), d.tensor("dense.1.weight")
    if d0 is not None and d1 is not None and len(d0.shape) >= 2 and len(d1.shape) >= 2:
        d.set_u32("gemma-embedding.dense_2_feat_in", d0.shape[0])
        d.set_u32("gemma-embedding.dense_2_feat_out", d0.shape[1])
        d.set_u32("gemma-embedding.dense_3_feat_in", d1.shape[0])
        d.set_u32("gemma-embedding.dense_3_feat_out", d1.shape[1])
    for old, new in EMBEDDINGGEMMA_RENAMES:
        d.rename_tensor(old, new)


def detect_gemma3n(d: Draft) -> bool:
    """detect_ollama_gemma3n: token_embd has more rows (multimodal tokens) than
    per_layer_token_embd."""
    if d.str_value("general.architecture") != "gemma3n":
        return False
    te, pe = d.tensor("token_embd.weight"), d.tensor("per_layer_token_embd.weight")
    return (
        te is not None
        and pe is not None
        and len(te.shape) >= 2
        and len(pe.shape) >= 2
        and te.shape[1] != pe.shape[1]
    )


GEMMA3N_EOS_TURN = 106  # <end_of_turn>
LLAMA_TOKEN_TYPE_NORMAL, LLAMA_TOKEN_TYPE_BYTE = 1, 6
_BYTE_TOKEN = re.compile(r"<0x..>\Z", re.S)


def handle_gemma3n(d: Draft) -> None:
    """handle_gemma3n: the vocabulary cut to per_layer_token_embd's rows (token_embd too:
    the loader reads fewer rows from the same offset), SPM tokenizer, byte and <unused>
    token types, <end_of_turn> among the EOS ids."""
    pe, te = d.tensors["per_layer_token_embd.weight"], d.tensors["token_embd.weight"]
    target = pe.shape[1]
    d.set_str("tokenizer.ggml.model", "llama")
    if target < te.shape[1] and not isinstance(te.data, Compute):
        # The first `target` rows: a prefix of the source bytes.
        shape = (te.shape[0], target, *te.shape[2:])
        ((offset, _),) = te.data
        te.data = ((offset, tensor_nbytes(shape, te.ggml_type)),)
        te.shape = shape
    else:
        d.notes.append(f"token_embd has {te.shape[1]} rows, fewer than {target}; left as is")
    d.truncate_array("tokenizer.ggml.tokens", target)
    d.truncate_array("tokenizer.ggml.scores", target, T_FLOAT32)
    d.truncate_array("tokenizer.ggml.token_type", target, T_INT32)
    types_item = d.kv.get("tokenizer.ggml.token_type")
    if (
        d.has_key("tokenizer.ggml.tokens")
        and types_item is not None
        and types_item.vtype == T_ARRAY
        and types_item.item_type == T_INT32
    ):
        tokens = d.array_items("tokenizer.ggml.tokens") or []
        types = (d.array_items("tokenizer.ggml.token_type") or [])[:target]
        for i, tok in enumerate(tokens[: len(types)]):
            if isinstance(tok, str) and len(tok.encode()) == 6 and _BYTE_TOKEN.match(tok):
                types[i] = LLAMA_TOKEN_TYPE_BYTE
            elif isinstance(tok, str) and tok.startswith("<unused"):
                types[i] = LLAMA_TOKEN_TYPE_NORMAL
        d.set("tokenizer.ggml.token_type", T_ARRAY, types, T_INT32)
    eos = d.kv.get("tokenizer.ggml.eos_token_ids")
    if eos is not None and eos.vtype == T_ARRAY:
        if eos.item_type in (T_INT32, T_UINT32):
            ids = d.array_items("tokenizer.ggml.eos_token_ids") or []
            if GEMMA3N_EOS_TURN not in ids:
                ids.append(GEMMA3N_EOS_TURN)
            d.set("tokenizer.ggml.eos_token_ids", T_ARRAY, ids, eos.item_type)
    else:
        d.set("tokenizer.ggml.eos_token_ids", T_ARRAY, [1, GEMMA3N_EOS_TURN], T_INT32)


CHARSMAP = "tokenizer.ggml.precompiled_charsmap"
_BASE64 = re.compile(r"[A-Za-z0-9+/]*\Z")


def _snowflake_charsmap(d: Draft) -> bytes | None:
    """The precompiled charsmap some published snowflake-arctic-embed2 GGUFs store as an
    array of one-character base64 strings, decoded (None when it is not that)."""
    if d.str_value("general.architecture") != "bert":
        return None
    if d.str_value("tokenizer.ggml.model") != "t5":
        return None
    item = d.kv.get(CHARSMAP)
    if item is None or item.vtype != T_ARRAY or item.item_type != T_STRING:
        return None
    chars = d.array_items(CHARSMAP)
    if chars is None or any(len(c.encode()) != 1 for c in chars):
        return None  # upstream logs and leaves it
    text = "".join(chars).split("=", 1)[0]
    if not _BASE64.match(text):
        return None
    text = text[: len(text) - (len(text) % 4 == 1)]  # 6 stray bits make no byte
    decoded = base64.b64decode(text + "=" * (-len(text) % 4))
    return decoded or None


def detect_snowflake(d: Draft) -> bool:
    """The conditions handle_snowflake_arctic_embed2 checks before it changes anything."""
    return _snowflake_charsmap(d) is not None


def handle_snowflake(d: Draft) -> None:
    """handle_snowflake_arctic_embed2: the charsmap as the raw u8 array llama.cpp reads."""
    decoded = _snowflake_charsmap(d)
    if decoded is not None:
        d.set(CHARSMAP, T_ARRAY, list(decoded), T_UINT8)


# --------------------------------------------------------------------------------------
# qwen3next, laguna, lfm2, olmo3
# --------------------------------------------------------------------------------------


def detect_qwen3next(d: Draft) -> bool:
    """detect_ollama_qwen3next: SSM dt tensors without their .bias suffix."""
    return d.str_value("general.architecture") == "qwen3next" and any(
        n.endswith(".ssm_dt") for n in d.tensors
    )


def handle_qwen3next(d: Draft) -> None:
    """handle_qwen3next"""
    _collapse_to_max(d, "qwen3next.attention.head_count_kv", 0)
    for n in [n for n in d.tensors if n.endswith(".ssm_dt")]:  # rename_qwen_ssm_dt_bias_tensors
        d.rename_tensor(n, n + ".bias")


# detect_ollama_laguna: the old SWA rope key names, or the old attention-gate name.
detect_laguna = Markers(
    "laguna",
    keys=("laguna.rope.swa.dimension_count", "laguna.rope.swa.freq_base"),
    prefixes=("blk.0.attn_g.weight",),
)


def handle_laguna(d: Draft) -> None:
    """handle_laguna"""
    d.copy_kv("laguna.rope.swa.dimension_count", "laguna.rope.dimension_count_swa", T_UINT32)
    d.copy_kv("laguna.rope.swa.freq_base", "laguna.rope.freq_base_swa", T_FLOAT32)
    for n in [n for n in d.tensors if n.endswith(".attn_g.weight")]:
        d.rename_tensor(n, n[: -len(".attn_g.weight")] + ".attn_gate.weight")


def detect_lfm2(d: Draft) -> bool:
    """detect_ollama_lfm2: output_norm where llama.cpp reads token_embd_norm."""
    return (
        d.str_value("general.architecture") == "lfm2"
        and d.tensor("output_norm.weight") is not None
        and d.tensor("token_embd_norm.weight") is None
    )


def handle_lfm2(d: Draft) -> None:
    """handle_lfm2"""
    d.rename_tensor("output_norm.weight", "token_embd_norm.weight")
    d.set_str("tokenizer.ggml.pre", "lfm2")
    # Some files claim a feed_forward_length their ffn_gate does not have.
    gate = d.tensor("blk.0.ffn_gate.weight")
    if gate is not None and len(gate.shape) >= 2:
        n_ff = gate.shape[1]
        item = d.kv.get("lfm2.feed_forward_length")
        if item is None or item.value != n_ff:
            d.set_u32("lfm2.feed_forward_length", n_ff)


# handle_olmo3 has no detector: every olmo3 file is translated (llama.cpp's olmo2 loader
# covers OLMo 3, sliding-window rope included).
detect_olmo3 = Markers("olmo3", always=True)


def handle_olmo3(d: Draft) -> None:
    """handle_olmo3"""
    d.set_str("general.architecture", "olmo2")
    d.rename_kv_prefix("olmo3.", "olmo2.")
    d.arch = "olmo2"


# --------------------------------------------------------------------------------------
# qwen25vl, qwen3vl / qwen3vlmoe, glm4moelite, deepseekocr
# --------------------------------------------------------------------------------------


def _pad_sections(d: Draft, src: str, dst: str, exactly_three: bool) -> None:
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
    _pad_sections(d, "qwen2vl.rope.mrope_section", "qwen2vl.rope.dimension_sections", False)
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


QWEN3VL_MROPE = (24, 20, 20, 0)  # handle_qwen3vl: Qwen3-VL's sections (head_dim 128)


def _detect_qwen3vl(arch: str) -> Markers:
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
    return any(_detect_qwen3vl(arch)(d) for arch in ("qwen3vl", "qwen3vlmoe"))


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
    _pad_sections(d, "glm4.rope.mrope_section", "glm4.rope.dimension_sections", True)
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


# --------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextRule:
    arch: str  # the architecture name as earlier rules left it
    name: str  # the upstream handler
    detect: Callable[[Draft], bool]
    handle: Callable[[Draft], None]


@dataclass(frozen=True, slots=True)
class ClipRule:
    name: str
    detect: Callable[[Draft], bool]
    handle: Callable[[Draft], None]
    keep: tuple[str, ...]  # tensor prefixes the clip loader reads
    skip: tuple[str, ...] = ()  # ... but not these


# translate_metadata, in its order. A rule applies to the architecture as earlier rules
# left it: embeddinggemma moves a gemma3 file to gemma-embedding, so handle_gemma3 does not
# see it; nemotron_h_omni moves to nemotron_h_moe, whose rule then runs too (harmlessly
# again, as upstream).
TEXT_RULES: tuple[TextRule, ...] = (
    TextRule("gemma3", "handle_embeddinggemma", detect_embeddinggemma, handle_embeddinggemma),
    TextRule("gemma3", "handle_gemma3", detect_gemma3, handle_gemma3),
    TextRule("bert", "handle_snowflake_arctic_embed2", detect_snowflake, handle_snowflake),
    TextRule("gemma3n", "handle_gemma3n", detect_gemma3n, handle_gemma3n),
    TextRule("gemma4", "handle_gemma4", detect_gemma4, handle_gemma4),
    TextRule("qwen35moe", "handle_qwen35moe", detect_qwen35moe, handle_qwen35moe),
    TextRule("qwen35", "handle_qwen35", detect_qwen35, handle_qwen35),
    TextRule("qwen3next", "handle_qwen3next", detect_qwen3next, handle_qwen3next),
    TextRule("laguna", "handle_laguna", detect_laguna, handle_laguna),
    TextRule("gptoss", "handle_gptoss", detect_gptoss, handle_gptoss),
    TextRule("lfm2", "handle_lfm2", detect_lfm2, handle_lfm2),
    TextRule("olmo3", "handle_olmo3", detect_olmo3, handle_olmo3),
    TextRule("mistral3", "handle_mistral3", detect_mistral3, handle_mistral3),
    TextRule("qwen25vl", "handle_qwen25vl", detect_qwen25vl, handle_qwen25vl),
    TextRule("qwen3vl", "handle_qwen3vl", _detect_qwen3vl("qwen3vl"), handle_qwen3vl),
    TextRule("qwen3vlmoe", "handle_qwen3vl", _detect_qwen3vl("qwen3vlmoe"), handle_qwen3vl),
    TextRule("glm4moelite", "handle_glm4moelite", detect_glm4moelite, handle_glm4moelite),
    TextRule("deepseekocr", "handle_deepseekocr", detect_deepseekocr, handle_deepseekocr),
    TextRule(
        "nemotron_h_omni", "handle_nemotron_h_omni", detect_nemotron_h_omni, handle_nemotron_h_omni
    ),
    TextRule(
        "nemotron_h_moe", "handle_nemotron_h_moe", detect_nemotron_h_moe, handle_nemotron_h_moe
    ),
    TextRule("llama", "handle_llama3_metadata", detect_llama3, handle_llama3),
    TextRule("llama4", "handle_llama4", detect_llama4, handle_llama4),
    TextRule("glmocr", "handle_glmocr", detect_glmocr, handle_glmocr),
)

# translate_clip_metadata, in its order: the first detector that matches translates. The
# detectors are the text side's, on the file as it is (the clip loader reads it afresh).
CLIP_RULES: tuple[ClipRule, ...] = (
    ClipRule("handle_gemma3_clip", detect_gemma3, handle_gemma3_clip, VISION_PREFIXES),
    ClipRule("handle_qwen35moe_clip", detect_qwen35moe, handle_qwen35moe_clip, VISION_PREFIXES),
    ClipRule("handle_qwen35_clip", detect_qwen35, handle_qwen35_clip, VISION_PREFIXES),
    ClipRule("handle_mistral3_clip", detect_mistral3, handle_mistral3_clip, VISION_PREFIXES),
    # SAM (s.) is renamed under v.sam. before the view keeps what the loader reads.
    ClipRule(
        "handle_deepseekocr_clip", detect_deepseekocr, handle_deepseekocr_clip, VISION_PREFIXES
    ),
    # Audio stays off (clip.has_audio_encoder = false): its a. and mm.a. tensors, which
    # upstream leaves unread in the clip context, are left out of the view.
    ClipRule(
        "handle_nemotron_h_omni_clip",
        detect_nemotron_h_omni,
        handle_nemotron_h_omni_clip,
        VISION_PREFIXES,
        skip=("mm.a.",),
    ),
    ClipRule("handle_llama4_clip", detect_llama4, handle_llama4_clip, VISION_PREFIXES),
    ClipRule("handle_gemma4_clip", detect_gemma4, handle_gemma4_clip, (*VISION_PREFIXES, "a.")),
    ClipRule("handle_glmocr_clip", detect_glmocr, handle_glmocr_clip, VISION_PREFIXES),
    ClipRule("handle_qwen25vl_clip", detect_qwen25vl, handle_qwen25vl_clip, VISION_PREFIXES),
    ClipRule("handle_qwen3vl_clip", detect_qwen3vl, handle_qwen3vl_clip, VISION_PREFIXES),
)


def detect_llava_without_type(d: Draft) -> bool:
    """needs_default_llava_projector_type: a clip file with a vision encoder and neither
    clip.projector_type nor clip.vision.projector_type (LLaVA / BakLLaVA projectors)."""
    has_vision = d.kv.get("clip.has_vision_encoder")
    return (
        d.string_equals("general.architecture", "clip")
        and has_vision is not None
        and has_vision.vtype == T_BOOL
        and bool(has_vision.value)
        and not d.has_key("clip.projector_type")
        and not d.has_key("clip.vision.projector_type")
    )


def handle_llava_without_type(d: Draft) -> None:
    """handle_missing_llava_projector_type: such a projector is LLaVA's two-layer MLP."""
    d.set_str("clip.projector_type", "mlp")


# handle_missing_llava_projector_type runs before every other clip rule and before the
# check for v. tensors; it needs general.architecture "clip", which no other rule's
# detector takes, so at most one rule applies to a file. The view keeps every tensor.
LLAVA_RULE = ClipRule(
    "handle_missing_llava_projector_type",
    detect_llava_without_type,
    handle_llava_without_type,
    ("",),
)

# Upstream handlers not ported yet: a file only they would translate gets no view (text)
# or no mmproj view (clip). Every one is ported now.
NOT_PORTED: tuple[str, ...] = ()

# Architectures some text rule starts from: anything else cannot need a view.
TEXT_ARCHES = frozenset(r.arch for r in TEXT_RULES)


def translate_text(d: Draft) -> bool:
    """Run the text rules (translate_metadata); True if any of them applied."""
    applied = []
    for rule in TEXT_RULES:
        if d.arch == rule.arch and rule.detect(d):
            rule.handle(d)
            applied.append(rule.name)
    d.handler = ", ".join(applied)
    return bool(applied)


def translate_clip(d: Draft) -> ClipRule | None:
    """Run the first matching clip rule (translate_clip_metadata) on a fresh draft: of a
    monolithic GGUF, or of a separate projector file."""
    if LLAVA_RULE.detect(d):
        LLAVA_RULE.handle(d)
        d.handler = LLAVA_RULE.name
        return LLAVA_RULE
    if not d.any_tensor_with_prefix("v."):
        return None
    for rule in CLIP_RULES:
        if rule.detect(d):
            rule.handle(d)
            d.handler = rule.name
            return rule
    return None
