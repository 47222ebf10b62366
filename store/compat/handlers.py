"""Per-architecture rules: which Ollama-layout GGUFs upstream llama.cpp refuses, and how to
translate them. A port of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @
fb30760): each detector and handler names the upstream function it mirrors; the tables are
the data those functions hold in code.

Text handlers run in the order of upstream's `translate_metadata` dispatch, each on the
architecture name as earlier handlers left it (gptoss renames itself to gpt-oss, so no later
rule sees "gptoss"). Clip handlers run in the order of `translate_clip_metadata`, the first
detector that matches wins. Architectures not ported yet are listed in NOT_PORTED; a file
of one of those gets no view (it is served raw, as before).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from store.compat.draft import Draft
from store.gguf import T_ARRAY, T_FLOAT32, T_INT32, T_UINT32, ArraySummary


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
        i = _index(n, "mtp.layers.")
        if i is None or not i[1] or i[0] >= nextn:
            continue
        if arch == "qwen35moe" and i[1].startswith("mlp.experts."):
            continue
        renames.append((n, f"blk.{base + i[0]}.{i[1]}"))
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


# detect_ollama_llama4: vision inline.
detect_llama4 = Markers("llama4", prefixes=VISION_PREFIXES)


def handle_llama4(d: Draft) -> None:
    """handle_llama4: text names already match; only the embedded vision is hidden."""
    for prefix in VISION_PREFIXES:
        d.add_skip_prefix(prefix)


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


# translate_metadata, in its order (unported handlers omitted; see NOT_PORTED).
TEXT_RULES: tuple[TextRule, ...] = (
    TextRule("gemma3", "handle_gemma3", detect_gemma3, handle_gemma3),
    TextRule("gemma4", "handle_gemma4", detect_gemma4, handle_gemma4),
    TextRule("qwen35moe", "handle_qwen35moe", detect_qwen35moe, handle_qwen35moe),
    TextRule("qwen35", "handle_qwen35", detect_qwen35, handle_qwen35),
    TextRule("gptoss", "handle_gptoss", detect_gptoss, handle_gptoss),
    TextRule("mistral3", "handle_mistral3", detect_mistral3, handle_mistral3),
    TextRule("llama4", "handle_llama4", detect_llama4, handle_llama4),
)

# translate_clip_metadata, in its order: the first detector that matches translates.
CLIP_RULES: tuple[ClipRule, ...] = (
    ClipRule("handle_gemma3_clip", detect_gemma3, handle_gemma3_clip, VISION_PREFIXES),
)

# Upstream handlers not ported yet (text, then clip): such files are served raw only.
NOT_PORTED = (
    "embeddinggemma",
    "bert (snowflake-arctic-embed2)",
    "gemma3n",
    "qwen3next",
    "laguna",
    "lfm2",
    "olmo3",
    "qwen25vl",
    "qwen3vl",
    "qwen3vlmoe",
    "glm4moelite",
    "deepseekocr",
    "nemotron_h_omni",
    "nemotron_h_moe",
    "llama (Llama 3 markers)",
    "glmocr",
    "clip: qwen35moe, qwen35, mistral3, deepseekocr, nemotron_h_omni, llama4, gemma4, "
    "glmocr, qwen25vl, qwen3vl, llava without projector type",
)

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
    """Run the first matching clip rule (translate_clip_metadata) on a fresh draft."""
    if not d.any_tensor_with_prefix("v."):
        return None
    for rule in CLIP_RULES:
        if rule.detect(d):
            rule.handle(d)
            d.handler = rule.name
            return rule
    return None
