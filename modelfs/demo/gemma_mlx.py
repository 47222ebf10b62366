"""`gemma4:26b@mlx`: safetensors tensor blobs and Hugging Face JSON files, as Ollama's x/create
writes them."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from modelfs.demo.ggufspec import seeded_rng
from modelfs.demo.vocab import GEMMA_JINJA, GEMMA_SPECIALS, gemma_vocab
from modelfs.store.manifest import (
    go_marshal,
)


def _safetensors_blob(
    tensors: Sequence[tuple[str, str, Sequence[int], bytes]], metadata: dict[str, str] | None = None
) -> bytes:
    """A safetensors file the way Go's `BuildPackedSafetensorsReaderWithMetadata` writes it:
    the header is a marshalled map (keys sorted, `__metadata__` among them), each entry
    `{"dtype","shape","data_offsets"}`, padded with spaces to a multiple of 8; data in the
    order given, with no gaps."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    text = go_marshal(dict(sorted(header.items())))
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def _bf16(values: np.ndarray) -> bytes:
    return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()


def _bf16_tensor(name: str, shape: Sequence[int], *, norm: bool) -> bytes:
    rng = seeded_rng("mlx", name)
    n = int(np.prod(shape))
    values = 1.0 + 0.02 * rng.standard_normal(n) if norm else 0.02 * rng.standard_normal(n)
    return _safetensors_blob([(name, "BF16", shape, _bf16(values))])


def _nvfp4_tensor(name: str, out_features: int, in_features: int) -> bytes:
    """An NVFP4 weight as the prequantized (ModelOpt) import fuses it: `<name>` packed FP4 in
    U32 words [out, in/8], `<name>.scale` the E4M3 block scales relabelled U8 [out, in/16], and
    `<name>.global_scale` a scalar F32; metadata quant_type=nvfp4, group_size=16."""
    rng = seeded_rng("mlx", name)
    packed = rng.bytes(out_features * in_features // 2)
    # E4M3 bytes for block scales between 0.25 and 4 (exponent field 5..9, bias 7).
    scales = rng.integers(0x28, 0x48, size=out_features * in_features // 16, dtype=np.uint8)
    global_scale = np.float32(rng.uniform(1e-4, 1e-3)).astype("<f4").tobytes()
    return _safetensors_blob(
        [
            (name, "U32", (out_features, in_features // 8), packed),
            (name + ".scale", "U8", (out_features, in_features // 16), scales.tobytes()),
            (name + ".global_scale", "F32", (), global_scale),
        ],
        {"quant_type": "nvfp4", "group_size": "16"},
    )


def mlx_tensors() -> list[tuple[str, bytes]]:
    """(layer name, blob bytes) for the safetensors variant, sorted by name as Ollama plans."""
    hidden, heads, kv_heads, head_dim, inter, layers = 256, 4, 2, 64, 512, 2
    vocab = len(gemma_vocab(0).tokens)
    p = "model.language_model."
    out: list[tuple[str, bytes]] = []

    def bf16(name: str, *shape: int) -> None:
        out.append((name, _bf16_tensor(name, shape, norm="norm" in name)))

    def nvfp4(name: str, o: int, i: int) -> None:
        out.append((name, _nvfp4_tensor(name, o, i)))

    bf16(p + "embed_tokens.weight", vocab, hidden)
    bf16(p + "norm.weight", hidden)
    for n in range(layers):
        b = f"{p}layers.{n}."
        bf16(b + "input_layernorm.weight", hidden)
        bf16(b + "post_attention_layernorm.weight", hidden)
        bf16(b + "pre_feedforward_layernorm.weight", hidden)
        bf16(b + "post_feedforward_layernorm.weight", hidden)
        bf16(b + "self_attn.q_norm.weight", head_dim)
        bf16(b + "self_attn.k_norm.weight", head_dim)
        nvfp4(b + "self_attn.q_proj.weight", heads * head_dim, hidden)
        nvfp4(b + "self_attn.k_proj.weight", kv_heads * head_dim, hidden)
        nvfp4(b + "self_attn.v_proj.weight", kv_heads * head_dim, hidden)
        nvfp4(b + "self_attn.o_proj.weight", hidden, heads * head_dim)
        nvfp4(b + "mlp.gate_proj.weight", inter, hidden)
        nvfp4(b + "mlp.up_proj.weight", inter, hidden)
        nvfp4(b + "mlp.down_proj.weight", hidden, inter)
    # The draft (assistant) model's tensors, namespaced by the "draft." tensor prefix.
    bf16("draft.model.norm.weight", hidden)
    bf16("draft.model.layers.0.input_layernorm.weight", hidden)
    nvfp4("draft.model.layers.0.self_attn.q_proj.weight", heads * head_dim, hidden)
    nvfp4("draft.model.layers.0.mlp.down_proj.weight", hidden, inter)
    return sorted(out)


def _hf_json(obj: Any) -> bytes:
    """JSON as Hugging Face tooling saves it (indent 2, trailing newline); Ollama copies the
    source file's bytes into the blob."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def mlx_json_files() -> list[tuple[str, bytes]]:
    vocab = gemma_vocab(0)
    ids = vocab.specials
    text_config = {
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 262144,
        "final_logit_softcapping": 30.0,
        "vocab_size": len(vocab.tokens),
        "model_type": "gemma4_text",
    }
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config,
        "vision_config": {
            "hidden_size": 128,
            "image_size": 896,
            "patch_size": 14,
            "model_type": "gemma4_vision",
        },
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": ["lm_head", "model.language_model.embed_tokens"],
        },
    }
    added = [
        {
            "id": ids[s],
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s in GEMMA_SPECIALS
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                "<bos>": {"id": "<bos>", "ids": [ids["<bos>"]], "tokens": ["<bos>"]}
            },
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(vocab.tokens)},
            "merges": [m.split(" ", 1) for m in vocab.merges],
        },
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": GEMMA_JINJA,
        "model_max_length": 262144,
        "padding_side": "left",
        "tokenizer_class": "GemmaTokenizer",
    }
    generation_config = {
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }
    draft_config = dict(
        text_config, num_hidden_layers=1, architectures=["Gemma4AssistantForCausalLM"]
    )
    return [
        ("config.json", _hf_json(config)),
        ("generation_config.json", _hf_json(generation_config)),
        ("tokenizer.json", _hf_json(tokenizer)),
        ("tokenizer_config.json", _hf_json(tokenizer_config)),
        ("draft/config.json", _hf_json(draft_config)),
    ]
