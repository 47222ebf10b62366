"""Build a small but realistic Ollama model store, for tests, demos and benchmarks.

    build_demo_store(root) -> DemoStore          a few MB, well under 2 s
    build_demo_store(root, weight_bytes=4 << 30) the first model's GGUF is ~4 GiB
    python -m modelfs.demo DIR [--size small|64M|1G|4G] [--json]

What lands in the store (every blob through `store.blobs.BlobStore`, so nothing is half-written
and every name is its sha256):

`gemma4:26b`, as a store looks after Ollama's manifest-list migration:
    `manifests-v2/ollama.com/library/gemma4/26b` -> relative symlink to a manifest-list blob
    (`application/vnd.ollama.manifest.list.v2+json`) whose two children are references to
    manifest blobs:
      llamacpp / gguf         model.gguf (arch gemma4, Q4_K_M: Q4_K, Q6_K, F32 tensors, MoE
                              expert tensors), mmproj.gguf (arch clip, F16), draft.gguf (Q8_0),
                              template, license, params
      mlx / safetensors       one `application/vnd.ollama.image.tensor` layer per tensor, each a
                              safetensors blob laid out as Ollama's x/create writes it (NVFP4
                              packed weights with `.scale` and `.global_scale` companions, BF16
                              norms and embeddings), `application/vnd.ollama.image.json` layers
                              (config.json, tokenizer.json, tokenizer_config.json,
                              generation_config.json, draft/config.json), template, license,
                              params
    `manifests/registry.ollama.ai/library/gemma4/26b`, the legacy downgrade anchor: the
    llamacpp child's manifest plus layers that reference the list blob and both child manifest
    blobs, so an old Ollama's prune keeps them. It is hidden by the v2 entry.
`llama3.2:3b` (Q4_K_M) and `qwen3:0.6b` (Q8_0): legacy manifests sharing template and license
    blobs. **`llama3.2:3b`'s model blob is the one llama.cpp can load vocabulary-only**: arch
    `llama`, a byte-level BPE (`gpt2`, pre `llama-bpe`) vocabulary with all 256 byte tokens,
    merges whose every result is a token, and control tokens for bos/eos/eot. (In fact every
    model.gguf and draft.gguf here loaded in llama.cpp, vocabulary-only and with weights,
    when this was written: llama-cpp-python 0.3.36. The weights are noise; the mmproj was not
    tried.)
`someuser/tiny:q8`: a user namespace, with a system prompt layer.
`hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M`: another host; its 576-wide rows cannot use
    K-quants, so its Q4_K_M is Q5_0/Q8_0, as llama.cpp's quantizer falls back.

Blob bytes are deterministic (seeded generators, no clocks); manifest mtimes are fixed,
distinct dates so that "newest first" can be tested.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import io
import json
import os
import re
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    LAYER_PREFIX,
    MEDIA_CONFIG,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    go_marshal,
)
from modelfs.store.names import Name, parse_name

Q = gguf.GGMLQuantizationType

# Layer media types. store.manifest has only the prefix; these are Ollama's names.
MEDIA_MODEL = LAYER_PREFIX + "model"
MEDIA_PROJECTOR = LAYER_PREFIX + "projector"
MEDIA_DRAFT = LAYER_PREFIX + "draft"
MEDIA_TEMPLATE = LAYER_PREFIX + "template"
MEDIA_SYSTEM = LAYER_PREFIX + "system"
MEDIA_PARAMS = LAYER_PREFIX + "params"
MEDIA_LICENSE = LAYER_PREFIX + "license"
MEDIA_TENSOR = LAYER_PREFIX + "tensor"
MEDIA_JSON = LAYER_PREFIX + "json"

GEMMA = "gemma4:26b"
LLAMA = "llama3.2:3b"
QWEN = "qwen3:0.6b"
TINY = "someuser/tiny:q8"
SMOL = "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"
VOCAB_ONLY_MODEL = LLAMA
"""The model whose `model.gguf` llama.cpp can load with `vocab_only`."""

# 2026-01-01T00:00:00Z; manifests are dated whole days after it.
EPOCH = 1_767_225_600
DAY = 86_400

_ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT
_CHUNK = 4 << 20


# --------------------------------------------------------------------------------------------
# What was written


@dataclass(frozen=True, slots=True)
class DemoLayer:
    """One layer (or config) as it appears in a manifest."""

    media_type: str
    digest: Digest
    size: int
    name: str | None = None
    """The layer's `name` field (tensor and json layers)."""
    file: str | None = None
    """The file store.files makes of it in a model directory; None where its table is silent."""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": str(self.digest),
            "size": self.size,
        }
        if self.name:
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True)
class DemoManifest:
    """A runnable manifest: a named legacy file, a list child, or the legacy anchor."""

    key: str
    """`llama3.2:3b`, `gemma4:26b@llamacpp`, `gemma4:26b@mlx`, …"""
    name: Name
    runner: str | None
    format: str | None
    digest: Digest
    """sha256 of the manifest bytes: the model ID."""
    raw: bytes
    path: Path | None
    """The named manifest file; None for a list child, which is only a blob."""
    config: DemoLayer
    layers: tuple[DemoLayer, ...]
    mtime: float | None = None

    @property
    def size(self) -> int:
        """Layers plus config, as Ollama's Manifest.Size."""
        return self.config.size + sum(layer.size for layer in self.layers)

    def files(self) -> dict[str, Digest]:
        """Mount file name -> blob digest, for the layers that become files."""
        return {layer.file: layer.digest for layer in self.layers if layer.file}

    def layer(self, file: str) -> DemoLayer:
        for layer in self.layers:
            if layer.file == file:
                return layer
        raise KeyError(f"{self.key} has no layer that becomes {file!r}")


@dataclass(frozen=True, slots=True)
class DemoList:
    """A manifest list and the `manifests-v2/` entry that points at it."""

    name: Name
    digest: Digest
    raw: bytes
    path: Path
    children: tuple[tuple[str, str, Digest], ...]
    """(runner, format, child manifest digest), in list order."""
    mtime: float


@dataclass(frozen=True)
class DemoStore:
    """A summary of everything `build_demo_store` wrote, for tests to assert against."""

    root: Path
    names: tuple[str, ...]
    """Shortest names, newest first (the order `ollama list` shows)."""
    manifests: dict[str, DemoManifest]
    """Every runnable manifest by key: plain names, and `name@runner` for list children."""
    lists: dict[str, DemoList]
    anchors: dict[str, DemoManifest]
    """Legacy manifests that a v2 entry of the same name hides."""
    mtimes: dict[str, float]
    """Name -> mtime of the entry Ollama lists for it (the v2 link, else the legacy file)."""
    model_blob: Digest
    """The first model's main GGUF (`gemma4:26b@llamacpp` model.gguf); big with --size."""
    weight_bytes: int
    blobs: frozenset[Digest] = field(default_factory=frozenset)
    """Every blob written: layers, configs, child manifests, the list."""

    def manifest(self, key: str) -> DemoManifest:
        return self.manifests[key]

    def blob_path(self, digest: Digest) -> Path:
        return Layout(self.root).blob(digest)

    def variants(self, name: str) -> dict[str, DemoManifest]:
        """Runner -> manifest for a name: its list children, or its one manifest."""
        if name in self.lists:
            return {
                runner: self.manifests[f"{name}@{runner}"]
                for runner, _, _ in self.lists[name].children
            }
        m = self.manifests[name]
        return {m.runner or "": m}


# --------------------------------------------------------------------------------------------
# Deterministic bytes


def _rng(*parts: str | int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(str(p).encode()) for p in parts])


def _f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(2e-4, 4e-3, size=n).astype("<f2").view(np.uint8).reshape(n, 2)


# Byte offsets of the f16 scale fields inside one block, so the random blocks dequantize to
# small finite numbers instead of NaNs.
_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q5_0: (0,),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (gguf.GGML_QUANT_SIZES[Q.Q6_K][1] - 2,),
}


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    qtype: Q
    ne: tuple[int, ...]
    """ggml order: ne[0] is the row length."""

    @property
    def elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        assert self.ne[0] % block == 0, f"{self.name}: row {self.ne[0]} not a multiple of {block}"
        return self.elements // block * size

    def chunks(self, seed: str) -> Iterator[bytes | memoryview]:
        rng = _rng(seed, self.name)
        if self.qtype in (Q.F32, Q.F16):
            n = self.elements
            if "rope_freqs" in self.name or "output_scale" in self.name:
                values = np.ones(n)
            elif "norm" in self.name or self.name.endswith(".scale"):
                values = 1.0 + 0.02 * rng.standard_normal(n)
            else:
                values = 0.02 * rng.standard_normal(n)
            yield values.astype("<f4" if self.qtype == Q.F32 else "<f2").tobytes()
            return
        _, size = gguf.GGML_QUANT_SIZES[self.qtype]
        offsets = _SCALE_OFFSETS[self.qtype]
        total = self.nbytes // size
        per_chunk = max(1, _CHUNK // size)
        done = 0
        while done < total:
            n = min(per_chunk, total - done)
            blocks = np.frombuffer(bytearray(rng.bytes(n * size)), np.uint8).reshape(n, size)
            for off in offsets:
                blocks[:, off : off + 2] = _f16_scales(rng, n)
            yield blocks.data
            done += n


# --------------------------------------------------------------------------------------------
# GGUF files


@dataclass
class _GGUF:
    arch: str
    kv: dict[str, Any]
    tensors: list[_Tensor]

    def header(self) -> bytes:
        """Magic, KVs and tensor infos, written by the gguf package's own writer."""
        with tempfile.TemporaryDirectory(prefix="modelfs-demo-") as tmp:
            path = Path(tmp) / "header.gguf"
            w = gguf.GGUFWriter(path, self.arch)
            for key, value in self.kv.items():
                _add_kv(w, key, value)
            for t in self.tensors:
                if t.qtype == Q.F32:
                    w.add_tensor_info(t.name, t.ne[::-1], np.dtype(np.float32), t.nbytes)
                elif t.qtype == Q.F16:
                    w.add_tensor_info(t.name, t.ne[::-1], np.dtype(np.float16), t.nbytes)
                else:
                    block, size = gguf.GGML_QUANT_SIZES[t.qtype]
                    byte_shape = (*t.ne[:0:-1], t.ne[0] // block * size)
                    w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, t.qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            return path.read_bytes()

    def chunks(self, seed: str) -> Iterator[bytes | memoryview]:
        """The whole file: the header, then each tensor's data padded to the alignment."""
        head = self.header()
        yield head
        yield bytes(-len(head) % _ALIGN)
        for t in self.tensors:
            yield from t.chunks(seed)
            yield bytes(-t.nbytes % _ALIGN)


def _add_kv(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if key == "general.architecture":
        return
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        if key == "general.parameter_count" or value >= 1 << 32:
            w.add_uint64(key, value)
        else:
            w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF value for {key}: {type(value).__name__}")


# --- vocabularies --------------------------------------------------------------------------

# fmt: off
_WORDS = (
    "the", "and", "that", "this", "with", "model", "hello", "world", "ollama", "llama", "store",
    "token", "is", "in", "on", "of", "to", "a", "it", "ing", "er",
)
# fmt: on

TT = gguf.TokenType


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet, by byte value: printable Latin-1 bytes stand for
    themselves, every other byte for a code point from U+0100 up, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + shifted))
            shifted += 1
    return out


def _merge_chain(word: str, vocab: dict[str, int], tokens: list[str], merges: list[str]) -> None:
    """Add merges that build `word` left to right; every intermediate becomes a token."""
    cur = word[0]
    for ch in word[1:]:
        merged = cur + ch
        if merged not in vocab:
            merges.append(f"{cur} {ch}")
            vocab[merged] = len(tokens)
            tokens.append(merged)
        cur = merged


@dataclass(frozen=True, slots=True)
class _Vocab:
    model: str
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...]
    specials: dict[str, int]

    def kv(
        self,
        pre: str | None,
        *,
        bos: str,
        eos: str,
        add_bos: bool,
        pad: str | None = None,
        unk: str | None = None,
    ) -> dict[str, Any]:
        kv: dict[str, Any] = {"tokenizer.ggml.model": self.model}
        if pre:
            kv["tokenizer.ggml.pre"] = pre
        kv["tokenizer.ggml.tokens"] = list(self.tokens)
        if self.scores is not None:
            kv["tokenizer.ggml.scores"] = list(self.scores)
        kv["tokenizer.ggml.token_type"] = list(self.types)
        if self.merges:
            kv["tokenizer.ggml.merges"] = list(self.merges)
        kv["tokenizer.ggml.bos_token_id"] = self.specials[bos]
        kv["tokenizer.ggml.eos_token_id"] = self.specials[eos]
        if unk:
            kv["tokenizer.ggml.unknown_token_id"] = self.specials[unk]
        if pad:
            kv["tokenizer.ggml.padding_token_id"] = self.specials[pad]
        kv["tokenizer.ggml.add_bos_token"] = add_bos
        return kv


def _bpe_vocab(specials: Sequence[str]) -> _Vocab:
    """A byte-level BPE vocabulary (llama.cpp's `gpt2` model): all 256 byte tokens, merges
    for a few words with and without a leading space (Ġ), then control tokens."""
    alphabet = _byte_level_alphabet()
    tokens = list(alphabet)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []
    space = alphabet[ord(" ")]
    for word in _WORDS:
        _merge_chain(space + word, vocab, tokens, merges)
        if len(word) > 1:
            _merge_chain(word, vocab, tokens, merges)
    types = [int(TT.NORMAL)] * len(tokens)
    ids = {}
    for s in specials:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(int(TT.CONTROL))
    return _Vocab("gpt2", tuple(tokens), tuple(types), None, tuple(merges), ids)


def _spm_vocab(specials: Sequence[str], *, unused: int = 0) -> _Vocab:
    """A SentencePiece-style vocabulary (llama.cpp's `llama` model): control tokens, the 256
    `<0xXX>` byte-fallback tokens, letters, then ▁-prefixed words built by merges."""
    tokens: list[str] = []
    types: list[int] = []
    ids: dict[str, int] = {}
    for s in specials:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(int(TT.UNKNOWN if s == "<unk>" else TT.CONTROL))
    for i in range(unused):
        tokens.append(f"<unused{i}>")
        types.append(int(TT.USER_DEFINED))
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(int(TT.BYTE))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []
    for ch in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(tokens)
        tokens.append(ch)
    for word in _WORDS:
        _merge_chain("▁" + word, vocab, tokens, merges)
    types += [int(TT.NORMAL)] * (len(tokens) - len(types))
    scores = tuple(0.0 if t != TT.NORMAL else -float(i) for i, t in enumerate(types))
    return _Vocab("llama", tuple(tokens), tuple(types), scores, tuple(merges), ids)


# fmt: off
_GEMMA_SPECIALS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>",
    "<end_of_turn>", "<start_of_image>", "<end_of_image>",
)
# fmt: on
# fmt: off
_LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|python_tag|>",
)
# fmt: on
_CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_GEMMA_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_CHATML_JINJA = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- model shapes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Dims:
    embd: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    experts: int = 0
    ff_exp: int = 0
    unused_tokens: int = 0


def _row(qtype: Q, width: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return width // block * size


def _gemma_tensors(d: _Dims, vocab: int) -> list[_Tensor]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [
        _Tensor("token_embd.weight", Q.Q6_K, (e, vocab)),
        _Tensor("rope_freqs.weight", Q.F32, (d.head_dim // 2,)),
    ]
    for i in range(d.layers):
        b = f"blk.{i}."
        down = Q.Q6_K if i % 2 == 0 else Q.Q4_K  # Q4_K_M spends more bits on every other layer
        out += [
            _Tensor(b + "attn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "attn_q.weight", Q.Q4_K, (e, q)),
            _Tensor(b + "attn_q_norm.weight", Q.F32, (d.head_dim,)),
            _Tensor(b + "attn_k.weight", Q.Q4_K, (e, kv)),
            _Tensor(b + "attn_k_norm.weight", Q.F32, (d.head_dim,)),
            _Tensor(b + "attn_v.weight", Q.Q6_K, (e, kv)),
            _Tensor(b + "attn_output.weight", Q.Q4_K, (q, e)),
            _Tensor(b + "post_attention_norm.weight", Q.F32, (e,)),
            _Tensor(b + "ffn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "ffn_gate.weight", Q.Q4_K, (e, d.ff)),
            _Tensor(b + "ffn_up.weight", Q.Q4_K, (e, d.ff)),
            _Tensor(b + "ffn_down.weight", down, (d.ff, e)),
        ]
        if d.experts:  # the dense FFN above is the shared expert
            out += [
                _Tensor(b + "post_ffw_norm_1.weight", Q.F32, (e,)),
                _Tensor(b + "ffn_gate_inp.weight", Q.F32, (e, d.experts)),
                _Tensor(b + "ffn_gate_inp.scale", Q.F32, (e,)),
                _Tensor(b + "pre_ffw_norm_2.weight", Q.F32, (e,)),
                _Tensor(b + "ffn_gate_up_exps.weight", Q.Q4_K, (e, 2 * d.ff_exp, d.experts)),
                _Tensor(b + "ffn_down_exps.weight", down, (d.ff_exp, e, d.experts)),
                _Tensor(b + "ffn_down_exps.scale", Q.F32, (d.experts,)),
                _Tensor(b + "post_ffw_norm_2.weight", Q.F32, (e,)),
            ]
        out += [
            _Tensor(b + "post_ffw_norm.weight", Q.F32, (e,)),
            _Tensor(b + "layer_output_scale.weight", Q.F32, (1,)),
        ]
    out.append(_Tensor("output_norm.weight", Q.F32, (e,)))
    return out


def _llama_tensors(
    d: _Dims, vocab: int, *, quant: Q, attn_v: Q, ffn_down: Q, embd: Q
) -> list[_Tensor]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [_Tensor("token_embd.weight", embd, (e, vocab))]
    out.append(_Tensor("rope_freqs.weight", Q.F32, (d.head_dim // 2,)))
    for i in range(d.layers):
        b = f"blk.{i}."
        out += [
            _Tensor(b + "attn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "attn_q.weight", quant, (e, q)),
            _Tensor(b + "attn_k.weight", quant, (e, kv)),
            _Tensor(b + "attn_v.weight", attn_v, (e, kv)),
            _Tensor(b + "attn_output.weight", quant, (q, e)),
            _Tensor(b + "ffn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "ffn_gate.weight", quant, (e, d.ff)),
            _Tensor(b + "ffn_up.weight", quant, (e, d.ff)),
            _Tensor(b + "ffn_down.weight", ffn_down, (d.ff, e)),
        ]
    out.append(_Tensor("output_norm.weight", Q.F32, (e,)))
    return out


def _qwen3_tensors(d: _Dims, vocab: int) -> list[_Tensor]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [_Tensor("token_embd.weight", Q.Q8_0, (e, vocab))]
    for i in range(d.layers):
        b = f"blk.{i}."
        out += [
            _Tensor(b + "attn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "attn_q.weight", Q.Q8_0, (e, q)),
            _Tensor(b + "attn_q_norm.weight", Q.F32, (d.head_dim,)),
            _Tensor(b + "attn_k.weight", Q.Q8_0, (e, kv)),
            _Tensor(b + "attn_k_norm.weight", Q.F32, (d.head_dim,)),
            _Tensor(b + "attn_v.weight", Q.Q8_0, (e, kv)),
            _Tensor(b + "attn_output.weight", Q.Q8_0, (q, e)),
            _Tensor(b + "ffn_norm.weight", Q.F32, (e,)),
            _Tensor(b + "ffn_gate.weight", Q.Q8_0, (e, d.ff)),
            _Tensor(b + "ffn_up.weight", Q.Q8_0, (e, d.ff)),
            _Tensor(b + "ffn_down.weight", Q.Q8_0, (d.ff, e)),
        ]
    out.append(_Tensor("output_norm.weight", Q.F32, (e,)))
    return out


def _arch_kv(arch: str, d: _Dims, context: int, extra: dict[str, Any]) -> dict[str, Any]:
    """`<arch>.*` hyperparameters from the shapes, plus the given extra keys."""
    kv: dict[str, Any] = {
        f"{arch}.context_length": context,
        f"{arch}.embedding_length": d.embd,
        f"{arch}.block_count": d.layers,
        f"{arch}.feed_forward_length": d.ff,
        f"{arch}.attention.head_count": d.heads,
        f"{arch}.attention.head_count_kv": d.kv_heads,
        f"{arch}.attention.key_length": d.head_dim,
        f"{arch}.attention.value_length": d.head_dim,
    }
    kv.update({f"{arch}.{k}": v for k, v in extra.items()})
    return kv


def _general(
    arch: str,
    name: str,
    *,
    params: int,
    file_type: int,
    basename: str,
    size_label: str,
    license: str | None = None,
    kind: str = "model",
) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "general.architecture": arch,
        "general.type": kind,
        "general.name": name,
        "general.basename": basename,
        "general.size_label": size_label,
    }
    if license:
        kv["general.license"] = license
    kv["general.parameter_count"] = params
    kv["general.file_type"] = file_type
    if file_type not in (0, 1, 32):
        kv["general.quantization_version"] = 2
    return kv


_GEMMA_SMALL = _Dims(
    embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=256, experts=4, ff_exp=256
)


def _gemma_dims(weight_bytes: int) -> tuple[_Dims, int]:
    """Shapes and vocabulary size that make the gemma4 GGUF's tensor data ~weight_bytes.

    Width and depth grow in steps with the target; the expert FFN width (a multiple of 256,
    as K-quants need) takes most of the bytes, and the vocabulary (rows of token_embd, each
    a few KiB) makes up the rest.
    """
    base_vocab = len(_gemma_vocab(0).tokens)
    if weight_bytes <= 0:
        return _GEMMA_SMALL, base_vocab
    if weight_bytes < 256 << 20:
        embd, layers = 512, 4
    elif weight_bytes < 2 << 30:
        embd, layers = 1024, 8
    else:
        embd, layers = 2048, 12
    dims = _Dims(
        embd=embd,
        layers=layers,
        heads=embd // 128,
        kv_heads=embd // 256,
        head_dim=128,
        ff=2 * embd,
        experts=8,
        ff_exp=256,
    )

    def data_bytes(d: _Dims, vocab: int) -> int:
        return sum(t.nbytes + (-t.nbytes % _ALIGN) for t in _gemma_tensors(d, vocab))

    per_step = data_bytes(dataclasses.replace(dims, ff_exp=512), base_vocab) - data_bytes(
        dims, base_vocab
    )
    steps = max(0, (weight_bytes - data_bytes(dims, base_vocab)) // per_step)
    dims = dataclasses.replace(dims, ff_exp=256 * (1 + steps))
    row = _row(Q.Q6_K, embd)
    extra = max(0, weight_bytes - data_bytes(dims, base_vocab)) // row
    return dataclasses.replace(dims, unused_tokens=extra), base_vocab + extra


def _gemma_vocab(unused: int) -> _Vocab:
    return _spm_vocab(_GEMMA_SPECIALS, unused=unused)


def _gemma_attention_kv(d: _Dims) -> dict[str, Any]:
    """Sliding-window layers, five of every six, and always a global last layer."""
    pattern = [i % 6 != 5 and i != d.layers - 1 for i in range(d.layers)]
    return {
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.sliding_window": 1024,
        "attention.sliding_window_pattern": pattern,
        "attention.key_length_swa": d.head_dim,
        "attention.value_length_swa": d.head_dim,
        "embedding_length_per_layer_input": 0,
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
    }


def _gemma_gguf(weight_bytes: int) -> _GGUF:
    dims, vocab_size = _gemma_dims(weight_bytes)
    vocab = _gemma_vocab(dims.unused_tokens)
    assert len(vocab.tokens) == vocab_size
    kv = _general(
        "gemma4",
        "Gemma 4 26B A4B It",
        params=25_805_933_056,
        file_type=15,
        basename="gemma-4",
        size_label="26B-A4B",
        license="gemma",
    )
    kv.update(
        _arch_kv(
            "gemma4",
            dims,
            262_144,
            {
                "expert_count": dims.experts,
                "expert_used_count": 2,
                "expert_feed_forward_length": dims.ff_exp,
                "final_logit_softcapping": 30.0,
                **_gemma_attention_kv(dims),
            },
        )
    )
    kv.update(vocab.kv(None, bos="<bos>", eos="<eos>", add_bos=True, pad="<pad>", unk="<unk>"))
    kv["tokenizer.chat_template"] = _GEMMA_JINJA
    return _GGUF("gemma4", kv, _gemma_tensors(dims, vocab_size))


def _gemma_projector() -> _GGUF:
    kv = _general(
        "clip",
        "Gemma 4 26B A4B It",
        params=416_866_032,
        file_type=1,
        basename="gemma-4",
        size_label="26B-A4B",
        kind="mmproj",
    )
    width, ff, layers = 128, 256, 1
    kv.update(
        {
            "clip.has_vision_encoder": True,
            "clip.projector_type": "gemma4v",
            "clip.use_gelu": True,
            "clip.vision.image_size": 896,
            "clip.vision.patch_size": 14,
            "clip.vision.embedding_length": width,
            "clip.vision.feed_forward_length": ff,
            "clip.vision.projection_dim": 256,
            "clip.vision.block_count": layers,
            "clip.vision.attention.head_count": 2,
            "clip.vision.attention.layer_norm_epsilon": 1e-6,
            "clip.vision.image_mean": [0.5, 0.5, 0.5],
            "clip.vision.image_std": [0.5, 0.5, 0.5],
        }
    )
    tensors = [
        _Tensor("v.patch_embd.weight", Q.F16, (14, 14, 3, width)),
        _Tensor("v.patch_embd.bias", Q.F32, (width,)),
        _Tensor("v.position_embd.weight", Q.F16, (width, 64)),
    ]
    for i in range(layers):
        b = f"v.blk.{i}."
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors.append(_Tensor(b + part + ".weight", Q.F16, (width, width)))
            tensors.append(_Tensor(b + part + ".bias", Q.F32, (width,)))
        tensors += [
            _Tensor(b + "ln1.weight", Q.F32, (width,)),
            _Tensor(b + "ffn_up.weight", Q.F16, (width, ff)),
            _Tensor(b + "ffn_down.weight", Q.F16, (ff, width)),
            _Tensor(b + "ln2.weight", Q.F32, (width,)),
        ]
    tensors += [
        _Tensor("v.post_ln.weight", Q.F32, (width,)),
        _Tensor("mm.input_projection.weight", Q.F16, (width, 256)),
        _Tensor("mm.soft_emb_norm.weight", Q.F32, (width,)),
    ]
    return _GGUF("clip", kv, tensors)


def _gemma_draft() -> _GGUF:
    dims = _Dims(embd=256, layers=2, heads=4, kv_heads=1, head_dim=64, ff=256)
    vocab = _gemma_vocab(0)
    kv = _general(
        "gemma4",
        "Gemma 4 26B A4B Assistant",
        params=74_000_000,
        file_type=7,
        basename="gemma-4-assistant",
        size_label="74M",
    )
    kv.update(_arch_kv("gemma4", dims, 262_144, _gemma_attention_kv(dims)))
    kv.update(vocab.kv(None, bos="<bos>", eos="<eos>", add_bos=True, pad="<pad>", unk="<unk>"))
    tensors = [
        _Tensor(t.name, t.qtype if t.qtype == Q.F32 else Q.Q8_0, t.ne)
        for t in _gemma_tensors(dims, len(vocab.tokens))
    ]
    return _GGUF("gemma4", kv, tensors)


def _llama32_gguf() -> _GGUF:
    """llama3.2:3b: the GGUF llama.cpp can load vocabulary-only (see the module docstring)."""
    dims = _Dims(embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=512)
    vocab = _bpe_vocab(_LLAMA3_SPECIALS)
    kv = _general(
        "llama",
        "Llama 3.2 3B Instruct",
        params=3_212_749_888,
        file_type=15,
        basename="Llama-3.2",
        size_label="3B",
        license="llama3.2",
    )
    kv.update(
        _arch_kv(
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
    kv["tokenizer.chat_template"] = _LLAMA3_JINJA
    tensors = _llama_tensors(
        dims, len(vocab.tokens), quant=Q.Q4_K, attn_v=Q.Q6_K, ffn_down=Q.Q6_K, embd=Q.Q6_K
    )
    return _GGUF("llama", kv, tensors)


def _qwen3_gguf() -> _GGUF:
    dims = _Dims(embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=256)
    vocab = _bpe_vocab(_CHATML_SPECIALS)
    kv = _general(
        "qwen3",
        "Qwen3 0.6B",
        params=751_632_384,
        file_type=7,
        basename="Qwen3",
        size_label="0.6B",
        license="apache-2.0",
    )
    kv.update(
        _arch_kv(
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
    kv["tokenizer.chat_template"] = _CHATML_JINJA
    return _GGUF("qwen3", kv, _qwen3_tensors(dims, len(vocab.tokens)))


def _tiny_gguf() -> _GGUF:
    dims = _Dims(embd=128, layers=2, heads=2, kv_heads=1, head_dim=64, ff=256)
    vocab = _spm_vocab(("<unk>", "<s>", "</s>"))
    kv = _general(
        "llama",
        "Tiny Story 15M",
        params=15_191_712,
        file_type=7,
        basename="tiny-story",
        size_label="15M",
        license="mit",
    )
    kv.update(
        _arch_kv(
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
    return _GGUF("llama", kv, tensors)


def _smol_gguf() -> _GGUF:
    # 576 is not a multiple of 256, so llama.cpp's Q4_K_M falls back to Q5_0 / Q8_0 here.
    dims = _Dims(embd=576, layers=1, heads=9, kv_heads=3, head_dim=64, ff=512)
    vocab = _bpe_vocab(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"))
    kv = _general(
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
        _arch_kv(
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
    kv["tokenizer.chat_template"] = _CHATML_JINJA
    tensors = _llama_tensors(
        dims, len(vocab.tokens), quant=Q.Q5_0, attn_v=Q.Q8_0, ffn_down=Q.Q8_0, embd=Q.Q8_0
    )
    return _GGUF("llama", kv, tensors)


# --------------------------------------------------------------------------------------------
# Safetensors tensor blobs, as Ollama's x/create writes them


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
    rng = _rng("mlx", name)
    n = int(np.prod(shape))
    values = 1.0 + 0.02 * rng.standard_normal(n) if norm else 0.02 * rng.standard_normal(n)
    return _safetensors_blob([(name, "BF16", shape, _bf16(values))])


def _nvfp4_tensor(name: str, out_features: int, in_features: int) -> bytes:
    """An NVFP4 weight as the prequantized (ModelOpt) import fuses it: `<name>` packed FP4 in
    U32 words [out, in/8], `<name>.scale` the E4M3 block scales relabelled U8 [out, in/16], and
    `<name>.global_scale` a scalar F32; metadata quant_type=nvfp4, group_size=16."""
    rng = _rng("mlx", name)
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


def _mlx_tensors() -> list[tuple[str, bytes]]:
    """(layer name, blob bytes) for the safetensors variant, sorted by name as Ollama plans."""
    hidden, heads, kv_heads, head_dim, inter, layers = 256, 4, 2, 64, 512, 2
    vocab = len(_gemma_vocab(0).tokens)
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


def _mlx_json_files() -> list[tuple[str, bytes]]:
    vocab = _gemma_vocab(0)
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
        for s in _GEMMA_SPECIALS
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
        "chat_template": _GEMMA_JINJA,
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


# --------------------------------------------------------------------------------------------
# Templates, licenses, params (Ollama's Go templates; written for this store)

_GEMMA_TEMPLATE = """\
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if or (eq .Role "user") (eq .Role "system") }}<start_of_turn>user
{{ .Content }}<end_of_turn>
{{ if $last }}<start_of_turn>model
{{ end }}
{{- else if eq .Role "assistant" }}<start_of_turn>model
{{ .Content }}{{ if not $last }}<end_of_turn>
{{ end }}
{{- end }}
{{- end }}"""

_CHATML_TEMPLATE = """\
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
<|im_start|>{{ .Role }}
{{ .Content }}{{ if or (ne .Role "assistant") (not $last) }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""

_SMOL_TEMPLATE = """\
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

_TINY_TEMPLATE = "{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}"
_TINY_SYSTEM = "You are a tiny storyteller. Answer with one short story for children."

_APACHE = """\

                                 Apache License
                           Version 2.0, January 2004
                        http://www.apache.org/licenses/

   Licensed under the Apache License, Version 2.0 (the "License"); you may not use
   this model except in compliance with the License. The full text is at the address
   above. (modelfs demo store: an abridged notice, not the full license text.)
"""

_GEMMA_LICENSE = """\
Gemma Terms of Use

This model is provided under the Gemma Terms of Use, found at ai.google.dev/gemma/terms.
(modelfs demo store: an abridged notice, not the full terms.)
"""

_MIT = "MIT License\n\nCopyright (c) 2026 someuser\n\n(modelfs demo store: abridged.)\n"


def _params(**kw: Any) -> bytes:
    """A params layer: Go's json.Marshal of a map (sorted keys, HTML-escaped)."""
    return go_marshal(dict(sorted(kw.items())))


# --------------------------------------------------------------------------------------------
# Writing


class _ChunkReader(io.RawIOBase):
    """A read-only stream over an iterator of byte chunks (for BlobStore.put_stream)."""

    def __init__(self, chunks: Iterable[bytes | memoryview]) -> None:
        self._it = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = memoryview(next(self._it)).cast("B")
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _file_for(media_type: str, name: str | None) -> str | None:
    kind = media_type[len(LAYER_PREFIX) :] if media_type.startswith(LAYER_PREFIX) else None
    simple = {
        "model": "model.gguf",
        "projector": "mmproj.gguf",
        "draft": "draft.gguf",
        "template": "template.txt",
        "system": "system.txt",
        "params": "params.json",
        "license": "LICENSE",
    }
    if kind in simple:
        return simple[kind]
    if kind == "tensor" and name:
        return f"tensors/{name}.safetensors"
    if kind == "json" and name:
        return name
    return None


class _Writer:
    def __init__(self, root: Path) -> None:
        self.layout = Layout(root)
        self.store = BlobStore(self.layout)
        self.store.ensure_dirs()
        self.blobs: set[Digest] = set()

    def _layer(self, digest: Digest, media_type: str, name: str | None) -> DemoLayer:
        self.blobs.add(digest)
        size = self.layout.blob(digest).stat().st_size
        return DemoLayer(media_type, digest, size, name, _file_for(media_type, name))

    # builtins.bytes: inside this class `bytes` names the method below.
    def bytes(self, data: builtins.bytes, media_type: str, name: str | None = None) -> DemoLayer:
        return self._layer(self.store.put_bytes(data), media_type, name)

    def stream(
        self,
        chunks: Iterable[builtins.bytes | memoryview],
        media_type: str,
        name: str | None = None,
    ) -> DemoLayer:
        return self._layer(self.store.put_stream(_ChunkReader(chunks)), media_type, name)

    def gguf(self, spec: _GGUF, seed: str, media_type: str = MEDIA_MODEL) -> DemoLayer:
        return self.stream(spec.chunks(seed), media_type)

    def config(self, obj: dict[str, Any]) -> DemoLayer:
        return self.bytes(go_marshal(obj), MEDIA_CONFIG)

    def manifest_bytes(
        self,
        config: DemoLayer,
        layers: Sequence[DemoLayer],
        *,
        runner: str | None = None,
        fmt: str | None = None,
        newline: bool,
    ) -> builtins.bytes:
        obj: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config.as_json(),
            "layers": [layer.as_json() for layer in layers],
        }
        if runner:
            obj["runner"] = runner
        if fmt:
            obj["format"] = fmt
        return go_marshal(obj) + (b"\n" if newline else b"")


def _gguf_config(
    family: str,
    model_type: str,
    file_type: str,
    layers: Sequence[DemoLayer],
    *,
    rootfs: bool,
    **extra: Any,
) -> dict[str, Any]:
    """A ConfigV2 in Go's field order. Older pulls still carry `rootfs` (dropped upstream in
    2026-08); fresh ones do not."""
    obj: dict[str, Any] = {
        "model_format": "gguf",
        "model_family": family,
        "model_families": [family],
        "model_type": model_type,
        "file_type": file_type,
    }
    obj.update(extra)
    obj["architecture"] = "amd64"
    obj["os"] = "linux"
    if rootfs:
        obj["rootfs"] = {"type": "layers", "diff_ids": [str(layer.digest) for layer in layers]}
    return obj


def _legacy(
    w: _Writer, key: str, config: DemoLayer, layers: Sequence[DemoLayer], mtime: float
) -> DemoManifest:
    name = parse_name(key)
    raw = w.manifest_bytes(config, layers, newline=True)
    path = w.store.write_legacy_manifest(name, raw)
    os.utime(path, (mtime, mtime))
    return DemoManifest(
        key, name, None, None, Digest.of_bytes(raw), raw, path, config, tuple(layers), mtime
    )


def _build_gemma(
    w: _Writer, weight_bytes: int, mtime: float, anchor_mtime: float
) -> tuple[DemoList, dict[str, DemoManifest], DemoManifest]:
    name = parse_name(GEMMA)
    template = w.bytes(_GEMMA_TEMPLATE.encode(), MEDIA_TEMPLATE)
    license_ = w.bytes(_GEMMA_LICENSE.encode(), MEDIA_LICENSE)
    params = w.bytes(
        _params(stop=["<end_of_turn>"], temperature=1, top_k=64, top_p=0.95), MEDIA_PARAMS
    )
    capabilities = ["completion", "vision", "tools", "thinking"]

    # llamacpp / gguf
    gguf_layers = [
        w.gguf(_gemma_gguf(weight_bytes), "gemma4-26b"),
        w.gguf(_gemma_projector(), "gemma4-26b-mmproj", MEDIA_PROJECTOR),
        w.gguf(_gemma_draft(), "gemma4-26b-draft", MEDIA_DRAFT),
        template,
        license_,
        params,
    ]
    gguf_config = w.config(
        _gguf_config(
            "gemma4",
            "25.8B",
            "Q4_K_M",
            gguf_layers,
            rootfs=False,
            renderer="gemma4",
            parser="gemma4",
            requires="0.20.0",
            capabilities=capabilities,
        )
    )
    gguf_raw = w.manifest_bytes(
        gguf_config, gguf_layers, runner="llamacpp", fmt="gguf", newline=False
    )
    gguf_digest = w.bytes(gguf_raw, MEDIA_MANIFEST).digest

    # mlx / safetensors
    mlx_layers = [w.bytes(data, MEDIA_TENSOR, tname) for tname, data in _mlx_tensors()]
    mlx_layers += [w.bytes(data, MEDIA_JSON, fname) for fname, data in _mlx_json_files()]
    mlx_layers += [template, license_, params]
    mlx_config = w.config(
        {
            "model_format": "safetensors",
            "model_family": "gemma4",
            "model_families": ["gemma4"],
            "model_type": "25.8B",
            "file_type": "nvfp4",
            "renderer": "gemma4",
            "parser": "gemma4",
            "requires": "0.19.0",
            "capabilities": capabilities,
            "draft": {
                "model_format": "safetensors",
                "architecture": "Gemma4AssistantForCausalLM",
                "tensor_prefix": "draft.",
                "config": "draft/config.json",
            },
            "architecture": "",
            "os": "",
        }
    )
    mlx_raw = w.manifest_bytes(
        mlx_config, mlx_layers, runner="mlx", fmt="safetensors", newline=False
    )
    mlx_digest = w.bytes(mlx_raw, MEDIA_MANIFEST).digest

    children = (("llamacpp", "gguf", gguf_digest), ("mlx", "safetensors", mlx_digest))
    list_raw = go_marshal(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_LIST,
            "manifests": [
                {"mediaType": MEDIA_MANIFEST, "digest": str(d), "runner": r, "format": f}
                for r, f, d in children
            ],
        }
    )
    link = w.store.write_v2_manifest(name, list_raw)
    list_digest = Digest.of_bytes(list_raw)
    w.blobs.add(list_digest)
    os.utime(link, (mtime, mtime), follow_symlinks=False)
    the_list = DemoList(name, list_digest, list_raw, link, children, mtime)

    variants = {
        f"{GEMMA}@llamacpp": DemoManifest(
            f"{GEMMA}@llamacpp",
            name,
            "llamacpp",
            "gguf",
            gguf_digest,
            gguf_raw,
            None,
            gguf_config,
            tuple(gguf_layers),
        ),
        f"{GEMMA}@mlx": DemoManifest(
            f"{GEMMA}@mlx",
            name,
            "mlx",
            "safetensors",
            mlx_digest,
            mlx_raw,
            None,
            mlx_config,
            tuple(mlx_layers),
        ),
    }

    # The legacy anchor: the llamacpp child, plus references to the list and child manifest
    # blobs, so a pre-list Ollama's prune keeps them (written with json.Marshal, no newline).
    refs = [
        DemoLayer(MEDIA_LIST, list_digest, len(list_raw)),
        DemoLayer(MEDIA_MANIFEST, gguf_digest, len(gguf_raw)),
        DemoLayer(MEDIA_MANIFEST, mlx_digest, len(mlx_raw)),
    ]
    anchor_layers = (*gguf_layers, *refs)
    anchor_raw = w.manifest_bytes(
        gguf_config, anchor_layers, runner="llamacpp", fmt="gguf", newline=False
    )
    anchor_path = w.store.write_legacy_manifest(name, anchor_raw)
    os.utime(anchor_path, (anchor_mtime, anchor_mtime))
    anchor = DemoManifest(
        GEMMA,
        name,
        "llamacpp",
        "gguf",
        Digest.of_bytes(anchor_raw),
        anchor_raw,
        anchor_path,
        gguf_config,
        anchor_layers,
        anchor_mtime,
    )
    return the_list, variants, anchor


def build_demo_store(root: Path, *, weight_bytes: int = 0) -> DemoStore:
    """Write the demo store under `root` (created if needed) and say what was written.

    `weight_bytes` = 0 builds the small store; otherwise the first model's GGUF
    (`gemma4:26b@llamacpp` model.gguf) is about that many bytes, streamed to disk in chunks.
    Building again over the same root rewrites the same bytes.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    w = _Writer(root)
    # Newest first: gemma4:26b, qwen3, llama3.2, hf.co/…, someuser/tiny; the gemma4 anchor is
    # the oldest file of all (the pull the migration started from).
    when = {GEMMA: 5, QWEN: 4, LLAMA: 3, SMOL: 2, TINY: 1}
    mtimes = {key: float(EPOCH + days * DAY) for key, days in when.items()}

    the_list, manifests, anchor = _build_gemma(w, weight_bytes, mtimes[GEMMA], float(EPOCH))

    shared_template = w.bytes(_CHATML_TEMPLATE.encode(), MEDIA_TEMPLATE)
    shared_license = w.bytes(_APACHE.encode(), MEDIA_LICENSE)

    def add(
        key: str,
        spec: _GGUF,
        config: Callable[[list[DemoLayer]], dict[str, Any]],
        others: list[DemoLayer],
    ) -> None:
        layers = [w.gguf(spec, key), *others]
        manifests[key] = _legacy(w, key, w.config(config(layers)), layers, mtimes[key])

    add(
        LLAMA,
        _llama32_gguf(),
        lambda ls: _gguf_config("llama", "3.2B", "Q4_K_M", ls, rootfs=True),
        [
            shared_template,
            shared_license,
            w.bytes(
                _params(stop=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
                MEDIA_PARAMS,
            ),
        ],
    )
    add(
        QWEN,
        _qwen3_gguf(),
        lambda ls: _gguf_config("qwen3", "751.63M", "Q8_0", ls, rootfs=True),
        [
            shared_template,
            shared_license,
            w.bytes(
                _params(
                    repeat_penalty=1,
                    stop=["<|im_start|>", "<|im_end|>"],
                    temperature=0.6,
                    top_k=20,
                    top_p=0.95,
                ),
                MEDIA_PARAMS,
            ),
        ],
    )
    add(
        SMOL,
        _smol_gguf(),
        lambda ls: _gguf_config("llama", "134.52M", "Q4_K_M", ls, rootfs=True),
        [
            w.bytes(_SMOL_TEMPLATE.encode(), MEDIA_TEMPLATE),
            w.bytes(_params(stop=["<|im_start|>", "<|im_end|>"]), MEDIA_PARAMS),
        ],
    )
    add(
        TINY,
        _tiny_gguf(),
        lambda ls: _gguf_config("llama", "15.19M", "Q8_0", ls, rootfs=True),
        [
            w.bytes(_TINY_TEMPLATE.encode(), MEDIA_TEMPLATE),
            w.bytes(_TINY_SYSTEM.encode(), MEDIA_SYSTEM),
            w.bytes(_MIT.encode(), MEDIA_LICENSE),
            w.bytes(_params(num_ctx=2048, temperature=0.8), MEDIA_PARAMS),
        ],
    )

    names = tuple(sorted(when, key=lambda k: -when[k]))
    model_blob = manifests[f"{GEMMA}@llamacpp"].layer("model.gguf").digest
    return DemoStore(
        root=root,
        names=tuple(parse_name(n).shortest for n in names),
        manifests=manifests,
        lists={GEMMA: the_list},
        anchors={GEMMA: anchor},
        mtimes=mtimes,
        model_blob=model_blob,
        weight_bytes=weight_bytes,
        blobs=frozenset(w.blobs),
    )


# --------------------------------------------------------------------------------------------
# Command line

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`small` (or 0) -> 0; `64M`, `1G`, `4GiB`, `1.5G`, `1048576` -> bytes (binary units)."""
    text = text.strip()
    if text.lower() in ("small", "0", ""):
        return 0
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"bad size {text!r} (want small, or a number with K, M, G or T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _summary(demo: DemoStore) -> dict[str, Any]:
    return {
        "root": str(demo.root),
        "names": list(demo.names),
        "manifests": {k: m.digest.hex for k, m in demo.manifests.items()},
        "lists": {k: v.digest.hex for k, v in demo.lists.items()},
        "model_blob": str(demo.blob_path(demo.model_blob)),
        "model_blob_size": demo.blob_path(demo.model_blob).stat().st_size,
        "blobs": len(demo.blobs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make-demo-store",
        description="Write a small, realistic Ollama model store (for tests, demos, benchmarks).",
    )
    parser.add_argument("dir", type=Path, help="the store root to write (created if missing)")
    parser.add_argument(
        "--size",
        default="small",
        help="small (default), or the first model's GGUF size, e.g. 64M, 1G, 4G",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    try:
        weight_bytes = parse_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        demo = build_demo_store(args.dir, weight_bytes=weight_bytes)
    except OSError as exc:
        print(f"modelfs: error: {exc}", file=sys.stderr)
        return 1
    summary = _summary(demo)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"demo store: {demo.root}")
    for key, m in demo.manifests.items():
        print(f"  {key:52} {m.digest.short}  {_human(m.size)}")
    print(f"  model blob: {summary['model_blob']} ({_human(summary['model_blob_size'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
