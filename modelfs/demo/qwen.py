"""`qwen3:0.6b` (Q8_0)."""

from __future__ import annotations

from modelfs.demo.ggufspec import Dims, GGUFSpec, Q, TensorSpec, arch_kv, general_kv
from modelfs.demo.vocab import CHATML_JINJA, CHATML_SPECIALS, bpe_vocab


def _qwen3_tensors(d: Dims, vocab: int) -> list[TensorSpec]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [TensorSpec("token_embd.weight", Q.Q8_0, (e, vocab))]
    for i in range(d.layers):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "attn_q.weight", Q.Q8_0, (e, q)),
            TensorSpec(b + "attn_q_norm.weight", Q.F32, (d.head_dim,)),
            TensorSpec(b + "attn_k.weight", Q.Q8_0, (e, kv)),
            TensorSpec(b + "attn_k_norm.weight", Q.F32, (d.head_dim,)),
            TensorSpec(b + "attn_v.weight", Q.Q8_0, (e, kv)),
            TensorSpec(b + "attn_output.weight", Q.Q8_0, (q, e)),
            TensorSpec(b + "ffn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "ffn_gate.weight", Q.Q8_0, (e, d.ff)),
            TensorSpec(b + "ffn_up.weight", Q.Q8_0, (e, d.ff)),
            TensorSpec(b + "ffn_down.weight", Q.Q8_0, (d.ff, e)),
        ]
    out.append(TensorSpec("output_norm.weight", Q.F32, (e,)))
    return out


def qwen3_gguf() -> GGUFSpec:
    dims = Dims(embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=256)
    vocab = bpe_vocab(CHATML_SPECIALS)
    kv = general_kv(
        "qwen3",
        "Qwen3 0.6B",
        params=751_632_384,
        file_type=7,
        basename="Qwen3",
        size_label="0.6B",
        license="apache-2.0",
    )
    kv.update(
        arch_kv(
            "qwen3",
            dims,
            40_960,
            {
                "attention.layer_norm_rms_epsilon": 1e-6,
                "rope.freq_base": 1_000_000.0,
            },
        )
    )
    kv.update(
        vocab.kv("qwen2", bos="<|endoftext|>", eos="<|im_end|>", add_bos=False, pad="<|endoftext|>")
    )
    kv["tokenizer.chat_template"] = CHATML_JINJA
    return GGUFSpec("qwen3", kv, _qwen3_tensors(dims, len(vocab.tokens)))
