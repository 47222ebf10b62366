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
from dataclasses import dataclass
from typing import Any, BinaryIO

from store.errors import SafetensorsError

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


@dataclass(frozen=True, slots=True)
class SafeTensor:
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


def _tensor(name: str, info: Any, err: type[SafetensorsError], source: str) -> SafeTensor:
    where = f"{source}: tensor {name[:200]!r}"
    if not _text(name):
        raise err(f"{source}: a tensor name is not valid UTF-8")
    if not isinstance(info, dict):
        raise err(f"{where} is not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise err(f"{where} has unknown dtype {str(dtype)[:40]!r}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise err(f"{where} has a bad shape")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(o) for o in offsets):
        raise err(f"{where} has bad data_offsets")
    return SafeTensor(name, dtype, tuple(shape), offsets[0], offsets[1])


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
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
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
    if not isinstance(obj, dict):
        raise err(f"{source}: header is not a JSON object")

    metadata: dict[str, str] = {}
    meta_obj = obj.pop(METADATA_KEY, None)
    if meta_obj is not None:
        if not isinstance(meta_obj, dict) or not all(
            _text(k) and _text(v) for k, v in meta_obj.items()
        ):
            raise err(f"{source}: __metadata__ is not a map of strings to strings")
        metadata = meta_obj

    tensors = sorted(
        (_tensor(name, info, err, source) for name, info in obj.items()),
        key=lambda t: (t.begin, t.end),
    )
    pos = 0
    for t in tensors:
        where = f"{source}: tensor {t.name[:200]!r}"
        if t.begin != pos or t.end < t.begin:
            raise err(
                f"{where} data_offsets [{t.begin}, {t.end}] leave a hole or overlap"
                f" (expected to start at {pos})"
            )
        bits = DTYPE_BITS[t.dtype]
        nbits = _nbits(t.shape, bits, t.nbytes * 8)
        if nbits is not None and nbits % 8:
            raise err(f"{where} ({t.dtype} {list(t.shape)}) does not end on a byte boundary")
        if nbits is None or nbits // 8 != t.nbytes:
            raise err(
                f"{where} ({t.dtype} {list(t.shape)}) has {t.nbytes} bytes of data,"
                f" which does not match its shape"
            )
        pos = t.end
    if file_size is not None and 8 + n + pos != file_size:
        raise err(
            f"{source}: tensors cover {pos} bytes of data but the file holds {file_size - 8 - n}"
        )
    return SafetensorsHeader(n, 8 + n, metadata, tuple(tensors))


def read_safetensors_header_path(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read the safetensors header of a file; OSError if it cannot be opened."""
    with open(path, "rb") as f:
        return read_safetensors_header(f, os.fsdecode(path), os.fstat(f.fileno()).st_size)
