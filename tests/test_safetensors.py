"""store.safetensors against the reference library (`safetensors`), and hostile input."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from modelfs.store.errors import GGUFError, SafetensorsError
from modelfs.store.formats.gguf import read_gguf_header
from modelfs.store.formats.safetensors import (
    DTYPE_BITS,
    MAX_HEADER,
    SafeTensor,
    SafetensorsHeader,
    read_safetensors_header,
    read_safetensors_header_path,
)

ARRAYS: dict[str, np.ndarray] = {
    "model.embed_tokens.weight": np.arange(24, dtype=np.float16).reshape(4, 6),
    "model.norm.weight": np.ones(6, dtype=np.float32),
    "a.bool": np.array([True, False, True]),
    "a.u8": np.arange(5, dtype=np.uint8),
    "a.i8": np.arange(5, dtype=np.int8),
    "a.i16": np.arange(3, dtype=np.int16),
    "a.u16": np.arange(3, dtype=np.uint16),
    "a.i32": np.arange(6, dtype=np.int32).reshape(2, 3, 1),
    "a.u32": np.arange(2, dtype=np.uint32),
    "a.f64": np.arange(2, dtype=np.float64),
    "a.i64": np.arange(2, dtype=np.int64),
    "a.u64": np.arange(2, dtype=np.uint64),
    "a.scalar": np.array(3.5, dtype=np.float32),
    "a.empty": np.zeros((0, 4), dtype=np.float32),
    "zzz.first-by-name": np.zeros(1, dtype=np.uint8),
}


def st_bytes(header: dict[str, Any] | bytes, data: bytes = b"", *, pad: bool = True) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)  # as Ollama's and the reference writers do
    return struct.pack("<Q", len(raw)) + raw + data


def info(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def parse(data: bytes, *, sized: bool = True) -> SafetensorsHeader:
    return read_safetensors_header(
        io.BytesIO(data), "bad.safetensors", len(data) if sized else None
    )


def rust_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except SafetensorError:
        return False
    return True


def test_matches_safe_open(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    meta = {"format": "pt", "quant_type": "int4", "ü": "✓"}
    save_file(ARRAYS, str(path), metadata=meta)
    raw = path.read_bytes()
    h = read_safetensors_header_path(path)

    assert h.header_len == struct.unpack("<Q", raw[:8])[0]
    assert h.data_offset == 8 + h.header_len
    assert h.file_size == len(raw)
    assert h.metadata == meta
    assert [t.begin for t in h.tensors] == sorted(t.begin for t in h.tensors)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == meta
        assert sorted(f.keys()) == sorted(t.name for t in h.tensors)
        for t in h.tensors:
            sl = f.get_slice(t.name)
            assert t.dtype == sl.get_dtype()
            assert list(t.shape) == sl.get_shape()
            want = f.get_tensor(t.name).tobytes()
            assert raw[h.data_offset + t.begin : h.data_offset + t.end] == want
            assert t.nbytes == len(want)
    assert h.tensor("a.empty").shape == (0, 4)
    assert h.tensor("a.scalar").shape == ()
    with pytest.raises(KeyError):
        h.tensor("nope")


def test_no_metadata_and_no_size(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(path))
    data = path.read_bytes()
    h = parse(data, sized=False)
    assert h.metadata == {}
    assert h == read_safetensors_header_path(path)
    assert h.tensors == (SafeTensor("x", "F32", (3,), 0, 12),)


def test_empty_file_of_tensors() -> None:
    h = parse(st_bytes({}))
    assert h.tensors == () and h.data_size == 0
    assert parse(st_bytes({"__metadata__": None})).metadata == {}


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [("F4", [2, 4], 4), ("F6_E2M3", [4], 3), ("F6_E3M2", [8], 6), ("F8_E4M3", [3], 3),
     ("F8_E5M2", [1], 1), ("F8_E8M0", [2], 2), ("BF16", [3], 6), ("C64", [2], 16),
     ("BOOL", [2], 2), ("U32", [2, 2], 16)],
)  # fmt: skip
def test_other_dtypes(dtype: str, shape: list[int], nbytes: int) -> None:
    data = st_bytes({"t": info(dtype, shape, 0, nbytes)}, b"\0" * nbytes)
    assert rust_accepts(data)
    (t,) = parse(data).tensors
    assert (t.dtype, t.shape, t.nbytes) == (dtype, tuple(shape), nbytes)


def test_reference_library_agrees_on_every_dtype_width() -> None:
    # For each dtype in our table, a tensor of 8 elements sized with our width must be
    # exactly what the installed reference library expects.
    for dtype, bits in DTYPE_BITS.items():
        n = 8  # elements: a whole number of bytes for every width
        data = st_bytes({"t": info(dtype, [n], 0, n * bits // 8)}, b"\0" * (n * bits // 8))
        assert rust_accepts(data), dtype
    assert not rust_accepts(st_bytes({"t": info("Q4", [1], 0, 1)}, b"\0"))


def test_padding_and_unknown_fields() -> None:
    h = parse(st_bytes(b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}'
                       + b" " * 13, b"\0", pad=False))  # fmt: skip
    assert h.tensors[0].name == "t"


# Hostile headers: (bytes, message, what the reference library does with them).
# True: it also refuses them. None: it accepts them; we are stricter on purpose.
CASES: list[tuple[str, bytes, str, bool | None]] = [
    ("empty", b"", "too short", True),
    ("short", b"\x01\x02\x03", "too short", True),
    ("huge length", struct.pack("<Q", 2**60) + b"{}", "over the 100000000-byte limit", True),
    ("length over cap", struct.pack("<Q", MAX_HEADER + 1) + b"{}", "limit", True),
    ("length past eof", struct.pack("<Q", 100) + b"{}" + b" " * 20, "runs past the end", True),
    ("zero length", struct.pack("<Q", 0), "does not start with", True),
    ("not an object", st_bytes(b"[1, 2]"), "does not start with", True),
    ("leading space", st_bytes(b" {}"), "does not start with", None),
    ("not utf-8", st_bytes(b'{"a\xff": 1}'), "not UTF-8", True),
    ("not json", st_bytes(b'{"a": }'), "not JSON", True),
    ("trailing junk", st_bytes(b"{} x", pad=False), "not JSON", True),
    ("deep", st_bytes(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested", True),
    ("info not object", st_bytes({"a": 1}), "is not an object", True),
    ("unknown dtype", st_bytes({"a": info("Q4_K", [1], 0, 1)}, b"\0"), "unknown dtype", True),
    ("lowercase dtype", st_bytes({"a": info("f32", [1], 0, 4)}, b"\0" * 4), "unknown dtype",
     True),
    ("no dtype", st_bytes({"a": {"shape": [1], "data_offsets": [0, 1]}}, b"\0"), "dtype", True),
    ("negative dim", st_bytes({"a": info("U8", [-1], 0, 1)}, b"\0"), "bad shape", True),
    ("float dim", st_bytes({"a": info("U8", [1.0], 0, 1)}, b"\0"), "bad shape", True),  # type: ignore[list-item]
    ("bool dim", st_bytes({"a": info("U8", [True], 0, 1)}, b"\0"), "bad shape", True),
    ("shape not list", st_bytes({"a": {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]}},
                                b"\0"), "bad shape", True),
    ("three offsets", st_bytes({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}},
                               b"\0"), "bad data_offsets", True),
    ("negative offset", st_bytes({"a": info("U8", [1], -1, 0)}, b""), "bad data_offsets", True),
    ("no offsets", st_bytes({"a": {"dtype": "U8", "shape": [1]}}, b"\0"), "data_offsets", True),
    ("hole", st_bytes({"a": info("F32", [1], 0, 4), "b": info("F32", [1], 8, 12)}, b"\0" * 12),
     "hole", True),
    ("overlap", st_bytes({"a": info("F32", [2], 0, 8), "b": info("F32", [2], 4, 12)},
                         b"\0" * 12), "overlap", True),
    ("not at 0", st_bytes({"a": info("F32", [1], 4, 8)}, b"\0" * 8), "expected to start at 0",
     True),
    ("end before begin", st_bytes({"a": info("F32", [1], 0, 4), "b": info("F32", [0], 4, 2)},
                                  b"\0" * 4), "hole or overlap", True),
    ("size mismatch", st_bytes({"a": info("F32", [2], 0, 4)}, b"\0" * 4), "does not match", True),
    ("half byte", st_bytes({"a": info("F4", [3], 0, 2)}, b"\0" * 2), "byte boundary", True),
    ("overflowing shape", st_bytes({"a": info("F32", [2**62, 2**62, 2**62], 0, 4)}, b"\0" * 4),
     "does not match", True),
    ("many dims", st_bytes({"a": info("U8", [2] * 50_000, 0, 4)}, b"\0" * 4), "does not match",
     True),
    ("trailing data", st_bytes({"a": info("U8", [1], 0, 1)}, b"\0" * 2), "file holds 2", True),
    ("short data", st_bytes({"a": info("U8", [8], 0, 8)}, b"\0" * 2), "file holds 2", True),
    ("huge offsets", st_bytes({"a": info("U8", [2**63], 0, 2**63)}, b""), "file holds 0", True),
    ("metadata list", st_bytes({"__metadata__": [1]}), "__metadata__", True),
    ("metadata int", st_bytes({"__metadata__": {"a": 1}}), "__metadata__", True),
    ("metadata surrogate", st_bytes(b'{"__metadata__": {"a": "\\udc00"}}'), "__metadata__", True),
    ("duplicate", st_bytes(b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},'
                           b' "a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}'),
     "duplicate key 'a'", None),
    ("nan", st_bytes(b'{"a": NaN}'), "NaN", True),
    ("long int", st_bytes(b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000
                          + b'], "data_offsets": [0, 1]}}', b"\0"), "not usable JSON", True),
    ("surrogate name", st_bytes(b'{"\\ud800": {"dtype": "U8", "shape": [0],'
                                b' "data_offsets": [0, 0]}}'), "not valid UTF-8", True),
]  # fmt: skip


@pytest.mark.parametrize(("data", "match", "reference"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_hostile(data: bytes, match: str, reference: bool | None) -> None:
    start = time.perf_counter()
    with pytest.raises(SafetensorsError, match=match) as caught:
        parse(data)
    assert time.perf_counter() - start < 0.5
    message = str(caught.value)
    assert message.startswith("bad.safetensors: ") and "\n" not in message
    if reference is True:
        assert not rust_accepts(data)
    elif reference is None:
        assert rust_accepts(data)


def test_truncated_without_size() -> None:
    data = st_bytes({"a": info("U8", [1], 0, 1)}, b"\0")
    with pytest.raises(SafetensorsError, match="truncated header"):
        parse(data[:20], sized=False)
    for cut in range(len(data) - 1):
        with pytest.raises(SafetensorsError):
            parse(data[:cut])


# ---------------------------------------------------------------------------------------
# Fuzzing: random headers must be judged as the reference library judges them (except
# where we are stricter on purpose, which these strategies never produce); mutated bytes
# must parse or raise SafetensorsError, nothing else.

DTYPES = [*DTYPE_BITS, "Q4", "int4"]


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 4))
    names = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n, unique=True))
    header: dict[str, Any] = {}
    pos = 0
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        elements = int(np.prod(shape)) if shape else 1
        size = elements * DTYPE_BITS.get(dtype, 8) // 8
        if draw(st.integers(0, 4)) == 0:
            begin, end = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        else:
            begin, end = pos, pos + size
        header[name] = info(dtype, shape, begin, end)
        pos = max(pos, end)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4)))
    data_len = pos + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return st_bytes(header, b"\0" * max(data_len, 0))


@settings(max_examples=200, deadline=None)
@given(data=headers())
def test_fuzz_agrees_with_reference(data: bytes) -> None:
    try:
        parse(data)
        ours = True
    except SafetensorsError:
        ours = False
    assert ours == rust_accepts(data)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**16), st.integers(0, 255)),
                 min_size=1, max_size=5),
    sized=st.booleans(),
)  # fmt: skip
def test_fuzz_mutations(ops: list[tuple[int, int, int]], sized: bool) -> None:
    seed = st_bytes(
        {
            "__metadata__": {"quant_type": "int4", "group_size": "64"},
            "w": info("U32", [4, 2], 0, 32),
            "w.scale": info("BF16", [4, 1], 32, 40),
            "w.bias": info("BF16", [4, 1], 40, 48),
        },
        bytes(range(48)),
    )
    buf = bytearray(seed)
    for kind, where, value in ops:
        if not buf:
            break
        i = where % len(buf)
        if kind == 0:
            buf[i] = value
        elif kind == 1:
            del buf[i:]
        else:
            buf[i:i] = bytes([value]) * (value % 5)
    try:
        parse(bytes(buf), sized=sized)
    except SafetensorsError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.sampled_from([b"", b"GGUF\x03\x00\x00\x00", struct.pack("<Q", 40) + b"{"]),
    body=st.binary(max_size=200),
    sized=st.booleans(),
)
def test_fuzz_random_bytes_both_readers(prefix: bytes, body: bytes, sized: bool) -> None:
    # The same bytes go to both readers; each must return or raise its own error.
    data = prefix + body
    size = len(data) if sized else None
    with contextlib.suppress(SafetensorsError):
        read_safetensors_header(io.BytesIO(data), "x", size)
    with contextlib.suppress(GGUFError):
        read_gguf_header(io.BytesIO(data), "x", size)
