"""The rules for gemma3, gemma4: part of the port of ollama/ollama `llama/compat/llama-ollama-
compat.cpp` (main @ fb30760) that store.compat.handlers dispatches to; each detector and handler
names the upstream function it mirrors.
"""

from __future__ import annotations

from modelfs.store.compat.draft import Draft
from modelfs.store.compat.markers import VISION_PREFIXES, Markers
from modelfs.store.formats.gguf import (
    T_FLOAT32,
    T_INT32,
    T_UINT32,
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
