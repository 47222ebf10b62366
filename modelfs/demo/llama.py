"""The llama-architecture models: `llama3.2:3b` (the GGUF llama.cpp loads vocabulary-only),
`someuser/tiny:q8` and `hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M`."""

from __future__ import annotations

from modelfs.demo.ggufspec import Dims, GGUFSpec, Q, TensorSpec, arch_kv, general_kv
from modelfs.demo.vocab import CHATML_JINJA, LLAMA3_JINJA, LLAMA3_SPECIALS, bpe_vocab, spm_vocab


def _llama_tensors(
    d: Dims, vocab: int, *, quant: Q, attn_v: Q, ffn_down: Q, embd: Q
) -> list[TensorSpec]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [TensorSpec("token_embd.weight", embd, (e, vocab))]
    out.append(TensorSpec("rope_freqs.weight", Q.F32, (d.head_dim // 2,)))
    for i in range(d.layers):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "attn_q.weight", quant, (e, q)),
            TensorSpec(b + "attn_k.weight", quant, (e, kv)),
            TensorSpec(b + "attn_v.weight", attn_v, (e, kv)),
            TensorSpec(b + "attn_output.weight", quant, (q, e)),
            TensorSpec(b + "ffn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "ffn_gate.weight", quant, (e, d.ff)),
            TensorSpec(b + "ffn_up.weight", quant, (e, d.ff)),
            TensorSpec(b + "ffn_down.weight", ffn_down, (d.ff, e)),
        ]
    out.append(TensorSpec("output_norm.weight", Q.F32, (e,)))
    return out


def llama32_gguf() -> GGUFSpec:
    """llama3.2:3b: the GGUF llama.cpp can load vocabulary-only (see the package docstring)."""
    dims = Dims(embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=512)
    vocab = bpe_vocab(LLAMA3_SPECIALS)
    kv = general_kv(
        "llama",
        "Llama 3.2 3B Instruct",
        params=3_212_749_888,
        file_type=15,
        basename="Llama-3.2",
        size_label="3B",
        license="llama3.2",
    )
    kv.update(
        arch_kv(
            "llama",
            dims,
            131_072,
            {
                "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.dimension_count": dims.head_dim,
                "rope.freq_base": 500_000.0,
                "vocab_size": len(vocab.tokens),
            },
        )
    )
    kv.update(vocab.kv("llama-bpe", bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True))
    kv["tokenizer.chat_template"] = LLAMA3_JINJA
    tensors = _llama_tensors(
        dims, len(vocab.tokens), quant=Q.Q4_K, attn_v=Q.Q6_K, ffn_down=Q.Q6_K, embd=Q.Q6_K
    )
    return GGUFSpec("llama", kv, tensors)


def tiny_gguf() -> GGUFSpec:
    dims = Dims(embd=128, layers=2, heads=2, kv_heads=1, head_dim=64, ff=256)
    vocab = spm_vocab(("<unk>", "<s>", "</s>"))
    kv = general_kv(
        "llama",
        "Tiny Story 15M",
        params=15_191_712,
        file_type=7,
        basename="tiny-story",
        size_label="15M",
        license="mit",
    )
    kv.update(
        arch_kv(
            "llama",
            dims,
            2048,
            {
                "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.dimension_count": dims.head_dim,
            },
        )
    )
    kv.update(vocab.kv(None, bos="<s>", eos="</s>", add_bos=True, unk="<unk>"))
    tensors = _llama_tensors(
        dims, len(vocab.tokens), quant=Q.Q8_0, attn_v=Q.Q8_0, ffn_down=Q.Q8_0, embd=Q.Q8_0
    )
    return GGUFSpec("llama", kv, tensors)


def smol_gguf() -> GGUFSpec:
    # 576 is not a multiple of 256, so llama.cpp's Q4_K_M falls back to Q5_0 / Q8_0 here.
    dims = Dims(embd=576, layers=1, heads=9, kv_heads=3, head_dim=64, ff=512)
    vocab = bpe_vocab(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"))
    kv = general_kv(
        "llama",
        "SmolLM2 135M Instruct",
        params=134_515_008,
        file_type=15,
        basename="SmolLM2",
        size_label="135M",
        license="apache-2.0",
    )
    kv["general.quantized_by"] = "bartowski"
    kv.update(
        arch_kv(
            "llama",
            dims,
            8192,
            {
                "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.dimension_count": dims.head_dim,
                "rope.freq_base": 100_000.0,
                "vocab_size": len(vocab.tokens),
            },
        )
    )
    kv.update(vocab.kv("smollm", bos="<|im_start|>", eos="<|im_end|>", add_bos=False))
    kv["tokenizer.chat_template"] = CHATML_JINJA
    tensors = _llama_tensors(
        dims, len(vocab.tokens), quant=Q.Q5_0, attn_v=Q.Q8_0, ffn_down=Q.Q8_0, embd=Q.Q8_0
    )
    return GGUFSpec("llama", kv, tensors)


SMOL_TEMPLATE = """\
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

TINY_TEMPLATE = "{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}"
TINY_SYSTEM = "You are a tiny storyteller. Answer with one short story for children."


MIT_LICENSE = "MIT License\n\nCopyright (c) 2026 someuser\n\n(modelfs demo store: abridged.)\n"
