"""A bounded reader of safetensors headers, checked the way the reference library checks them.

The format (github.com/huggingface/safetensors, README "Format" and safetensors/src/
tensor.rs): a little-endian u64 N, then N bytes of UTF-8 JSON starting with `{` (maybe
padded with spaces), then the data buffer. The JSON maps tensor names to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the buffer) plus an
optional `__metadata__` of string to string. Tensors must cover the buffer exactly: no
holes, no overlaps, and each one exactly as many bytes as its shape and dtype need.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, BinaryIO, NamedTuple

from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import SafetensorsError

# The reference library's own cap on N (MAX_HEADER_SIZE in tensor.rs).
MAX_HEADER = 100_000_000

# Bits per element of each dtype (Dtype::bitsize in tensor.rs). F4 and F6 pack several
# elements into a byte; a tensor of them must still end on a byte boundary.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

METADATA_KEY = "__metadata__"


class SafeTensor(NamedTuple):
    # A tuple, not a frozen dataclass: a header may hold a million of them, and a tuple is
    # made three times as fast.
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the header's data_offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    header_len: int
    data_offset: int  # 8 + header_len
    metadata: dict[str, str]
    tensors: tuple[SafeTensor, ...]  # in the order of their data

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        """The size the file must have: header plus data buffer."""
        return self.data_offset + self.data_size

    def tensor(self, name: str) -> SafeTensor:
        """The tensor called `name`; KeyError if there is none."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


class _Duplicate(Exception):
    pass


class _BadConstant(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return obj


def _reject_constant(name: str) -> Any:
    # serde_json, which the reference reader uses, has no NaN or Infinity literals.
    raise _BadConstant(name)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        data = f.read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _text(value: Any) -> bool:
    # Lone surrogates from `\ud800` escapes decode in Python but are not UTF-8 (serde_json
    # rejects them); a name with one could never become a file name or a header again.
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _nbits(shape: tuple[int, ...], bits: int, cap: int) -> int | None:
    """prod(shape) * bits, or None once it passes `cap` (it can only grow)."""
    if 0 in shape:
        return 0
    n = bits
    for dim in shape:
        n *= dim
        if n > cap:
            return None
    return n


_DTYPES = {name: name for name in DTYPE_BITS}  # one str object per dtype, shared by tensors
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
_SPACE = re.compile(r"[ \t\n\r]*")
_WS = frozenset(" \t\n\r")


class _Fallback(Exception):
    """The fast reader met something it leaves to `json.loads` (which names the error)."""


def _loads(text: str, err: type[SafetensorsError], source: str) -> Any:
    try:
        return _DECODER.decode(text)
    except _Duplicate as exc:
        raise err(f"{source}: duplicate key {str(exc.args[0])[:200]!r} in header") from None
    except _BadConstant as exc:
        raise err(f"{source}: {exc.args[0]} is not valid JSON") from None
    except json.JSONDecodeError as exc:
        raise err(f"{source}: header is not JSON ({exc.msg} at byte {exc.pos})") from None
    except RecursionError:
        raise err(f"{source}: header JSON is nested too deeply") from None
    except ValueError as exc:
        # e.g. an integer literal longer than Python will convert
        raise err(f"{source}: header is not usable JSON ({str(exc)[:80]})") from None


def _members(text: str) -> Iterator[tuple[str, Any]]:
    """The top-level members of the header object, one at a time, so that a header of a
    million tensors is never a million dicts at once (json.loads of a 100 MB header holds
    ~1 GB). Raises _Fallback on anything but a well-formed object; duplicate top-level keys
    are the caller's to find."""
    # typeshed omits scan_once, which JSONDecoder.__init__ sets (CPython Lib/json/decoder.py).
    scan = _DECODER.scan_once  # type: ignore[attr-defined]
    # A `*` pattern always matches, so `match` never returns None here.
    space: Callable[[str, int], re.Match[str]] = _SPACE.match  # type: ignore[assignment]
    try:
        i = space(text, 1).end()
        if text[i] == "}":
            i += 1
        else:
            # Whitespace is looked for only where there is some: most headers have none.
            while True:
                if text[i] != '"':
                    raise _Fallback
                key, i = scanstring(text, i + 1, True)
                if text[i] in _WS:
                    i = space(text, i).end()
                if text[i] != ":":
                    raise _Fallback
                i += 1
                if text[i] in _WS:
                    i = space(text, i).end()
                value, i = scan(text, i)
                yield key, value
                c = text[i]
                if c in _WS:
                    i = space(text, i).end()
                    c = text[i]
                if c == ",":
                    i += 1
                    if text[i] in _WS:
                        i = space(text, i).end()
                elif c == "}":
                    i += 1
                    break
                else:
                    raise _Fallback
        if space(text, i).end() != len(text):
            raise _Fallback
    except (StopIteration, IndexError, ValueError, RecursionError, _Duplicate, _BadConstant):
        # (json.JSONDecodeError is a ValueError.)
        raise _Fallback from None


def _tensor(
    name: str,
    info: Any,
    err: type[SafetensorsError],
    source: str,
    shapes: dict[tuple[int, ...], tuple[int, ...]],
) -> SafeTensor:
    # Type checks by `type(x) is int`: a JSON bool is not an int here, as serde_json has it.
    if type(info) is dict:
        dtype = info.get("dtype")
        dtype = _DTYPES.get(dtype) if type(dtype) is str else None
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if (
            dtype is not None
            and type(shape) is list
            and type(offsets) is list
            and len(offsets) == 2
            and type(begin := offsets[0]) is int
            and type(end := offsets[1]) is int
            and begin >= 0
            and end >= 0
        ):
            for dim in shape:
                if type(dim) is not int or dim < 0:
                    break
            else:
                key = tuple(shape)
                return SafeTensor(name, dtype, shapes.setdefault(key, key), begin, end)
    # Something is wrong with it: say what, the slow way.
    where = f"{source}: tensor {name[:200]!r}"
    if not isinstance(info, dict):
        raise err(f"{where} is not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise err(f"{where} has unknown dtype {str(dtype)[:40]!r}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise err(f"{where} has a bad shape")
    raise err(f"{where} has bad data_offsets")


def read_safetensors_header(
    f: BinaryIO, source: str, file_size: int | None = None
) -> SafetensorsHeader:
    """Read and check the header of the safetensors file whose first byte is at `f`.

    `source` names the file in errors. With `file_size`, the data buffer must end exactly
    at the end of the file, as the reference reader requires.
    """
    err = SafetensorsError
    prefix = _read_exact(f, 8)
    if len(prefix) < 8:
        raise err(f"{source}: too short to be safetensors ({len(prefix)} bytes)")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER:
        raise err(f"{source}: header length {n} is over the {MAX_HEADER}-byte limit")
    if file_size is not None and 8 + n > file_size:
        raise err(f"{source}: header length {n} runs past the end of the file ({file_size} bytes)")
    raw = _read_exact(f, n)
    if len(raw) < n:
        raise err(f"{source}: truncated header ({len(raw)} of {n} bytes)")
    if not raw.startswith(b"{"):
        raise err(f"{source}: header does not start with '{{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise err(f"{source}: header is not UTF-8 (byte {exc.start})") from None
    del raw
    # Only an escape can make a lone surrogate, so names need checking only if there is one.
    escapes = "\\" in text
    metadata: dict[str, str] = {}
    tensors: list[SafeTensor] = []
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    metadata_seen = False
    try:
        for name, info in _members(text):
            if name == METADATA_KEY:
                if metadata_seen:
                    raise err(f"{source}: duplicate key {METADATA_KEY!r} in header")
                metadata = _metadata(info, err, source)
                metadata_seen = True
                continue
            if escapes and not _text(name):
                raise err(f"{source}: a tensor name is not valid UTF-8")
            tensors.append(_tensor(name, info, err, source, shapes))
    except _Fallback:
        obj = _loads(text, err, source)
        if not isinstance(obj, dict):
            raise err(f"{source}: header is not a JSON object") from None
        # json.loads accepted what the fast reader did not: read its result the same way.
        metadata = _metadata(obj.pop(METADATA_KEY, None), err, source)
        tensors = []
        for name, info in obj.items():
            if not _text(name):
                raise err(f"{source}: a tensor name is not valid UTF-8") from None
            tensors.append(_tensor(name, info, err, source, shapes))
    del text, shapes
    # Duplicate names, once the text is gone (a set of a million names is 60 MB); the first
    # repeated in the header's order, as json.loads with a pairs hook would name it.
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise err(f"{source}: duplicate key {t.name[:200]!r} in header")
        names.add(t.name)
    del names
    tensors.sort(key=_data_order)
    pos = 0
    for t in tensors:
        if t.begin != pos or t.end < t.begin:
            raise err(
                f"{source}: tensor {t.name[:200]!r} data_offsets [{t.begin}, {t.end}]"
                f" leave a hole or overlap (expected to start at {pos})"
            )
        nbytes = t.end - t.begin
        nbits = _nbits(t.shape, DTYPE_BITS[t.dtype], nbytes * 8)
        if nbits != nbytes * 8:
            where = f"{source}: tensor {t.name[:200]!r}"
            if nbits is not None and nbits % 8:
                raise err(f"{where} ({t.dtype} {list(t.shape)}) does not end on a byte boundary")
            raise err(
                f"{where} ({t.dtype} {list(t.shape)}) has {nbytes} bytes of data,"
                f" which does not match its shape"
            )
        pos = t.end
    if file_size is not None and 8 + n + pos != file_size:
        raise err(
            f"{source}: tensors cover {pos} bytes of data but the file holds {file_size - 8 - n}"
        )
    return SafetensorsHeader(n, 8 + n, metadata, tuple(tensors))


def _data_order(t: SafeTensor) -> tuple[int, int]:
    return (t.begin, t.end)


def _metadata(value: Any, err: type[SafetensorsError], source: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(_text(k) and _text(v) for k, v in value.items()):
        raise err(f"{source}: __metadata__ is not a map of strings to strings")
    return value


def read_header_length(path: str | os.PathLike[str]) -> int:
    """The header length a safetensors file's first 8 bytes claim (0 if it has fewer)."""
    with open_binary(path) as f:
        prefix = f.read(8)
    return int.from_bytes(prefix, "little") if len(prefix) == 8 else 0


def read_safetensors_header_path(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read the safetensors header of a file; OSError if it cannot be opened."""
    with open_binary(path) as f:
        return read_safetensors_header(f, os.fsdecode(path), os.fstat(f.fileno()).st_size)
