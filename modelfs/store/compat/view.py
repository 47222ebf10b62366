"""A synthesized GGUF: a new header plus tensor data mapped to byte ranges of the source blob.

A view is a list of pieces laid end to end: literal bytes (the parts of the header we write:
edited KVs, tensor infos, padding), ranges of the source blob (unchanged KVs, often the
whole tokenizer; every tensor whose bytes do not change), and computed tensors (made on
first read, see compute.py). Nothing of the source is copied to build it.
"""

from __future__ import annotations

import bisect
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from modelfs.store.compat.compute import LITERAL_OPS, OPS, ComputeCache, cache_name
from modelfs.store.compat.draft import Compute, Draft, check_tensor
from modelfs.store.disk.fileio import open_binary
from modelfs.store.formats.gguf import (
    DEFAULT_ALIGNMENT,
    T_ARRAY,
    array_prefix_end,
    encode_kv_head,
    encode_preamble,
    encode_tensor_info,
    encode_value,
)


@dataclass(frozen=True, slots=True)
class Piece:
    """`length` bytes at `start` in the view: `data`, or the source from `offset`, or
    `compute` (cached under `name`)."""

    start: int
    length: int
    data: bytes = b""
    offset: int = -1
    compute: Compute | None = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class ViewTensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the view
    nbytes: int
    computed: bool


@dataclass(frozen=True)
class GGUFView:
    kind: str  # "model" or "mmproj"
    handler: str
    source: Path
    source_hex: str
    size: int
    data_offset: int
    pieces: tuple[Piece, ...]
    tensors: tuple[ViewTensor, ...]
    hidden: tuple[str, ...]  # source tensors left out
    notes: tuple[str, ...]

    @property
    def computed(self) -> tuple[ViewTensor, ...]:
        return tuple(t for t in self.tensors if t.computed)

    @functools.cached_property
    def computed_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.compute is not None)

    def header_bytes(self, fd: int) -> bytes:
        return self.read(fd, 0, self.data_offset, None)

    def read(self, fd: int, offset: int, size: int, cache: ComputeCache | None) -> bytes:
        """Bytes [offset, offset+size) of the view; `fd` is the source blob, open."""
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        out = bytearray()
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while offset < end:
            p = self.pieces[i]
            lo = offset - p.start
            n = min(end, p.start + p.length) - offset
            if p.compute is not None:
                out += self._computed(fd, p, cache, lo, n)
            elif p.offset >= 0:
                chunk = os.pread(fd, n, p.offset + lo)
                if len(chunk) != n:
                    raise OSError(f"{self.source}: short read")
                out += chunk
            else:
                out += p.data[lo : lo + n]
            offset += n
            i += 1
        return bytes(out)

    def _computed(self, fd: int, p: Piece, cache: ComputeCache | None, lo: int, n: int) -> bytes:
        assert p.compute is not None
        cache = cache or ComputeCache(None)

        def read_source(off: int, length: int) -> bytes:
            data = os.pread(fd, length, off)
            if len(data) != length:
                raise OSError(f"{self.source}: short read")
            return data

        path, data = cache.get(self.source_hex, p.name, p.compute, read_source)
        if path is None:
            return data[lo : lo + n]
        with open_binary(path) as f:
            chunk = os.pread(f.fileno(), n, lo)
        if len(chunk) != n:
            raise OSError(f"{path}: short read")
        return chunk

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [p.start for p in self.pieces]


def _no_read(offset: int, length: int) -> bytes:
    raise AssertionError("a literal op reads no source")


class _Builder:
    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.pos = 0

    def add_bytes(self, data: bytes) -> None:
        if not data:
            return
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.offset < 0 and last.compute is None:
            self.pieces[-1] = Piece(last.start, last.length + len(data), last.data + data)
        else:
            self.pieces.append(Piece(self.pos, len(data), data))
        self.pos += len(data)

    def add_range(self, offset: int, length: int) -> None:
        if not length:
            return
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.offset >= 0 and last.offset + last.length == offset:
            self.pieces[-1] = Piece(last.start, last.length + length, offset=last.offset)
        else:
            self.pieces.append(Piece(self.pos, length, offset=offset))
        self.pos += length

    def add_compute(self, c: Compute, name: str) -> None:
        self.pieces.append(Piece(self.pos, c.nbytes, compute=c, name=name))
        self.pos += c.nbytes

    def pad(self, alignment: int) -> None:
        self.add_bytes(b"\0" * (-self.pos % alignment))


def build_view(
    draft: Draft,
    f: BinaryIO,
    source: Path,
    source_hex: str,
    kind: str,
) -> GGUFView:
    """Lay out `draft` as a GGUF whose data comes from the source open as `f`."""
    header = draft.header
    visible = [t for t in draft.tensors.values() if not draft.is_hidden(t.name)]
    hidden = tuple(t.name for t in draft.tensors.values() if draft.is_hidden(t.name))
    for t in visible:
        check_tensor(t)
    align_item = draft.kv.get("general.alignment")
    alignment = DEFAULT_ALIGNMENT
    if align_item is not None and isinstance(align_item.value, int) and align_item.value > 0:
        alignment = align_item.value

    b = _Builder()
    b.add_bytes(encode_preamble(len(visible), len(draft.kv), header.version))
    for key, item in draft.kv.items():
        span = item.span
        if span is None:
            b.add_bytes(
                encode_kv_head(key, item.vtype)
                + encode_value(item.vtype, item.value, item.item_type)
            )
        elif item.keep is not None:
            first = span.value + 12
            end = array_prefix_end(f, span, item.keep)
            b.add_bytes(
                encode_kv_head(key, T_ARRAY)
                + item.item_type.to_bytes(4, "little")
                + item.keep.to_bytes(8, "little")
            )
            b.add_range(first, end - first)
        elif header.spans.get(key) is span:
            b.add_range(span.start, span.end - span.start)  # unchanged, key and all
        else:
            b.add_bytes(encode_kv_head(key, item.vtype))  # a copy under a new key
            b.add_range(span.value, span.end - span.value)

    offsets: list[int] = []
    rel = 0
    for t in visible:
        rel += -rel % alignment
        offsets.append(rel)
        b.add_bytes(encode_tensor_info(t.name, t.shape, t.ggml_type, rel))
        rel += t.nbytes
    b.pad(alignment)
    data_offset = b.pos

    tensors: list[ViewTensor] = []
    for t, rel in zip(visible, offsets, strict=True):
        b.add_bytes(b"\0" * (data_offset + rel - b.pos))
        tensors.append(ViewTensor(t.name, t.shape, t.ggml_type, b.pos, t.nbytes, t.computed))
        if isinstance(t.data, Compute) and t.data.op in LITERAL_OPS:
            b.add_bytes(OPS[t.data.op](_no_read, t.data))
        elif isinstance(t.data, Compute):
            b.add_compute(t.data, cache_name(t.name, t.data))
        else:
            for offset, length in t.data:
                b.add_range(offset, length)
    return GGUFView(
        kind=kind,
        handler=draft.handler,
        source=source,
        source_hex=source_hex,
        size=b.pos,
        data_offset=data_offset,
        pieces=tuple(b.pieces),
        tensors=tuple(tensors),
        hidden=hidden,
        notes=tuple(draft.notes),
    )
