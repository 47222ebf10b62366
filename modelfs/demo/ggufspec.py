"""GGUF files from a spec: tensors of deterministic noise that dequantize to small finite
numbers, headers written by the gguf package's own writer, and the KV helpers every family
shares."""

from __future__ import annotations

import logging
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT
_CHUNK = 4 << 20


# --------------------------------------------------------------------------------------------
# Deterministic bytes


def seeded_rng(*parts: str | int) -> np.random.Generator:
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
class TensorSpec:
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
        rng = seeded_rng(seed, self.name)
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

# gguf's writer logs at INFO on every file ("Writing the following files: ..."), which a
# command that prints its own summary must not show. Filtering its logger only while our
# writer runs leaves logging as a library user configured it, gguf's other messages included.
_GGUF_WRITER_LOG = logging.getLogger("gguf.gguf_writer")


def _drop_info(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO


@contextmanager
def _writer_quiet() -> Iterator[None]:
    _GGUF_WRITER_LOG.addFilter(_drop_info)
    try:
        yield
    finally:
        _GGUF_WRITER_LOG.removeFilter(_drop_info)


@dataclass
class GGUFSpec:
    arch: str
    kv: dict[str, Any]
    tensors: list[TensorSpec]

    def header(self) -> bytes:
        """Magic, KVs and tensor infos, written by the gguf package's own writer."""
        with _writer_quiet(), tempfile.TemporaryDirectory(prefix="modelfs-demo-") as tmp:
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
        yield bytes(-len(head) % ALIGN)
        for t in self.tensors:
            yield from t.chunks(seed)
            yield bytes(-t.nbytes % ALIGN)


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


@dataclass(frozen=True, slots=True)
class Dims:
    embd: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    experts: int = 0
    ff_exp: int = 0
    unused_tokens: int = 0


def row_bytes(qtype: Q, width: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return width // block * size


def arch_kv(arch: str, d: Dims, context: int, extra: dict[str, Any]) -> dict[str, Any]:
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


def general_kv(
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
