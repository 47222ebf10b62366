"""The rules for embeddinggemma, gemma3n, snowflake-arctic-embed2 (bert), qwen3next, laguna, lfm2,
olmo3: part of the port of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @ fb30760)
that store.compat.handlers dispatches to; each detector and handler names the upstream function
it mirrors.
"""

from __future__ import annotations

import base64
import re

from modelfs.store.compat.draft import Compute, Draft
from modelfs.store.compat.markers import Markers
from modelfs.store.compat.qwen35 import collapse_to_max
from modelfs.store.formats.gguf import (
    T_ARRAY,
    T_FLOAT32,
    T_INT32,
    T_STRING,
    T_UINT8,
    T_UINT32,
    tensor_nbytes,
)

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
    collapse_to_max(d, "qwen3next.attention.head_count_kv", 0)
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
