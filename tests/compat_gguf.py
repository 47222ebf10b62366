"""Builders shared by the tests of llama.cpp views (tests/test_compat_*.py, tests/test_mtmd.py):
small GGUFs in the Ollama layout, and readers of what a view holds."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modelfs.demo.vocab import GEMMA_SPECIALS, spm_vocab  # noqa: E402
from modelfs.store.compat import CompatViews, compat_views  # noqa: E402
from modelfs.store.compat.compute import ComputeCache  # noqa: E402
from modelfs.store.compat.view import GGUFView  # noqa: E402

V = gguf.GGUFValueType
HEX = "ab" * 32

# (key, value, type[, item type])
KV = tuple[Any, ...]
# (name, numpy array), (name, numpy-order shape, ggml type name): raw random bytes, or
# (name, float array, ggml type name): the values quantized
Tensor = tuple[Any, ...]


def write_gguf(path: Path, arch: str, kvs: Sequence[KV], tensors: Sequence[Tensor]) -> Path:
    """A GGUF written by the reference writer, tensors filled with random data."""
    rng = np.random.default_rng(len(tensors))
    w = gguf.GGUFWriter(path, arch)
    for key, value, vtype, *sub in kvs:
        w.add_key_value(key, value, vtype, *sub)
    for spec in tensors:
        if len(spec) == 2:
            w.add_tensor(spec[0], spec[1])
            continue
        name, shape, type_name = spec
        qtype = gguf.GGMLQuantizationType[type_name]
        if isinstance(shape, np.ndarray):  # values, quantized by the reference quantizer
            w.add_tensor(name, gguf.quants.quantize(shape, qtype), raw_dtype=qtype)
            continue
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        *rows, cols = shape
        raw = rng.integers(0, 256, (*rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def f32(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def f16(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def tokenizer(n: int, model: str = "llama") -> list[KV]:
    return [
        ("tokenizer.ggml.model", model, V.STRING),
        ("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n)], V.ARRAY, V.STRING),
        ("tokenizer.ggml.scores", [float(-i) for i in range(n)], V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", [1] * n, V.ARRAY, V.INT32),
    ]


def materialize(view: GGUFView, tmp_path: Path, cache: ComputeCache | None = None) -> Path:
    """The view's bytes in a file, read in odd-sized pieces (as a reader through FUSE would)."""
    fd = os.open(view.source, os.O_RDONLY)
    try:
        chunks, off = [], 0
        while off < view.size:
            chunk = view.read(fd, off, 4093, cache)
            assert chunk
            chunks.append(chunk)
            off += len(chunk)
    finally:
        os.close(fd)
    out = tmp_path / f"{view.kind}-view.gguf"
    out.write_bytes(b"".join(chunks))
    assert out.stat().st_size == view.size
    return out


def bpe_tokenizer(vocab: Any, pre: str, **ids: int) -> list[KV]:
    """A GPT-2 style tokenizer's KVs from `modelfs.demo.vocab.bpe_vocab`; `ids` are
    `tokenizer.ggml.<name>_token_id` values."""
    return [
        ("tokenizer.ggml.model", "gpt2", V.STRING),
        ("tokenizer.ggml.pre", pre, V.STRING),
        ("tokenizer.ggml.tokens", list(vocab.tokens), V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", list(vocab.types), V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", list(vocab.merges), V.ARRAY, V.STRING),
        *((f"tokenizer.ggml.{k}_token_id", v, V.UINT32) for k, v in ids.items()),
    ]


def llama_cpp_loads_only_the_view(src: Path, tmp_path: Path) -> Any:
    """llama.cpp (vocab-only) refuses the Ollama-layout file and loads its view."""
    llama_cpp = pytest.importorskip("llama_cpp")
    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
    view = materialize(views_of(src).model, tmp_path)
    return llama_cpp.Llama(model_path=str(view), vocab_only=True, verbose=False)


def fields(reader: Any) -> dict[str, Any]:
    out = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        out[f.name] = f.contents()
    return out


def field_type(reader: Any, key: str) -> list[Any]:
    return list(reader.fields[key].types)


def tensors(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def raw(t: Any) -> bytes:
    return np.asarray(t.data).tobytes()


def views_of(path: Path) -> CompatViews:
    views = compat_views(path, HEX)
    assert views is not None
    return views


def check_aligned(reader: Any, alignment: int = 32) -> None:
    assert reader.data_offset % alignment == 0
    for t in reader.tensors:
        assert (t.data_offset - reader.data_offset) % alignment == 0


# -- through a real mount, and llama.cpp itself ------------------------------------------


def decoder_tensors(
    n_vocab: int,
    e: int,
    heads: int,
    kv_heads: int,
    ff: int,
    *,
    hd: int | None = None,
    output: bool = True,
    extra: dict[str, tuple[int, ...]] | None = None,
) -> list[Tensor]:
    """One llama-style decoder block of width `e` and the embeddings around it (F32, small
    values): enough for llama.cpp to load and run a text model. `extra` adds tensors."""
    hd = hd or e // heads
    shapes = {
        "token_embd.weight": (n_vocab, e),
        "output_norm.weight": (e,),
        **({"output.weight": (n_vocab, e)} if output else {}),
        "blk.0.attn_norm.weight": (e,),
        "blk.0.attn_q.weight": (heads * hd, e),
        "blk.0.attn_k.weight": (kv_heads * hd, e),
        "blk.0.attn_v.weight": (kv_heads * hd, e),
        "blk.0.attn_output.weight": (e, heads * hd),
        "blk.0.ffn_norm.weight": (e,),
        "blk.0.ffn_gate.weight": (ff, e),
        "blk.0.ffn_up.weight": (ff, e),
        "blk.0.ffn_down.weight": (e, ff),
        **(extra or {}),
    }
    return [(k, f32(*s, seed=i) * 0.02) for i, (k, s) in enumerate(shapes.items())]


def gemma3_runnable(
    tmp_path: Path, vision: Sequence[Tensor] | None = None, vision_kvs: Sequence[KV] = ()
) -> Path:
    """A tiny but complete gemma3 (one block, F32 weights, an SPM vocabulary) in Ollama's
    layout: vision tensors inline, nested rope names, no rms epsilon, 8 image tokens past
    the embedding rows. Upstream llama.cpp refuses it; its view loads and generates.
    `vision` and `vision_kvs` replace its three vision tensors and add KVs."""
    vocab = spm_vocab(GEMMA_SPECIALS)
    n = len(vocab.tokens)
    e, heads, kv_heads, hd, ff = 64, 2, 1, 32, 128
    kvs: list[KV] = [
        ("gemma3.context_length", 131072, V.UINT32),
        ("gemma3.embedding_length", e, V.UINT32),
        ("gemma3.block_count", 1, V.UINT32),
        ("gemma3.feed_forward_length", ff, V.UINT32),
        ("gemma3.attention.head_count", heads, V.UINT32),
        ("gemma3.attention.head_count_kv", kv_heads, V.UINT32),
        ("gemma3.attention.key_length", hd, V.UINT32),
        ("gemma3.attention.value_length", hd, V.UINT32),
        ("gemma3.attention.sliding_window", 512, V.UINT32),
        ("gemma3.rope.global.freq_base", 1e6, V.FLOAT32),
        ("gemma3.mm.tokens_per_image", 256, V.UINT32),
        ("gemma3.vision.block_count", 1, V.UINT32),
        ("gemma3.vision.embedding_length", 32, V.UINT32),
        ("tokenizer.ggml.model", "llama", V.STRING),
        (
            "tokenizer.ggml.tokens",
            [*vocab.tokens, *(f"<img{i}>" for i in range(8))],
            V.ARRAY,
            V.STRING,
        ),
        ("tokenizer.ggml.scores", [*(vocab.scores or ()), *[0.0] * 8], V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", [*vocab.types, *[3] * 8], V.ARRAY, V.INT32),
        ("tokenizer.ggml.bos_token_id", vocab.specials["<bos>"], V.UINT32),
        ("tokenizer.ggml.eos_token_id", vocab.specials["<eos>"], V.UINT32),
        ("tokenizer.ggml.add_padding_token", False, V.BOOL),
        *vision_kvs,
    ]
    ts = decoder_tensors(
        n,
        e,
        heads,
        kv_heads,
        ff,
        hd=hd,
        output=False,
        extra={
            "blk.0.attn_q_norm.weight": (hd,),
            "blk.0.attn_k_norm.weight": (hd,),
            "blk.0.post_attention_norm.weight": (e,),
            "blk.0.post_ffw_norm.weight": (e,),
        },
    )
    ts += (
        [
            ("v.patch_embedding.weight", f16(32, 3, 14, 14, seed=90)),
            ("v.position_embedding.weight", f16(4, 32, seed=91)),
            ("mm.mm_input_projection.weight", f16(e, 32, seed=92)),
        ]
        if vision is None
        else vision
    )
    return write_gguf(tmp_path / "gemma3-runnable.gguf", "gemma3", kvs, ts)


def check_renamed(got: dict[str, Any], source: dict[str, Any], renames: dict[str, str]) -> None:
    """Each view tensor `new` is source tensor `old`, byte for byte, same type and shape."""
    for new, old in renames.items():
        t, s = got[new], source[old]
        assert t.tensor_type == s.tensor_type, new
        assert list(t.shape) == list(s.shape), new
        assert raw(t) == raw(s), new


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# -- separate projectors (LLaVA's, without clip.projector_type) ---------------------------


def llava_projector(
    tmp_path: Path,
    *extra: KV,
    vision: bool = True,
    name: str = "llava-projector",
    width: int = 16,
    blocks: int = 1,
    tensors: Sequence[Tensor] | None = None,
) -> Path:
    """A LLaVA-style projector as Ollama ships it in a `projector` layer: a clip GGUF with
    a vision encoder and a LLaVA projector, but no projector type. `tensors` replace its
    few (a tower of `blocks` blocks of `width`)."""
    kvs: list[KV] = [
        ("clip.has_text_encoder", False, V.BOOL),
        ("clip.has_vision_encoder", vision, V.BOOL),
        ("clip.has_llava_projector", True, V.BOOL),
        ("clip.vision.image_size", 28, V.UINT32),
        ("clip.vision.patch_size", 14, V.UINT32),
        ("clip.vision.embedding_length", width, V.UINT32),
        ("clip.vision.block_count", blocks, V.UINT32),
        ("clip.vision.image_mean", CLIP_MEAN, V.ARRAY, V.FLOAT32),
        *extra,
    ]
    ts: list[Tensor] = (
        [
            ("v.patch_embd.weight", f16(16, 3, 14, 14, seed=1)),
            ("v.position_embd.weight", f16(5, 16, seed=2)),
            ("v.blk.0.attn_q.weight", f16(16, 16, seed=3)),
            ("mm.0.weight", f16(32, 16, seed=4)),
            ("mm.0.bias", f32(32, seed=5)),
            ("mm.2.weight", f16(32, 32, seed=6)),
        ]
        if tensors is None
        else list(tensors)
    )
    return write_gguf(tmp_path / f"{name}.gguf", "clip", kvs, ts)
