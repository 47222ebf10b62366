"""store.quant: quantization breakdowns of GGUF headers and Ollama tensor blobs."""

from __future__ import annotations

import io
import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from modelfs.store.formats.gguf import GGUFHeader, GGUFTensor, read_gguf_header_path
from modelfs.store.formats.quant import (
    QuantRow,
    quantization_breakdown_gguf,
    quantization_breakdown_safetensors,
)
from modelfs.store.formats.safetensors import (
    DTYPE_BITS,
    SafetensorsHeader,
    read_safetensors_header,
    read_safetensors_header_path,
)


def test_gguf_breakdown_matches_reference_reader(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "llama")
    for name, shape, qtype in [
        ("token_embd.weight", (8, 512), Q.Q4_K),
        ("blk.0.ffn_up.weight", (4, 256), Q.Q4_K),
        ("blk.0.ffn_down.weight", (4, 256), Q.Q6_K),
        ("blk.0.attn_q.weight", (2, 64), Q.Q8_0),
        ("blk.0.attn_norm.weight", (64,), Q.F32),
        ("output_norm.weight", (7,), Q.F32),
    ]:
        block, size = GGML_QUANT_SIZES[qtype]
        *rows, cols = shape
        w.add_tensor(name, np.zeros((*rows, cols // block * size), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    rows = quantization_breakdown_gguf(read_gguf_header_path(path))
    assert rows == [
        QuantRow("Q4_K", 2, 8 * 2 * 144 + 4 * 144),
        QuantRow("Q6_K", 1, 4 * 210),
        QuantRow("F32", 2, (64 + 7) * 4),
        QuantRow("Q8_0", 1, 2 * 2 * 34),
    ]
    ref: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t in gguf.GGUFReader(path).tensors:
        ref[t.tensor_type.name][0] += 1
        ref[t.tensor_type.name][1] += int(t.n_bytes)
    assert {r.type: [r.count, r.nbytes] for r in rows} == ref


def test_gguf_breakdown_order_and_unknown_types() -> None:
    def t(name: str, type_name: str, nbytes: int) -> GGUFTensor:
        return GGUFTensor(name, (1,), 0, type_name, 0, nbytes)

    header = GGUFHeader(
        3,
        {},
        (t("a", "F16", 10), t("b", "Q8_0", 10), t("c", "Q8_0", 0), t("d", "type99", 0),
         t("e", "BF16", 10), t("f", "Q4_K", 50)),
        32,
        64,
    )  # fmt: skip
    assert quantization_breakdown_gguf(header) == [
        QuantRow("Q4_K", 1, 50),
        QuantRow("Q8_0", 2, 10),
        QuantRow("BF16", 1, 10),
        QuantRow("F16", 1, 10),
        QuantRow("type99", 1, 0),
    ]
    assert quantization_breakdown_gguf(GGUFHeader(3, {}, (), 32, 32)) == []


def blob(
    tensors: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None
) -> bytes:
    """A tensor blob laid out as Ollama's writers lay it out: tensors in order, no gaps."""
    header: dict[str, Any] = {}
    pos = 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape)) * DTYPE_BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = struct.pack("<Q", len(raw)) + raw + bytes(pos)
    safetensors.deserialize(data)  # the reference library must accept every fixture
    return data


def read(data: bytes) -> SafetensorsHeader:
    return read_safetensors_header(io.BytesIO(data), "blob", len(data))


W = "model.layers.0.mlp.up_proj.weight"
INT4 = blob(  # 160 bytes: U32 [8, 4] + BF16 scale [8, 1] + BF16 bias [8, 1]
    [(W, "U32", [8, 4]), (W + ".scale", "BF16", [8, 1]), (W + ".bias", "BF16", [8, 1])],
    {"quant_type": "int4", "group_size": "64"},
)
NVFP4 = blob(  # 148 bytes: U32 [16, 2] + U8 scale [16, 1] + F32 global scale [1]
    [
        ("m.down.weight", "U32", [16, 2]),
        ("m.down.weight.scale", "U8", [16, 1]),
        ("m.down.weight.global_scale", "F32", [1]),
    ],
    {"quant_type": " NVFP4 ", "group_size": "16"},
)
MXFP8 = blob(  # 136 bytes: U32 [8, 4] + U8 scale [8, 1]
    [("m.gate.weight", "U32", [8, 4]), ("m.gate.weight.scale", "U8", [8, 1])],
    {"quant_type": "mxfp8", "group_size": "32"},
)
NORM = blob([("model.norm.weight", "BF16", [64])])  # 128 bytes
EXPERTS = blob(  # two stacked expert weights in one blob, 2 x 160 bytes
    [
        ("e.gate.weight", "U32", [2, 4, 4]),
        ("e.gate.weight.scale", "BF16", [2, 4, 1]),
        ("e.gate.weight.bias", "BF16", [2, 4, 1]),
        ("e.up.weight", "U32", [2, 4, 4]),
        ("e.up.weight.scale", "BF16", [2, 4, 1]),
        ("e.up.weight.bias", "BF16", [2, 4, 1]),
    ],
    {"quant_type": "int4", "group_size": "32"},
)
MIXED = blob(  # int8 weight (64 + 8 + 8 bytes) beside an unquantized F16 one (32 bytes)
    [
        ("x.weight", "U32", [4, 4]),
        ("x.weight.scale", "BF16", [4, 1]),
        ("x.weight.bias", "BF16", [4, 1]),
        ("y.weight", "F16", [4, 4]),
    ],
    {"x.weight.quant_type": "int8", "x.weight.group_size": "64"},
)
# A genuine bias, not a quantization companion: there is no tensor "attn.q" it could
# belong to, so it is counted as its own F32 tensor.
BIASED = blob([("attn.q.bias", "F32", [4]), ("attn.q.weight", "F32", [4, 4])])


def test_safetensors_breakdown() -> None:
    headers = [read(b) for b in (INT4, NVFP4, MXFP8, NORM, EXPERTS, MIXED, BIASED)]
    assert quantization_breakdown_safetensors(headers) == [
        QuantRow("int4", 3, 160 + 2 * 160),
        QuantRow("nvfp4", 1, 148),
        QuantRow("mxfp8", 1, 136),
        QuantRow("BF16", 1, 128),
        QuantRow("F32", 2, 16 + 64),  # ties on bytes: more tensors first
        QuantRow("int8", 1, 80),
        QuantRow("F16", 1, 32),
    ]


def test_safetensors_breakdown_counts_every_byte() -> None:
    blobs = (INT4, NVFP4, MXFP8, NORM, EXPERTS, MIXED, BIASED)
    headers = [read(b) for b in blobs]
    rows = quantization_breakdown_safetensors(headers)
    assert sum(r.nbytes for r in rows) == sum(h.data_size for h in headers)
    assert sum(len(b) - read(b).data_offset for b in blobs) == sum(r.nbytes for r in rows)


def test_safetensors_breakdown_by_dtype_without_metadata() -> None:
    # Without quant metadata a U32 weight and its scale are only what their dtypes say.
    bare = blob([(W, "U32", [8, 4]), (W + ".scale", "BF16", [8, 1])])
    assert quantization_breakdown_safetensors([read(bare)]) == [
        QuantRow("U32", 1, 128),
        QuantRow("BF16", 1, 16),
    ]
    assert quantization_breakdown_safetensors([]) == []


def test_safetensors_breakdown_from_files(tmp_path: Path) -> None:
    # Blobs on disk, one written by the reference writer with Ollama's metadata keys.
    save_file(
        {W: np.zeros((8, 4), np.uint32), W + ".scale": np.zeros((8, 1), np.float16)},
        str(tmp_path / "q.safetensors"),
        metadata={"quant_type": "int8", "group_size": "64"},
    )
    (tmp_path / "n.safetensors").write_bytes(NORM)
    names = ("q.safetensors", "n.safetensors")
    headers = [read_safetensors_header_path(tmp_path / n) for n in names]
    assert quantization_breakdown_safetensors(headers) == [
        QuantRow("int8", 1, 128 + 16),
        QuantRow("BF16", 1, 128),
    ]
