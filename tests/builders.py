"""Tiny stores built in a test, byte-compatible with what Ollama writes."""

from __future__ import annotations

import array
import json
import os
from pathlib import Path
from typing import Any

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_CONFIG, MEDIA_LIST, MEDIA_MANIFEST
from modelfs.store.names import Name, parse_name

LAYER = "application/vnd.ollama.image."


def compact(obj: Any) -> bytes:
    """Compact JSON plus a newline, as Ollama's encoder writes local manifests."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class TinyStore:
    def __init__(self, root: Path) -> None:
        self.layout = Layout(root)
        self.blobs = BlobStore(self.layout)
        self.blobs.ensure_dirs()
        self.layout.manifests.mkdir(parents=True, exist_ok=True)

    @property
    def root(self) -> Path:
        return self.layout.root

    def blob(self, data: bytes) -> Digest:
        return self.blobs.put_bytes(data)

    def layer(self, kind: str, data: bytes, **extra: str) -> dict[str, Any]:
        media = kind if "/" in kind else LAYER + kind
        return {"mediaType": media, "digest": str(self.blob(data)), "size": len(data), **extra}

    def manifest(
        self,
        layers: list[dict[str, Any]],
        config: dict[str, Any] | None = None,
        **top: str,
    ) -> bytes:
        cfg_bytes = json.dumps(
            config or {"model_format": "gguf", "model_family": "llama", "file_type": "Q4_K_M"}
        ).encode()
        cfg = self.layer(MEDIA_CONFIG, cfg_bytes)
        obj: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": cfg,
            "layers": layers,
            **top,
        }
        return compact(obj)

    def gguf_model(self, name: str, payload: bytes = b"GGUF-ish weights", **cfg: str) -> bytes:
        """A legacy tag with a model, template and license layer."""
        raw = self.manifest(
            [
                self.layer("model", payload),
                self.layer("template", b"{{ .Prompt }}"),
                self.layer("license", b"MIT"),
            ],
            {"model_format": "gguf", "model_family": "llama", "file_type": "Q4_K_M", **cfg},
        )
        self.legacy(name, raw)
        return raw

    def legacy(
        self,
        name: str | Name,
        raw: bytes,
        mtime: float | None = None,
        *,
        mtime_ns: int | None = None,
    ) -> Path:
        n = parse_name(name) if isinstance(name, str) else name
        path = self.blobs.write_legacy_manifest(n, raw)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        if mtime_ns is not None:
            os.utime(path, ns=(mtime_ns, mtime_ns))
        return path

    def v2(self, name: str | Name, raw: bytes, *, mtime_ns: int | None = None) -> Path:
        """A manifests-v2 symlink; `mtime_ns` is set on the manifest blob it points at."""
        n = parse_name(name) if isinstance(name, str) else name
        path = self.blobs.write_v2_manifest(n, raw)
        if mtime_ns is not None:
            os.utime(path, ns=(mtime_ns, mtime_ns))
        return path

    def manifest_list(self, children: list[tuple[bytes, str, str]]) -> bytes:
        """A list of references to child manifests stored as blobs: (raw, runner, format)."""
        refs = []
        for raw, runner, fmt in children:
            refs.append(
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": str(self.blob(raw)),
                    "runner": runner,
                    "format": fmt,
                }
            )
        return compact({"schemaVersion": 2, "mediaType": MEDIA_LIST, "manifests": refs})


# (tensor name, numpy shape of the logical tensor, ggml type name such as "Q4_K" or "F32")
GGUFTensorSpec = tuple[str, tuple[int, ...], str]


def gguf_bytes(
    tensors: list[GGUFTensorSpec],
    *,
    arch: str = "llama",
    file_type: int = 15,
    workdir: Path,
) -> bytes:
    """A small but real GGUF written by the reference writer (the `gguf` package).

    Quantized tensors are given as raw bytes of the right size, so no quantizer is needed.
    """
    import gguf
    import numpy as np

    path = workdir / f"tiny-{len(list(workdir.iterdir()))}.gguf"
    w = gguf.GGUFWriter(path, arch)
    w.add_file_type(file_type)
    w.add_context_length(4096)
    for name, shape, type_name in tensors:
        qtype = gguf.GGMLQuantizationType[type_name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        *rows, cols = shape
        assert cols % block == 0, f"{name}: {cols} is not a multiple of {type_name}'s block"
        data = np.zeros((*rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.unlink()
    return data


def many_tensor_safetensors(n: int) -> bytes:
    """A legal safetensors file of `n` F16 tensors of shape [2], tensor i holding the bytes of
    uint32 i; 1,200,000 of them make a 97.8 MB header, near the format's 100 MB limit. Made
    with one string join (~3 s for the big one), not json.dumps of a million dicts."""
    entry = '"mlp.{:07d}.weight":{{"dtype":"F16","shape":[2],"data_offsets":[{},{}]}}'
    text = ("{" + ",".join(entry.format(i, 4 * i, 4 * i + 4) for i in range(n)) + "}").encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + array.array("I", range(n)).tobytes()


def count_header_reads(monkeypatch: Any) -> list[str]:
    """The paths of the safetensors headers the mount's tree builder reads from now on."""
    import modelfs.fsd.builder as fsd_builder

    calls: list[str] = []
    real = fsd_builder.read_safetensors_header_path

    def counting(path: str) -> object:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(fsd_builder, "read_safetensors_header_path", counting)
    return calls
