"""A bounded reader of GGUF headers: metadata and tensor infos, never the tensor data.

Every count and length in a GGUF header is attacker-controlled (a blob can come from any
peer), so each is checked against a fixed bound and against the bytes actually left
before anything is allocated or looped over. A header we refuse raises GGUFError with one
line naming the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import GGUFError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Real headers: ~1,100 tensors, ~40 KVs, one chat template of tens of KiB, a tokenizer of
# 20-30 MB. The bounds sit far above that and far below what would exhaust memory.
MAX_TENSORS = 1_000_000
MAX_KVS = 100_000
MAX_STRING = 16 << 20
MAX_NAME = 64 << 10
MAX_ARRAY = 16 << 20
MAX_HEADER = 512 << 20
MAX_DIMS = 4
# Arrays up to this length keep their values (Ollama's metadata cache uses the same cut-off);
# longer ones (token lists, merges, scores) are summarized and skipped.
KEEP_ARRAY = 4096

_CHUNK = 1 << 20
_SKIP_CHUNK = 4 << 20

# GGUF value types (ggml's gguf.h `enum gguf_type`).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32 = 0, 1, 2, 3, 4, 5
T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = 6, 7, 8, 9, 10, 11, 12

# struct code and size of each fixed-size value type.
_FIXED: dict[int, tuple[str, int]] = {
    T_UINT8: ("B", 1),
    T_INT8: ("b", 1),
    T_UINT16: ("H", 2),
    T_INT16: ("h", 2),
    T_UINT32: ("I", 4),
    T_INT32: ("i", 4),
    T_FLOAT32: ("f", 4),
    T_BOOL: ("?", 1),
    T_UINT64: ("Q", 8),
    T_INT64: ("q", 8),
    T_FLOAT64: ("d", 8),
}
_FIXED_STRUCTS = {t: struct.Struct("<" + code) for t, (code, _) in _FIXED.items()}
FIXED_SIZES = {t: size for t, (_, size) in _FIXED.items()}  # bytes of each fixed-size type

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ggml tensor types: id -> (name, block size in elements, bytes per block). From the
# `type_traits` table in ggml/src/ggml.c and the block structs in ggml/src/ggml-common.h
# (github.com/ggml-org/ggml @ d99724f, 2026-08-21). Ids 4, 5, 31-33 and 36-38 are removed
# types (block size 0 upstream) and read as unknown.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
    42: ("Q2_0", 64, 18),
}

# `general.file_type` (llama_ftype), as Ollama names it in fs/ggml/type.go.
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}

_INT64_MAX = (1 << 63) - 1
# The smallest possible KV (1-byte key, u8 value) and tensor info (empty name, no dims);
# lets a header that claims more entries than its bytes could hold fail at once.
_MIN_KV = 8 + 1 + 4 + 1
_MIN_TENSOR = 8 + 4 + 4 + 8


def ggml_type_name(ggml_type: int) -> str:
    known = GGML_TYPES.get(ggml_type)
    return known[0] if known else f"type{ggml_type}"


@dataclass(frozen=True, slots=True)
class ArraySummary:
    """Stands in for an array too long to keep: its item type and length."""

    item_type: int
    length: int


@dataclass(frozen=True, slots=True)
class KVSpan:
    """Where one key-value pair sits in the file, so it can be copied byte for byte.

    `start` is the key's length field, `value` the first byte of the value (after the type
    word), `end` one past its last byte. `item_type` and `count` describe an array.
    """

    start: int
    value: int
    end: int
    vtype: int
    item_type: int = -1
    count: int = 0


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as stored: ne0 (the contiguous dimension) first
    ggml_type: int
    type_name: str
    offset: int  # absolute file offset of the tensor's data
    nbytes: int  # 0 for a type we do not know

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def is_known_type(self) -> bool:
        return self.ggml_type in GGML_TYPES


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    kv: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    alignment: int
    data_offset: int  # absolute, aligned offset where tensor data begins
    spans: dict[str, KVSpan] = field(default_factory=dict)  # every key, in file order

    @property
    def architecture(self) -> str:
        arch = self.kv.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    @property
    def file_type(self) -> int | None:
        return _int(self.kv.get("general.file_type"))

    @property
    def file_type_name(self) -> str:
        ft = self.file_type
        return FILE_TYPES.get(ft, "unknown") if ft is not None else "unknown"

    @property
    def parameter_count(self) -> int:
        count = _int(self.kv.get("general.parameter_count"))
        if count is not None:
            return count
        return sum(t.n_elements for t in self.tensors)

    @property
    def context_length(self) -> int | None:
        arch = self.architecture
        return _int(self.kv.get(f"{arch}.context_length")) if arch else None

    @property
    def embedding_length(self) -> int | None:
        arch = self.architecture
        return _int(self.kv.get(f"{arch}.embedding_length")) if arch else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Reader:
    """Buffered, bounded reads from the start of a GGUF file.

    `limit` is the number of bytes the header may span: the file size when known, else
    MAX_HEADER. Every read checks it first, so no claimed length can make us allocate or
    read past it.
    """

    __slots__ = ("base", "buf", "f", "file_size", "limit", "pos", "source")

    def __init__(self, f: BinaryIO, source: str, file_size: int | None) -> None:
        self.f = f
        self.source = source
        self.file_size = file_size
        self.limit = MAX_HEADER if file_size is None else min(file_size, MAX_HEADER)
        self.buf = b""
        self.pos = 0  # read position within buf
        self.base = 0  # file offset of buf[0]

    def tell(self) -> int:
        return self.base + self.pos

    def error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.source}: {message}")

    def _past_limit(self, end: int) -> GGUFError:
        if self.file_size is not None and end > self.file_size:
            return self.error(
                f"truncated GGUF header (needs {end} bytes, file has {self.file_size})"
            )
        return self.error(f"GGUF header is larger than {MAX_HEADER >> 20} MiB")

    def check_room(self, nbytes: int, what: str) -> None:
        """Fail at once if `nbytes` more cannot fit before the limit."""
        end = self.tell() + nbytes
        if end > self.limit:
            if self.file_size is not None and end > self.file_size:
                raise self.error(f"{what} cannot fit in a {self.file_size}-byte file")
            raise self._past_limit(end)

    def _fill(self, n: int) -> None:
        avail = len(self.buf) - self.pos
        if avail >= n:
            return
        end = self.tell() + n
        if end > self.limit:
            raise self._past_limit(end)
        parts = [self.buf[self.pos :]]
        self.base += self.pos
        self.pos = 0
        filled = self.base + avail  # file offset up to which we hold bytes
        stop = min(self.limit, max(end, filled + _CHUNK))
        while filled < end:
            data = self.f.read(stop - filled)
            if not data:
                raise self.error(f"truncated GGUF header (ends at byte {filled})")
            parts.append(data)
            filled += len(data)
        self.buf = b"".join(parts)

    def read(self, n: int) -> bytes:
        self._fill(n)
        start = self.pos
        self.pos += n
        return self.buf[start : self.pos]

    def skip(self, n: int) -> None:
        avail = len(self.buf) - self.pos
        if n <= avail:
            self.pos += n
            return
        self.check_room(n, f"a {n}-byte value")
        n -= avail
        self.base += len(self.buf)
        self.buf = b""
        self.pos = 0
        while n:
            data = self.f.read(min(n, _SKIP_CHUNK))
            if not data:
                raise self.error(f"truncated GGUF header (ends at byte {self.base})")
            self.base += len(data)
            n -= len(data)

    def u32(self) -> int:
        self._fill(4)
        value: int = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        self._fill(8)
        value: int = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return value

    def string_bytes(self, limit: int, what: str) -> bytes:
        n = self.u64()
        if n > limit:
            raise self.error(f"{what} is {n} bytes long (limit {limit})")
        return self.read(n)

    def skip_strings(self, count: int, what: str) -> None:
        # The hot loop of a tokenizer header (150k+ tokens, as many merges): walk the
        # buffer in place and only fall back to a refill at chunk edges.
        unpack = _U64.unpack_from
        while count:
            buf, pos = self.buf, self.pos
            end = len(buf)
            while count and pos + 8 <= end:
                (n,) = unpack(buf, pos)
                if n > MAX_STRING:
                    self.pos = pos
                    raise self.error(f"a string in {what} is {n} bytes long (limit {MAX_STRING})")
                if pos + 8 + n > end:
                    break
                pos += 8 + n
                count -= 1
            self.pos = pos
            if count:
                n = self.u64()
                if n > MAX_STRING:
                    raise self.error(f"a string in {what} is {n} bytes long (limit {MAX_STRING})")
                self.skip(n)
                count -= 1


def _q(text: str) -> str:
    """A name quoted for an error message, cut short: keys may be 64 KiB long."""
    return repr(text if len(text) <= 80 else text[:80] + "…")


def _name(r: _Reader, what: str) -> str:
    raw = r.string_bytes(MAX_NAME, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise r.error(f"{what} is not valid UTF-8: {raw[:64]!r}") from None


def _value(r: _Reader, vtype: int, key: str) -> Any:
    fixed = _FIXED_STRUCTS.get(vtype)
    if fixed is not None:
        return fixed.unpack(r.read(fixed.size))[0]
    if vtype == T_STRING:
        return r.string_bytes(MAX_STRING, f"value of {_q(key)}").decode("utf-8", errors="replace")
    if vtype == T_ARRAY:
        return _array(r, key)[0]
    raise r.error(f"key {_q(key)} has unknown value type {vtype}")


def _array(r: _Reader, key: str) -> tuple[Any, int, int]:
    """An array's value (a list, or an ArraySummary when long), item type and length."""
    item_type = r.u32()
    count = r.u64()
    if count > MAX_ARRAY:
        raise r.error(f"array {_q(key)} claims {count} items (limit {MAX_ARRAY})")
    keep = count <= KEEP_ARRAY
    fixed = _FIXED.get(item_type)
    if fixed is not None:
        code, size = fixed
        if keep:
            return list(struct.unpack(f"<{count}{code}", r.read(count * size))), item_type, count
        r.skip(count * size)
        return ArraySummary(item_type, count), item_type, count
    if item_type == T_STRING:
        r.check_room(count * 8, f"array {_q(key)} of {count} strings")
        if keep:
            what = f"array {_q(key)}"
            items = [
                r.string_bytes(MAX_STRING, what).decode("utf-8", errors="replace")
                for _ in range(count)
            ]
            return items, item_type, count
        r.skip_strings(count, f"array {_q(key)}")
        return ArraySummary(item_type, count), item_type, count
    if item_type == T_ARRAY:
        # The spec allows arrays of arrays, but neither ggml (gguf.cpp) nor Ollama
        # (fs/gguf) reads them, so no usable model has one.
        raise r.error(f"array {_q(key)} holds arrays, which GGUF readers do not support")
    raise r.error(f"array {_q(key)} has unknown item type {item_type}")


def read_gguf_header(f: BinaryIO, source: str, file_size: int | None = None) -> GGUFHeader:
    """Read the header of the GGUF file whose first byte is at `f`'s current position.

    `source` names the file in errors. `file_size` (counted from that first byte), when
    given, bounds the header and every tensor's data; offsets in the result count from
    the same byte.
    """
    r = _Reader(f, source, file_size)
    if file_size is not None and file_size < 24:
        raise r.error(f"too short to be GGUF ({file_size} bytes)")
    try:
        magic = r.read(4)
    except GGUFError:
        raise r.error("too short to be GGUF") from None
    if magic != MAGIC:
        raise r.error(f"not a GGUF file (magic {magic!r})")
    version = r.u32()
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise r.error("big-endian GGUF is not supported")
        raise r.error(f"unsupported GGUF version {version}")
    n_tensors = r.u64()
    n_kv = r.u64()
    if n_tensors > MAX_TENSORS:
        raise r.error(f"claims {n_tensors} tensors (limit {MAX_TENSORS})")
    if n_kv > MAX_KVS:
        raise r.error(f"claims {n_kv} metadata keys (limit {MAX_KVS})")
    r.check_room(n_kv * _MIN_KV + n_tensors * _MIN_TENSOR, f"{n_tensors} tensors and {n_kv} keys")

    kv: dict[str, Any] = {}
    spans: dict[str, KVSpan] = {}
    for i in range(n_kv):
        start = r.tell()
        key = _name(r, f"key {i}")
        if not key:
            raise r.error(f"key {i} is empty")
        if key in kv:
            raise r.error(f"duplicate key {_q(key)}")
        vtype = r.u32()
        value_at = r.tell()
        if vtype == T_ARRAY:
            kv[key], item_type, count = _array(r, key)
            spans[key] = KVSpan(start, value_at, r.tell(), vtype, item_type, count)
        else:
            kv[key] = _value(r, vtype, key)
            spans[key] = KVSpan(start, value_at, r.tell(), vtype)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        value = _int(kv["general.alignment"])
        if value is None or value <= 0 or value & (value - 1):
            raise r.error(f"general.alignment {kv['general.alignment']!r} is not a power of 2")
        alignment = value

    infos: list[tuple[str, tuple[int, ...], int, int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = _name(r, f"name of tensor {i}")
        if name in names:
            raise r.error(f"duplicate tensor {_q(name)}")
        names.add(name)
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise r.error(f"tensor {_q(name)} has {n_dims} dimensions (limit {MAX_DIMS})")
        shape = tuple(r.u64() for _ in range(n_dims))
        n_elements = 1
        for dim in shape:
            if dim > _INT64_MAX:
                raise r.error(f"tensor {_q(name)} has a negative dimension in {shape}")
            n_elements *= dim
        if n_elements > _INT64_MAX:
            raise r.error(f"tensor {_q(name)} has too many elements {shape}")
        ggml_type = r.u32()
        known = GGML_TYPES.get(ggml_type)
        nbytes = 0
        if known is not None:
            type_name, block, size = known
            row = shape[0] if shape else 1
            if row % block:
                raise r.error(
                    f"tensor {_q(name)} ({type_name}) has rows of {row} elements,"
                    f" not a multiple of the block size {block}"
                )
            nbytes = n_elements // block * size
        offset = r.u64()
        infos.append((name, shape, ggml_type, offset, nbytes))

    data_offset = -(-r.tell() // alignment) * alignment
    if file_size is not None and infos and data_offset > file_size:
        raise r.error(f"tensor data would start at {data_offset}, past the end of the file")
    tensors: list[GGUFTensor] = []
    for name, shape, ggml_type, offset, nbytes in infos:
        start = data_offset + offset
        if file_size is not None and start + nbytes > file_size:
            raise r.error(
                f"tensor {_q(name)} data [{start}, {start + nbytes}) runs past the end"
                f" of the file ({file_size} bytes)"
            )
        tensors.append(GGUFTensor(name, shape, ggml_type, ggml_type_name(ggml_type), start, nbytes))
    return GGUFHeader(version, kv, tuple(tensors), alignment, data_offset, spans)


def read_gguf_header_path(path: str | os.PathLike[str]) -> GGUFHeader:
    """Read the GGUF header of a file; OSError if it cannot be opened."""
    with open_binary(path) as f:
        return read_gguf_header(f, os.fsdecode(path), os.fstat(f.fileno()).st_size)


# -- writing: the pieces of a header that a synthesized GGUF needs -------------------------


def encode_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def encode_value(vtype: int, value: Any, item_type: int = -1) -> bytes:
    """The bytes of one value of GGUF type `vtype` (without the type word).

    An array is given as a list of items of `item_type`; its type word and length are
    written first, as in the file.
    """
    fixed = _FIXED_STRUCTS.get(vtype)
    if fixed is not None:
        return fixed.pack(value)
    if vtype == T_STRING:
        return encode_string(value)
    if vtype == T_ARRAY:
        items = list(value)
        head = _U32.pack(item_type) + _U64.pack(len(items))
        fixed_item = _FIXED.get(item_type)
        if fixed_item is not None:
            return head + struct.pack(f"<{len(items)}{fixed_item[0]}", *items)
        if item_type == T_STRING:
            return head + b"".join(encode_string(s) for s in items)
        raise ValueError(f"cannot encode an array of GGUF type {item_type}")
    raise ValueError(f"cannot encode GGUF type {vtype}")


def encode_kv_head(key: str, vtype: int) -> bytes:
    """A key and its value type word: what precedes every value in the KV section."""
    return encode_string(key) + _U32.pack(vtype)


def encode_tensor_info(name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    """One tensor info entry; `offset` counts from the start of the data section."""
    out = [encode_string(name), _U32.pack(len(shape))]
    out += [_U64.pack(d) for d in shape]
    out += [_U32.pack(ggml_type), _U64.pack(offset)]
    return b"".join(out)


def encode_preamble(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return MAGIC + _U32.pack(version) + _U64.pack(n_tensors) + _U64.pack(n_kv)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of that shape and type; ValueError for an unknown type or a row
    that is not a whole number of blocks."""
    known = GGML_TYPES.get(ggml_type)
    if known is None:
        raise ValueError(f"unknown ggml type {ggml_type}")
    _, block, size = known
    n = 1
    for d in shape:
        n *= d
    if (shape[0] if shape else 1) % block:
        raise ValueError(f"rows of {shape[0]} are not whole {known[0]} blocks")
    return n // block * size


def array_prefix_end(f: BinaryIO, span: KVSpan, n: int) -> int:
    """File offset just past the first `n` items of the array at `span`.

    Fixed-size items are counted; strings are walked, each length checked against the span.
    """
    if span.vtype != T_ARRAY or n > span.count:
        raise GGUFError(f"array prefix of {n} items is out of range")
    first = span.value + 12  # item type word and length
    fixed = _FIXED.get(span.item_type)
    if fixed is not None:
        return first + n * fixed[1]
    if span.item_type != T_STRING:
        raise GGUFError(f"cannot walk an array of GGUF type {span.item_type}")
    f.seek(first)
    r = _Reader(f, "array", span.end - first)
    for _ in range(n):
        length = r.u64()
        if length > MAX_STRING:
            raise GGUFError(f"a string of {length} bytes in an array")
        r.skip(length)
    return first + r.tell()


def read_array(f: BinaryIO, span: KVSpan, start: int = 0, count: int | None = None) -> list[Any]:
    """Items [start, start+count) of the array at `span`, read from the file (for arrays
    too long to keep in a header: a vocabulary, a charsmap)."""
    if span.vtype != T_ARRAY:
        raise GGUFError("not an array")
    stop = span.count if count is None else min(span.count, start + count)
    if start >= stop:
        return []
    first = span.value + 12
    fixed = _FIXED.get(span.item_type)
    if fixed is not None:
        code, size = fixed
        f.seek(first + start * size)
        data = f.read((stop - start) * size)
        if len(data) != (stop - start) * size:
            raise GGUFError("truncated array")
        return list(struct.unpack(f"<{stop - start}{code}", data))
    if span.item_type != T_STRING:
        raise GGUFError(f"cannot read an array of GGUF type {span.item_type}")
    f.seek(first)
    r = _Reader(f, "array", span.end - first)
    # token_at(128009) of a Llama 3 vocabulary: the fast walk, not a call per token.
    r.skip_strings(start, "array")
    return [
        r.string_bytes(MAX_STRING, "array").decode("utf-8", errors="replace")
        for _ in range(stop - start)
    ]
