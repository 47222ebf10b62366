"""llama.cpp-compatible views of Ollama-layout GGUFs.

Many GGUFs Ollama publishes carry names and layouts upstream llama.cpp refuses; Ollama
translates them in memory at load time (`llama/compat/` in ollama/ollama). This package
does the same translation as a file: `compat_views` reads a blob's header and returns the
synthesized `llama.cpp/model.gguf` (and `llama.cpp/mmproj.gguf` for a monolithic vision
GGUF), or nothing for a file llama.cpp already loads; `mmproj_view` does the same for a
separate projector file (a LLaVA-style projector without `clip.projector_type`).

Pure and synchronous: reads headers, never tensor data (computed tensors are made when
read, see compute.py).
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from modelfs.store.disk.fileio import open_binary
from modelfs.store.formats.gguf import (
    FIXED_SIZES,
    MAGIC,
    T_ARRAY,
    T_STRING,
    GGUFHeader,
    read_gguf_header,
)

if TYPE_CHECKING:
    from modelfs.store.compat.compute import ComputeCache
    from modelfs.store.compat.handlers import NOT_PORTED
    from modelfs.store.compat.view import GGUFView

# The rules, the view builder and the computed tensors' cache are imported when first used: a
# mount's start needs none of them (its views are made after it is ready), and they take a
# quarter of its imports' time.
_LAZY = {
    "ComputeCache": "modelfs.store.compat.compute",
    "NOT_PORTED": "modelfs.store.compat.handlers",
    "GGUFView": "modelfs.store.compat.view",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "COMPATIBLE_RUNNERS",
    "NOT_PORTED",
    "CompatViews",
    "ComputeCache",
    "GGUFView",
    "compat_views",
    "may_need_mmproj_view",
    "may_need_view",
    "mmproj_view",
    "peek_architecture",
]

# Children of a manifest list made for llama.cpp are in its layout by definition (upstream
# runs them with OLLAMA_LLAMA_CPP_COMPAT=0, "already known to be llama.cpp-compatible").
COMPATIBLE_RUNNERS = frozenset({"llamacpp"})

# KVs the clip loader never reads and that would make the projector view as big as the
# tokenizer (tens of MB): left out of mmproj.gguf.
_CLIP_DROP_KV = ("tokenizer.",)


@dataclass(frozen=True)
class CompatViews:
    model: GGUFView
    mmproj: GGUFView | None


NOT_GGUF = ""


def _walk_kvs(head: bytes, limit: int) -> Iterator[tuple[bytes, int, int]]:
    """(key, value type, offset of the value) of the first KVs in `head`, at most `limit`;
    stops where a value cannot be skipped from these bytes (the caller sees the KV first,
    and a string array ends the walk)."""
    pos = 24
    for _ in range(min(struct.unpack_from("<Q", head, 16)[0], limit)):
        if pos + 12 > len(head):
            return
        (n,) = struct.unpack_from("<Q", head, pos)
        key = head[pos + 8 : pos + 8 + n]
        pos += 8 + n
        if pos + 4 > len(head):
            return
        (vtype,) = struct.unpack_from("<I", head, pos)
        pos += 4
        yield key, vtype, pos
        if vtype == T_STRING and pos + 8 <= len(head):
            pos += 8 + struct.unpack_from("<Q", head, pos)[0]
        elif vtype == T_ARRAY and pos + 12 <= len(head):
            item_type, count = struct.unpack_from("<IQ", head, pos)
            if item_type not in FIXED_SIZES:
                return  # a string array cannot be skipped cheaply
            pos += 12 + count * FIXED_SIZES[item_type]
        elif vtype in FIXED_SIZES:
            pos += FIXED_SIZES[vtype]
        else:
            return


def _head(f: BinaryIO, limit: int) -> bytes | None:
    f.seek(0)
    head = f.read(limit)
    return head if len(head) >= 24 and head[:4] == MAGIC else None


def peek_architecture(f: BinaryIO, limit: int = 1 << 16) -> str | None:
    """`general.architecture` when it is among the first KVs (converters write it first),
    from the first `limit` bytes: NOT_GGUF for a file that is no GGUF, None when it cannot
    be told from there. Cheap: one small read."""
    head = _head(f, limit)
    if head is None:
        return NOT_GGUF
    for key, vtype, pos in _walk_kvs(head, 8):
        if vtype != T_STRING:
            return None  # only walk past strings; anything else: read the whole header
        if key == b"general.architecture":
            if pos + 8 > len(head):
                return None
            (m,) = struct.unpack_from("<Q", head, pos)
            value = head[pos + 8 : pos + 8 + m]
            return value.decode("utf-8", "replace") if len(value) == m else None
    return None


def peek_token_count(f: BinaryIO, limit: int = 1 << 16) -> int | None:
    """The length of tokenizer.ggml.tokens when its array header is within the first
    `limit` bytes and only scalars, strings and arrays of fixed-size items come before it
    (converters write the vocabulary early), else None."""
    head = _head(f, limit)
    if head is None:
        return None
    for key, vtype, pos in _walk_kvs(head, 1 << 20):
        if key == b"tokenizer.ggml.tokens" and vtype == T_ARRAY and pos + 12 <= len(head):
            count: int = struct.unpack_from("<Q", head, pos + 4)[0]
            return count
    return None


# The smallest vocabulary a Llama 3 metadata gap can be found in (<|eot_id|> is 128009).
_LLAMA3_MIN_VOCAB = 128010


def may_need_view(path: Path) -> bool:
    """False when the blob's architecture has no rule, read from its first bytes (and, for
    the many plain llama files, a vocabulary too small to be Llama 3's)."""
    try:
        with open_binary(path) as f:
            arch = peek_architecture(f)
            if arch == "llama":
                count = peek_token_count(f)
                return count is None or count >= _LLAMA3_MIN_VOCAB
    except OSError:
        return False
    from modelfs.store.compat.handlers import TEXT_ARCHES

    return arch is None or arch in TEXT_ARCHES  # NOT_GGUF is in no rule


def compat_views(
    path: Path, source_hex: str, header: GGUFHeader | None = None
) -> CompatViews | None:
    """The views of the GGUF at `path` (a blob named by `source_hex`), or None when no rule
    applies. GGUFError/OSError when the file cannot be read."""
    from modelfs.store.compat.draft import Draft
    from modelfs.store.compat.handlers import TEXT_ARCHES, translate_text
    from modelfs.store.compat.view import build_view

    with open_binary(path) as f:
        size = os.fstat(f.fileno()).st_size
        if header is None:
            header = read_gguf_header(f, str(path), size)
        if header.architecture not in TEXT_ARCHES:
            return None
        text = Draft.of(header, f)
        if not translate_text(text):
            return None
        model = build_view(text, f, path, source_hex, "model")
        mmproj = _clip_view(header, f, path, source_hex)
    return CompatViews(model, mmproj)


def _clip_view(header: GGUFHeader, f: BinaryIO, path: Path, source_hex: str) -> GGUFView | None:
    """The mmproj view of the GGUF open as `f`, as llama.cpp's clip loader translates it
    (translate_clip_metadata), or None when no clip rule applies."""
    from modelfs.store.compat.draft import Draft
    from modelfs.store.compat.handlers import translate_clip
    from modelfs.store.compat.view import build_view

    clip = Draft.of(header, f)
    rule = translate_clip(clip)
    if rule is None:
        return None
    for key in [k for k in clip.kv if k.startswith(_CLIP_DROP_KV)]:
        clip.remove(key)
    clip.tensors = {
        n: t
        for n, t in clip.tensors.items()
        if n.startswith(rule.keep) and not n.startswith(rule.skip)
    }
    return build_view(clip, f, path, source_hex, "mmproj")


def may_need_mmproj_view(path: Path) -> bool:
    """False when a projector blob (the `projector` layer, shown as mmproj.gguf) cannot need
    a view, told from its first bytes: it is no GGUF, or of an architecture no clip rule
    reads."""
    try:
        with open_binary(path) as f:
            arch = peek_architecture(f)
    except OSError:
        return False
    from modelfs.store.compat.handlers import TEXT_ARCHES

    return arch is None or arch == "clip" or arch in TEXT_ARCHES


def mmproj_view(path: Path, source_hex: str, header: GGUFHeader | None = None) -> GGUFView | None:
    """The view of a separate projector file (`projector` layer) llama.cpp needs as
    `--mmproj`, or None when it loads the file as it is: LLaVA-style projectors without
    clip.projector_type. GGUFError/OSError when the file cannot be read."""
    with open_binary(path) as f:
        size = os.fstat(f.fileno()).st_size
        if header is None:
            header = read_gguf_header(f, str(path), size)
        return _clip_view(header, f, path, source_hex)
