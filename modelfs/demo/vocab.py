"""Tokenizer vocabularies (byte-level BPE and SentencePiece), special tokens and chat
templates for the demo's GGUF models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gguf

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
class Vocab:
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


def bpe_vocab(specials: Sequence[str]) -> Vocab:
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
    return Vocab("gpt2", tuple(tokens), tuple(types), None, tuple(merges), ids)


def spm_vocab(specials: Sequence[str], *, unused: int = 0) -> Vocab:
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
    return Vocab("llama", tuple(tokens), tuple(types), scores, tuple(merges), ids)


# fmt: off
GEMMA_SPECIALS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>",
    "<end_of_turn>", "<start_of_image>", "<end_of_image>",
)
# fmt: on
# fmt: off
LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|python_tag|>",
)
# fmt: on
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

GEMMA_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_JINJA = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gemma_vocab(unused: int) -> Vocab:
    return spm_vocab(GEMMA_SPECIALS, unused=unused)
