"""Quantization by tensor type: how many tensors and bytes a model holds of each.

Ollama's safetensors (MLX) models store one tensor blob per weight
(`application/vnd.ollama.image.tensor`, the layer's `name` is the weight's name), each a
small safetensors file. Read from github.com/ollama/ollama @ fb30760 (2026-08-21):

- x/create/quantize.go (quantizeBlob, loadAndQuantizeArray): a quantized weight `W` is
  written as `W` (the packed values, dtype U32), `W.scale` and, for affine modes,
  `W.bias`. `__metadata__` is `{"quant_type": Q, "group_size": "<n>"}` when every
  quantized tensor in the blob shares Q; a blob mixing types instead carries
  `"W.quant_type"` and `"W.group_size"` per tensor. Unquantized tensors (norms,
  embeddings kept at source precision) have no quant metadata.
- x/create/prequant.go: already-quantized sources are fused the same way into
  `<base>.weight`, `.weight.scale`, `.weight.bias` and, for NVFP4, `.weight.global_scale`
  (F32 scalar); the blob's quant_type comes from the source config or is forced to
  "nvfp4".
- x/quant/quant.go: the quant types are `nvfp4` (default group 16), `mxfp4` (32), `mxfp8`
  (32), `int4` and `int8` (affine, 64). Affine scales and biases are in the weight's float
  dtype (BF16 in Ollama's tests); prequantized NVFP4 scales are E4M3 bytes relabelled U8.
- Experts can be stacked into one blob holding several weights (x/create/plan.go,
  planExpertGroup), each with its own companions.
- x/server/show.go (`ollama show`) takes `__metadata__["quant_type"]`, lowercased and
  trimmed (canonicalQuantType), and skips `.scale`, `.bias`, `.global_scale` companions
  when listing tensors; x/mlxrunner/model/root.go lets `<name>.quant_type` override it.

Here a companion's bytes count towards its weight's quant type, and only weights are
counted as tensors; tensors with no quant type are grouped by dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelfs.store.errors import StoreError
from modelfs.store.formats.gguf import GGUFHeader, read_gguf_header_path
from modelfs.store.formats.safetensors import SafetensorsHeader, read_safetensors_header_path
from modelfs.store.manifest import Layer, Manifest

if TYPE_CHECKING:
    from modelfs.store.scan import StoreIndex

log = logging.getLogger(__name__)

COMPANION_SUFFIXES = (".scale", ".bias", ".global_scale")
# Layer kinds whose blob is a GGUF file.
GGUF_KINDS = frozenset({"model", "projector", "draft", "adapter"})


@dataclass(frozen=True, slots=True)
class QuantRow:
    type: str
    count: int
    nbytes: int


class _Tally:
    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}

    def add(self, type_: str, count: int, nbytes: int) -> None:
        row = self.rows.setdefault(type_, [0, 0])
        row[0] += count
        row[1] += nbytes

    def result(self) -> list[QuantRow]:
        rows = [QuantRow(t, c, b) for t, (c, b) in self.rows.items()]
        # Biggest first, as `modelfs show` lists them; ties in a stable, readable order.
        rows.sort(key=lambda r: (-r.nbytes, -r.count, r.type))
        return rows


def quantization_breakdown_gguf(header: GGUFHeader) -> list[QuantRow]:
    """Tensors and bytes per ggml type (`Q4_K`, `F32`, …), most bytes first."""
    tally = _Tally()
    for t in header.tensors:
        tally.add(t.type_name, 1, t.nbytes)
    return tally.result()


def _quant_type(value: str | None) -> str:
    return (value or "").strip().lower()


def _owner(name: str, names: set[str]) -> str:
    """The weight a companion tensor belongs to, or `name` itself."""
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in names:
            return name[: -len(suffix)]
    return name


def quantization_breakdown_safetensors(headers: Iterable[SafetensorsHeader]) -> list[QuantRow]:
    """Tensors and bytes per quant type (`int4`, `nvfp4`, …) or dtype (`BF16`, …).

    One header per tensor blob. A weight's `.scale`, `.bias` and `.global_scale` count
    towards the weight's quant type; only the weight counts as a tensor.
    """
    tally = _Tally()
    for header in headers:
        meta = header.metadata
        blob_quant = _quant_type(meta.get("quant_type"))
        if not blob_quant and not any(k.endswith(".quant_type") for k in meta):
            # Plain dtypes, every tensor its own row: no owner to look up (a third of
            # `modelfs show` on a header of a million tensors).
            for t in header.tensors:
                row = tally.rows.setdefault(t.dtype, [0, 0])
                row[0] += 1
                row[1] += t.end - t.begin
            continue
        names = {t.name for t in header.tensors}
        for t in header.tensors:
            owner = _owner(t.name, names)
            quant = _quant_type(meta.get(f"{owner}.quant_type")) or blob_quant
            if quant:
                tally.add(quant, 1 if owner == t.name else 0, t.nbytes)
            else:
                tally.add(t.dtype, 1, t.nbytes)
    return tally.result()


def weight_header(index: StoreIndex, layer: Layer) -> GGUFHeader | SafetensorsHeader | None:
    """The header of a GGUF (`model`, `projector`, …) or `tensor` layer's blob; None when the
    blob is absent or the layer holds no weights. Raises OSError or StoreError on a bad blob."""
    if index.blob_info(layer.digest) is None:
        return None
    path = index.layout.blob(layer.digest)
    if layer.kind == "tensor":
        return read_safetensors_header_path(path)
    if layer.kind in GGUF_KINDS:
        return read_gguf_header_path(path)
    return None


def manifest_quantization(index: StoreIndex, manifest: Manifest) -> list[QuantRow]:
    """Tensor count and bytes per type: from the GGUF model layer, else the tensor blobs."""
    for layer in manifest.layers:
        if layer.kind == "model" and index.blob_info(layer.digest) is not None:
            try:
                header = weight_header(index, layer)
            except (OSError, StoreError) as exc:
                log.warning("%s: %s", layer.digest, exc)
                return []
            assert isinstance(header, GGUFHeader)
            return quantization_breakdown_gguf(header)
    # One header at a time, each let go once tallied: one blob may hold a million tensors.
    return quantization_breakdown_safetensors(_tensor_headers(index, manifest))


def _tensor_headers(index: StoreIndex, manifest: Manifest) -> Iterator[SafetensorsHeader]:
    for layer in manifest.layers:
        if layer.kind != "tensor":
            continue
        try:
            header = weight_header(index, layer)
        except (OSError, StoreError) as exc:
            log.warning("%s (%s): %s", layer.digest, layer.name, exc)
            continue
        if isinstance(header, SafetensorsHeader):
            yield header
