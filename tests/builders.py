"""Tiny stores built in a test, byte-compatible with what Ollama writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from store.blobs import BlobStore
from store.digest import Digest
from store.layout import Layout
from store.manifest import MEDIA_CONFIG, MEDIA_LIST, MEDIA_MANIFEST
from store.names import Name, parse_name

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

    def legacy(self, name: str | Name, raw: bytes, mtime: float | None = None) -> Path:
        n = parse_name(name) if isinstance(name, str) else name
        path = self.blobs.write_legacy_manifest(n, raw)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return path

    def v2(self, name: str | Name, raw: bytes) -> Path:
        n = parse_name(name) if isinstance(name, str) else name
        return self.blobs.write_v2_manifest(n, raw)

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
