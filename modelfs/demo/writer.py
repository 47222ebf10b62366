"""Writing the demo store: blobs through `store.blobs.BlobStore` (nothing half-written, every
name its sha256), manifests and configs as Ollama marshals them."""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from modelfs.demo.ggufspec import GGUFSpec
from modelfs.demo.records import MEDIA_MODEL, DemoLayer, DemoManifest
from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    LAYER_PREFIX,
    MEDIA_CONFIG,
    MEDIA_MANIFEST,
    go_marshal,
)
from modelfs.store.names import parse_name


def params_blob(**kw: Any) -> bytes:
    """A params layer: Go's json.Marshal of a map (sorted keys, HTML-escaped)."""
    return go_marshal(dict(sorted(kw.items())))


class _ChunkReader(io.RawIOBase):
    """A read-only stream over an iterator of byte chunks (for BlobStore.put_stream)."""

    def __init__(self, chunks: Iterable[bytes | memoryview]) -> None:
        self._it = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = memoryview(next(self._it)).cast("B")
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _file_for(media_type: str, name: str | None) -> str | None:
    kind = media_type[len(LAYER_PREFIX) :] if media_type.startswith(LAYER_PREFIX) else None
    simple = {
        "model": "model.gguf",
        "projector": "mmproj.gguf",
        "draft": "draft.gguf",
        "template": "template.txt",
        "system": "system.txt",
        "params": "params.json",
        "license": "LICENSE",
    }
    if kind in simple:
        return simple[kind]
    if kind == "tensor" and name:
        return f"tensors/{name}.safetensors"
    if kind == "json" and name:
        return name
    return None


class Writer:
    def __init__(self, root: Path) -> None:
        self.layout = Layout(root)
        self.store = BlobStore(self.layout)
        self.store.ensure_dirs()
        self.blobs: set[Digest] = set()

    def _layer(self, digest: Digest, media_type: str, name: str | None) -> DemoLayer:
        self.blobs.add(digest)
        size = self.layout.blob(digest).stat().st_size
        return DemoLayer(media_type, digest, size, name, _file_for(media_type, name))

    # builtins.bytes: inside this class `bytes` names the method below.
    def bytes(self, data: builtins.bytes, media_type: str, name: str | None = None) -> DemoLayer:
        return self._layer(self.store.put_bytes(data), media_type, name)

    def stream(
        self,
        chunks: Iterable[builtins.bytes | memoryview],
        media_type: str,
        name: str | None = None,
    ) -> DemoLayer:
        return self._layer(self.store.put_stream(_ChunkReader(chunks)), media_type, name)

    def gguf(self, spec: GGUFSpec, seed: str, media_type: str = MEDIA_MODEL) -> DemoLayer:
        return self.stream(spec.chunks(seed), media_type)

    def config(self, obj: dict[str, Any]) -> DemoLayer:
        return self.bytes(go_marshal(obj), MEDIA_CONFIG)

    def manifest_bytes(
        self,
        config: DemoLayer,
        layers: Sequence[DemoLayer],
        *,
        runner: str | None = None,
        fmt: str | None = None,
        newline: bool,
    ) -> builtins.bytes:
        obj: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config.as_json(),
            "layers": [layer.as_json() for layer in layers],
        }
        if runner:
            obj["runner"] = runner
        if fmt:
            obj["format"] = fmt
        return go_marshal(obj) + (b"\n" if newline else b"")


def config_v2(
    family: str,
    model_type: str,
    file_type: str,
    layers: Sequence[DemoLayer],
    *,
    rootfs: bool,
    **extra: Any,
) -> dict[str, Any]:
    """A ConfigV2 in Go's field order. Older pulls still carry `rootfs` (dropped upstream in
    2026-08); fresh ones do not."""
    obj: dict[str, Any] = {
        "model_format": "gguf",
        "model_family": family,
        "model_families": [family],
        "model_type": model_type,
        "file_type": file_type,
    }
    obj.update(extra)
    obj["architecture"] = "amd64"
    obj["os"] = "linux"
    if rootfs:
        obj["rootfs"] = {"type": "layers", "diff_ids": [str(layer.digest) for layer in layers]}
    return obj


def write_legacy(
    w: Writer, key: str, config: DemoLayer, layers: Sequence[DemoLayer], mtime: float
) -> DemoManifest:
    name = parse_name(key)
    raw = w.manifest_bytes(config, layers, newline=True)
    path = w.store.write_legacy_manifest(name, raw)
    os.utime(path, (mtime, mtime))
    return DemoManifest(
        key, name, None, None, Digest.of_bytes(raw), raw, path, config, tuple(layers), mtime
    )
