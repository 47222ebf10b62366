"""store.gguf against the reference writer and reader (the `gguf` package), and hostile input."""

from __future__ import annotations

import contextlib
import io
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

import modelfs.store.formats.gguf as sg
from modelfs.store.errors import GGUFError
from modelfs.store.formats.gguf import (
    GGML_TYPES,
    KEEP_ARRAY,
    ArraySummary,
    GGUFHeader,
    read_gguf_header,
    read_gguf_header_path,
)

# (name, numpy shape of the logical tensor, type): quantized tensors are written as raw
# bytes of the right size, so the writer needs no quantizer.
TENSORS: list[tuple[str, tuple[int, ...], Q]] = [
    ("token_embd.weight", (8, 512), Q.Q4_K),
    ("blk.0.attn_q.weight", (4, 256), Q.Q6_K),
    ("blk.0.attn_k.weight", (2, 64), Q.Q4_0),
    ("blk.0.attn_v.weight", (2, 64), Q.Q8_0),
    ("blk.0.ffn_up.weight", (3, 256), Q.IQ4_XS),
    ("blk.0.ffn_down.weight", (2, 32), Q.MXFP4),
    ("blk.0.ffn_gate.weight", (1, 256), Q.TQ2_0),
    ("blk.0.attn_out.weight", (2, 5, 32), Q.Q5_1),
    ("blk.0.attn_norm.weight", (64,), Q.F32),
    ("output_norm.weight", (7,), Q.F16),
    ("rope_freqs", (3,), Q.BF16),
    ("blk.0.mask", (2, 2, 2, 3), Q.I32),
]


def _raw(numpy_shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    *rows, cols = numpy_shape
    assert cols % block == 0
    return np.arange(int(np.prod(rows, dtype=np.int64)) * (cols // block) * size, dtype=np.uint8)


def write_gguf(
    path: Path,
    tensors: list[tuple[str, tuple[int, ...], Q]] = TENSORS,
    *,
    arch: str = "llama",
    alignment: int | None = None,
    extra: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None,
) -> Path:
    w = GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_context_length(8192)
    w.add_embedding_length(256)
    w.add_file_type(15)
    w.add_name("tiny")
    for key, (value, vtype, sub) in (extra or {}).items():
        w.add_key_value(key, value, vtype, sub)
    for name, shape, qtype in tensors:
        w.add_tensor(name, _raw(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SMALL_KVS: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
    "test.u8": (200, GGUFValueType.UINT8, None),
    "test.i8": (-100, GGUFValueType.INT8, None),
    "test.u16": (60000, GGUFValueType.UINT16, None),
    "test.i16": (-30000, GGUFValueType.INT16, None),
    "test.u32": (4_000_000_000, GGUFValueType.UINT32, None),
    "test.i32": (-2_000_000_000, GGUFValueType.INT32, None),
    "test.f32": (0.5, GGUFValueType.FLOAT32, None),
    "test.bool": (True, GGUFValueType.BOOL, None),
    "test.str": ("héllo {{ template }} ✓", GGUFValueType.STRING, None),
    "test.u64": (2**63 + 5, GGUFValueType.UINT64, None),
    "test.i64": (-(2**62), GGUFValueType.INT64, None),
    "test.f64": (-1.25, GGUFValueType.FLOAT64, None),
    "test.arr_i32": ([1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "test.arr_f32": ([0.25, 1.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "test.arr_bool": ([True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    "test.arr_str": (["a", "ü", ""], GGUFValueType.ARRAY, GGUFValueType.STRING),
}
EXTRA_KVS = {
    **SMALL_KVS,
    "test.arr_kept": (list(range(KEEP_ARRAY)), GGUFValueType.ARRAY, GGUFValueType.UINT16),
    "test.arr_big": (list(range(KEEP_ARRAY + 1)), GGUFValueType.ARRAY, GGUFValueType.UINT16),
    "test.arr_bigstr": (
        [str(i) for i in range(KEEP_ARRAY + 1)],
        GGUFValueType.ARRAY,
        GGUFValueType.STRING,
    ),
}


def _reference_value(field: gguf.ReaderField) -> Any:
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_matches_reference_reader(tmp_path: Path, alignment: int | None) -> None:
    path = write_gguf(tmp_path / "m.gguf", alignment=alignment, extra=EXTRA_KVS)
    ours = read_gguf_header_path(path)
    ref = gguf.GGUFReader(path)

    assert ours.version == 3
    assert ours.alignment == ref.alignment == (alignment or 32)
    assert ours.data_offset == ref.data_offset
    assert ours.data_offset % ours.alignment == 0

    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert mine.type_name == theirs.tensor_type.name
        assert mine.offset == theirs.data_offset
        assert mine.nbytes == theirs.n_bytes
        assert mine.n_elements == theirs.n_elements
        assert mine.is_known_type

    ref_kv = {name: field for name, field in ref.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.kv) == list(ref_kv)
    for key, field in ref_kv.items():
        mine = ours.kv[key]
        if isinstance(mine, ArraySummary):
            assert mine.item_type == field.types[-1]
            assert mine.length == len(field.data)
            assert len(field.data) > KEEP_ARRAY
        else:
            assert mine == _reference_value(field), key
    assert ours.kv["test.arr_kept"] == list(range(KEEP_ARRAY))
    assert ours.kv["test.arr_big"] == ArraySummary(GGUFValueType.UINT16, KEEP_ARRAY + 1)
    assert ours.kv["test.arr_bigstr"] == ArraySummary(GGUFValueType.STRING, KEEP_ARRAY + 1)
    assert type(ours.kv["test.bool"]) is bool


def test_properties(tmp_path: Path) -> None:
    h = read_gguf_header_path(write_gguf(tmp_path / "m.gguf"))
    assert h.architecture == "llama"
    assert h.file_type == 15
    assert h.file_type_name == "Q4_K_M"
    assert h.context_length == 8192
    assert h.embedding_length == 256
    assert h.parameter_count == sum(int(np.prod(shape)) for _, shape, _ in TENSORS)

    explicit = write_gguf(
        tmp_path / "p.gguf",
        arch="qwen3",
        extra={"general.parameter_count": (123_456, GGUFValueType.UINT64, None)},
    )
    h = read_gguf_header_path(explicit)
    assert h.parameter_count == 123_456
    assert h.architecture == "qwen3"
    assert h.context_length == 8192  # qwen3.context_length


@pytest.mark.parametrize(
    ("file_type", "name"),
    [(0, "F32"), (1, "F16"), (7, "Q8_0"), (15, "Q4_K_M"), (32, "BF16"), (38, "MXFP4_MOE"),
     (39, "NVFP4"), (40, "Q1_0"), (4, "unknown"), (33, "unknown"), (41, "unknown"),
     (1024, "unknown")],
)  # fmt: skip
def test_file_type_names(file_type: int, name: str) -> None:
    h = GGUFHeader(3, {"general.file_type": file_type}, (), 32, 32)
    assert h.file_type_name == name


def test_missing_keys() -> None:
    h = GGUFHeader(3, {}, (), 32, 32)
    assert h.architecture == ""
    assert h.file_type is None
    assert h.file_type_name == "unknown"
    assert h.context_length is None
    assert h.parameter_count == 0


def test_type_table_matches_reference_package() -> None:
    for qtype, (block, size) in GGML_QUANT_SIZES.items():
        name, our_block, our_size = GGML_TYPES[int(qtype)]
        assert name == qtype.name
        assert our_block == block
        if qtype == Q.Q8_1:
            # gguf-py still sizes block_q8_1 with two f32s; ggml-common.h has two halves.
            assert our_size == 36
        else:
            assert our_size == size, qtype


def test_file_object_and_path_agree(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    by_path = read_gguf_header_path(path)
    assert read_gguf_header(io.BytesIO(data), "mem") == by_path
    assert read_gguf_header(io.BytesIO(data), "mem", len(data)) == by_path


class Trickle(io.RawIOBase):
    """A stream that returns at most 7 bytes a read, as a pipe or socket may."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = 7 if n < 0 else min(n, 7)
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


def test_short_reads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", extra=EXTRA_KVS)
    data = path.read_bytes()
    assert read_gguf_header(Trickle(data), "pipe") == read_gguf_header_path(path)  # type: ignore[arg-type]


def test_tokenizer_header_is_fast(tmp_path: Path) -> None:
    n = 150_000
    path = tmp_path / "tok.gguf"
    w = GGUFWriter(path, "llama")
    w.add_token_list([f"▁token-{i:06d}-" + "x" * (i % 160) for i in range(n)])
    w.add_token_merges([f"▁tok{i} en{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_scores([0.0] * n)
    w.add_tensor("t", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = path.stat().st_size
    assert size > 20_000_000

    start = time.perf_counter()
    h = read_gguf_header_path(path)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    assert h.kv["tokenizer.ggml.tokens"] == ArraySummary(GGUFValueType.STRING, n)
    assert h.kv["tokenizer.ggml.merges"] == ArraySummary(GGUFValueType.STRING, n)
    assert h.kv["tokenizer.ggml.token_type"] == ArraySummary(GGUFValueType.INT32, n)
    # (gguf.GGUFReader takes ~9 s on this file; the writer puts the one tensor last.)
    assert h.tensors[0].offset == size - 32


# ---------------------------------------------------------------------------------------
# A small encoder of our own, to write what no well-behaved writer would.


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str | bytes, dims: list[int], ggml_type: int, offset: int) -> bytes:
    out = s(name) + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    return out + struct.pack("<IQ", ggml_type, offset)


def build(
    kvs: Sequence[bytes] = (),
    tensors: Sequence[bytes] = (),
    *,
    data: bytes = b"",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    align: int = 32,
) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)  # fmt: skip
    head += b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    return head + data


def parse(data: bytes, *, sized: bool = True) -> GGUFHeader:
    return read_gguf_header(io.BytesIO(data), "bad.gguf", len(data) if sized else None)


def refuse(data: bytes, match: str, *, sized: bool = True) -> GGUFError:
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as info:
        parse(data, sized=sized)
    assert time.perf_counter() - start < 0.5
    message = str(info.value)
    assert message.startswith("bad.gguf: ")
    assert "\n" not in message
    return info.value


U32_KV = kv("general.alignment", 4, struct.pack("<I", 32))
ONE_F32 = tinfo("w", [4], 0, 0)


def test_builder_makes_valid_files(tmp_path: Path) -> None:
    data = build([kv("general.architecture", 8, s("llama"))], [ONE_F32], data=b"\0" * 16)
    (tmp_path / "b.gguf").write_bytes(data)
    ref = gguf.GGUFReader(tmp_path / "b.gguf")
    h = parse(data)
    assert h.architecture == "llama"
    assert h.data_offset == ref.data_offset == len(data) - 16
    assert h.tensors[0].offset == ref.tensors[0].data_offset
    assert h.tensors[0].nbytes == ref.tensors[0].n_bytes == 16


def test_version_2() -> None:
    assert parse(build([U32_KV], version=2)).version == 2


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "too short"),
        (b"GGU", "too short"),
        (b"GGML" + b"\0" * 40, "not a GGUF file"),
        (b"\0" * 64, "not a GGUF file"),
        (build(version=1), "unsupported GGUF version 1"),
        (build(version=4), "unsupported GGUF version 4"),
        (build(version=0x03000000), "big-endian"),
    ],
)
def test_bad_magic_and_version(data: bytes, match: str) -> None:
    refuse(data, match)
    refuse(data, match, sized=False)


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    data = write_gguf(tmp_path / "m.gguf", TENSORS[:3], extra=SMALL_KVS).read_bytes()
    header_end = gguf.GGUFReader(tmp_path / "m.gguf").data_offset
    # Every cut inside the header (short of the alignment padding, which is never read);
    # with the size known, every cut into the tensor data too.
    for cut in range(0, header_end - 32, 3):
        with pytest.raises(GGUFError):
            parse(data[:cut], sized=False)
    data_end = max(t.offset + t.nbytes for t in parse(data).tensors)
    for cut in range(0, data_end, 11):
        with pytest.raises(GGUFError):
            parse(data[:cut])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (build(n_tensors=2**60), "claims 1152921504606846976 tensors"),
        (build(n_kv=2**60), "claims 1152921504606846976 metadata keys"),
        (build(n_tensors=sg.MAX_TENSORS), "cannot fit"),
        (build(n_kv=sg.MAX_KVS), "cannot fit"),
        (build([kv("k", 8, struct.pack("<Q", 2**60))]), "limit"),
        (build([kv("k", 8, struct.pack("<Q", sg.MAX_STRING + 1))]), "limit"),
        (build([struct.pack("<Q", 2**62) + b"k"]), "limit"),
        (build([s("k" * (sg.MAX_NAME + 1)) + b"\x04\0\0\0"]), "limit"),
        (build([kv("a", 9, struct.pack("<IQ", 0, 2**60))]), "claims"),
        (build([kv("a", 9, struct.pack("<IQ", 8, 2**60))]), "claims"),
        (build([kv("a", 9, struct.pack("<IQ", 8, sg.MAX_ARRAY))]), "cannot fit"),
        (build([kv("a", 9, struct.pack("<IQ", 10, sg.MAX_ARRAY))]), "cannot fit|truncated"),
        (build([kv("a", 9, struct.pack("<IQ", 8, 3) + s("x") + struct.pack("<Q", 2**40))]),
         "limit"),
        (build([kv("a", 9, struct.pack("<IQ", 8, 5000) + struct.pack("<Q", 2**40))],
               data=b"\0" * 50_000), "limit"),
        (build([kv("a", 9, struct.pack("<IQ", 8, 5000) + struct.pack("<Q", 2**40))]),
         "cannot fit"),
    ],
)  # fmt: skip
def test_huge_claims_fail_fast(data: bytes, match: str) -> None:
    refuse(data, match)


def test_huge_claims_fail_fast_without_size() -> None:
    refuse(build(n_tensors=2**60), "claims", sized=False)
    refuse(build(n_tensors=sg.MAX_TENSORS), "truncated", sized=False)
    refuse(build([kv("a", 9, struct.pack("<IQ", 8, sg.MAX_ARRAY))]), "truncated", sized=False)
    refuse(build([kv("a", 9, struct.pack("<IQ", 10, sg.MAX_ARRAY))]), "truncated", sized=False)
    refuse(build([kv("k", 8, struct.pack("<Q", sg.MAX_STRING))]), "truncated", sized=False)


class Zeros(io.RawIOBase):
    """`prefix`, then zeros forever: a header that never ends, without the memory."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.prefix:
            out, self.prefix = self.prefix[:n], self.prefix[n:]
            return out
        return bytes(n)


def test_big_arrays_are_skipped_without_holding_them() -> None:
    # A 128 MiB array is skipped in chunks; the key after it reads as empty.
    big = kv("a", 9, struct.pack("<IQ", 10, sg.MAX_ARRAY))
    prefix = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + big
    start = time.perf_counter()
    with pytest.raises(GGUFError, match="key 1 is empty"):
        read_gguf_header(Zeros(prefix), "inf.gguf")  # type: ignore[arg-type]
    assert time.perf_counter() - start < 2


def test_header_size_cap() -> None:
    class Repeating(io.RawIOBase):
        """The same array KV over and over, each followed by its 128 MiB of zeros."""

        def __init__(self) -> None:
            self.pending = b"GGUF" + struct.pack("<IQQ", 3, 0, 10)
            self.zeros = 0
            self.n = 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            if not self.pending and not self.zeros:
                self.pending = kv(f"k{self.n}", 9, struct.pack("<IQ", 10, sg.MAX_ARRAY))
                self.zeros = sg.MAX_ARRAY * 8
                self.n += 1
            if self.pending:
                out, self.pending = self.pending[:n], self.pending[n:]
                return out
            k = min(n, self.zeros)
            self.zeros -= k
            return bytes(k)

    start = time.perf_counter()
    with pytest.raises(GGUFError, match="larger than 512 MiB"):
        read_gguf_header(Repeating(), "inf.gguf")  # type: ignore[arg-type]
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (build([kv(b"gen\xffral", 4, b"\0\0\0\0")]), "not valid UTF-8"),
        (build([kv("", 4, b"\0\0\0\0")]), "empty"),
        (build([kv("k", 4, b"\0\0\0\0"), kv("k", 4, b"\0\0\0\0")]), "duplicate key 'k'"),
        (build([kv("k", 13, b"\0" * 8)]), "unknown value type 13"),
        (build([kv("k", 0xFFFFFFFF, b"\0" * 8)]), "unknown value type"),
        (build([kv("k", 9, struct.pack("<IQ", 13, 1) + b"\0" * 8)]), "unknown item type 13"),
        (build([kv("k", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 0))]), "holds arrays"),
        (build([kv("k" * 5000, 13, b"")]), r"^bad.gguf: key 'k{80}…' has unknown value type 13$"),
        (build([kv("general.alignment", 4, struct.pack("<I", 48))]), "not a power of 2"),
        (build([kv("general.alignment", 4, struct.pack("<I", 0))]), "not a power of 2"),
        (build([kv("general.alignment", 8, s("32"))]), "not a power of 2"),
        (build(tensors=[tinfo(b"w\xc3", [4], 0, 0)]), "not valid UTF-8"),
        (build(tensors=[ONE_F32, ONE_F32], data=b"\0" * 32), "duplicate tensor 'w'"),
        (build(tensors=[tinfo("w", [1, 1, 1, 1, 1], 0, 0)]), "5 dimensions"),
        (build(tensors=[s("w") + struct.pack("<I", 2**32 - 1)]), "4294967295 dimensions"),
        (build(tensors=[tinfo("w", [4, 2**63], 0, 0)]), "negative dimension"),
        (build(tensors=[tinfo("w", [2**32, 2**31], 0, 0)]), "too many elements"),
        (build(tensors=[tinfo("w", [100], int(Q.Q4_K), 0)]), "not a multiple of the block"),
        (build(tensors=[tinfo("w", [], int(Q.Q4_0), 0)]), "not a multiple of the block"),
        (build(tensors=[ONE_F32], data=b"\0" * 15), "runs past the end"),
        (build(tensors=[tinfo("w", [4], 0, 2**62)], data=b"\0" * 16), "runs past the end"),
        (build(tensors=[tinfo("w", [2**40, 2**20], 0, 0)]), "runs past the end"),
        (build(tensors=[ONE_F32])[:57], "would start at 64, past the end of the file"),
    ],
)  # fmt: skip
def test_malformed(data: bytes, match: str) -> None:
    refuse(data, match)


def test_bad_utf8_in_values_is_replaced() -> None:
    h = parse(build([kv("k", 8, s(b"caf\xe9")), kv("a", 9, struct.pack("<IQ", 8, 1) + s(b"\xff"))]))
    assert h.kv["k"] == "caf\ufffd"
    assert h.kv["a"] == ["\ufffd"]


def test_unknown_and_removed_ggml_types_are_flagged() -> None:
    data = build(
        tensors=[tinfo("a", [64], 99, 0), tinfo("b", [32], 4, 0), tinfo("c", [64], 42, 0)],
        data=b"\0" * 18,
    )
    a, b, c = parse(data).tensors
    assert (a.type_name, a.nbytes, a.is_known_type) == ("type99", 0, False)
    assert (b.type_name, b.nbytes) == ("type4", 0)
    assert (c.type_name, c.nbytes) == ("Q2_0", 18)  # newer than the gguf package


def test_zero_tensors_and_scalars() -> None:
    h = parse(build([U32_KV]))
    assert h.tensors == () and h.data_offset % 32 == 0
    h = parse(build(tensors=[tinfo("s", [], 0, 0), tinfo("e", [0, 3], 0, 0)], data=b"\0" * 4))
    assert h.tensors[0].shape == () and h.tensors[0].nbytes == 4
    assert h.tensors[1].n_elements == 0 and h.tensors[1].nbytes == 0


def test_tensor_offsets_without_size_are_not_checked() -> None:
    h = parse(build(tensors=[tinfo("w", [4], 0, 2**40)]), sized=False)
    assert h.tensors[0].offset == h.data_offset + 2**40


# ---------------------------------------------------------------------------------------
# Fuzzing: any bytes either parse or raise GGUFError; nothing else escapes.


@pytest.fixture(scope="module")
def seed_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("seed") / "seed.gguf"
    return write_gguf(path, TENSORS[:4], extra=SMALL_KVS).read_bytes()


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, where, value in ops:
        if not buf:
            break
        i = where % len(buf)
        if kind == 0:
            buf[i] = value & 0xFF
        elif kind == 1:
            buf[i : i + 8] = struct.pack("<Q", value)
        elif kind == 2:
            del buf[i:]
        else:
            buf[i:i] = bytes([value & 0xFF]) * (value % 17)
    return bytes(buf)


OPS = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.integers(0, 2**20),
        st.one_of(st.integers(0, 255), st.integers(0, 2**64 - 1)),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, sized=st.booleans())
def test_fuzz_mutations(seed_gguf: bytes, ops: list[tuple[int, int, int]], sized: bool) -> None:
    data = _mutate(seed_gguf, ops)
    try:
        h = parse(data, sized=sized)
    except GGUFError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(h, GGUFHeader)


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=300), version=st.sampled_from([2, 3]))
def test_fuzz_random_bodies(body: bytes, version: int) -> None:
    data = b"GGUF" + struct.pack("<I", version) + body
    with contextlib.suppress(GGUFError):
        parse(data)
