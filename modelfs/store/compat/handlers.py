"""Per-architecture rules: which Ollama-layout GGUFs upstream llama.cpp refuses, and how to
translate them. A port of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @
fb30760): each detector and handler names the upstream function it mirrors; the tables are
the data those functions hold in code. The rules live in one module per family of
architectures (gemma, qwen35, mistral_llama, further_text, vision, nemotron_glm, with the
shared `Markers` in markers); this module holds upstream's dispatch order.

Text handlers run in the order of upstream's `translate_metadata` dispatch, each on the
architecture name as earlier handlers left it (gptoss renames itself to gpt-oss, so no later
rule sees "gptoss"). Clip handlers run in the order of `translate_clip_metadata`, the first
detector that matches wins; handle_missing_llava_projector_type runs before them, on a
separate projector file. Handlers not ported yet would be listed in NOT_PORTED (none now); a
file only such a handler reads gets no view (it is served raw).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from modelfs.store.compat.draft import Draft
from modelfs.store.compat.further_text import (
    detect_embeddinggemma,
    detect_gemma3n,
    detect_laguna,
    detect_lfm2,
    detect_olmo3,
    detect_qwen3next,
    detect_snowflake,
    handle_embeddinggemma,
    handle_gemma3n,
    handle_laguna,
    handle_lfm2,
    handle_olmo3,
    handle_qwen3next,
    handle_snowflake,
)
from modelfs.store.compat.gemma import (
    detect_gemma3,
    detect_gemma4,
    handle_gemma3,
    handle_gemma3_clip,
    handle_gemma4,
    handle_gemma4_clip,
)
from modelfs.store.compat.markers import VISION_PREFIXES
from modelfs.store.compat.mistral_llama import (
    detect_gptoss,
    detect_llama4,
    detect_mistral3,
    handle_gptoss,
    handle_llama4,
    handle_llama4_clip,
    handle_mistral3,
    handle_mistral3_clip,
)
from modelfs.store.compat.nemotron_glm import (
    detect_glmocr,
    detect_llama3,
    detect_nemotron_h_moe,
    detect_nemotron_h_omni,
    handle_glmocr,
    handle_glmocr_clip,
    handle_llama3,
    handle_nemotron_h_moe,
    handle_nemotron_h_omni,
    handle_nemotron_h_omni_clip,
)
from modelfs.store.compat.qwen35 import (
    detect_qwen35,
    detect_qwen35moe,
    handle_qwen35,
    handle_qwen35_clip,
    handle_qwen35moe,
    handle_qwen35moe_clip,
)
from modelfs.store.compat.vision import (
    detect_deepseekocr,
    detect_glm4moelite,
    detect_qwen3vl,
    detect_qwen25vl,
    handle_deepseekocr,
    handle_deepseekocr_clip,
    handle_glm4moelite,
    handle_qwen3vl,
    handle_qwen3vl_clip,
    handle_qwen25vl,
    handle_qwen25vl_clip,
    qwen3vl_markers,
)
from modelfs.store.formats.gguf import (
    T_BOOL,
)

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
    TextRule("qwen3vl", "handle_qwen3vl", qwen3vl_markers("qwen3vl"), handle_qwen3vl),
    TextRule("qwen3vlmoe", "handle_qwen3vl", qwen3vl_markers("qwen3vlmoe"), handle_qwen3vl),
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
