"""What `build_demo_store` wrote: layers, manifests, lists, and the store summary tests
assert against; the demo's model names and dates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    LAYER_PREFIX,
)
from modelfs.store.names import Name

# Layer media types. store.manifest has only the prefix; these are Ollama's names.
MEDIA_MODEL = LAYER_PREFIX + "model"
MEDIA_PROJECTOR = LAYER_PREFIX + "projector"
MEDIA_DRAFT = LAYER_PREFIX + "draft"
MEDIA_TEMPLATE = LAYER_PREFIX + "template"
MEDIA_SYSTEM = LAYER_PREFIX + "system"
MEDIA_PARAMS = LAYER_PREFIX + "params"
MEDIA_LICENSE = LAYER_PREFIX + "license"
MEDIA_TENSOR = LAYER_PREFIX + "tensor"
MEDIA_JSON = LAYER_PREFIX + "json"

GEMMA = "gemma4:26b"
GEMMA_MLX = "gemma4:26b-mlx"
"""The legacy file naming gemma4:26b's mlx child, as a pull of both children writes it."""
LLAMA = "llama3.2:3b"
QWEN = "qwen3:0.6b"
TINY = "someuser/tiny:q8"
SMOL = "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"
VOCAB_ONLY_MODEL = LLAMA
"""The model whose `model.gguf` llama.cpp can load with `vocab_only`."""

# 2026-01-01T00:00:00Z; manifests are dated whole days after it.
EPOCH = 1_767_225_600
DAY = 86_400


@dataclass(frozen=True, slots=True)
class DemoLayer:
    """One layer (or config) as it appears in a manifest."""

    media_type: str
    digest: Digest
    size: int
    name: str | None = None
    """The layer's `name` field (tensor and json layers)."""
    file: str | None = None
    """The file store.files makes of it in a model directory; None where its table is silent."""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": str(self.digest),
            "size": self.size,
        }
        if self.name:
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True)
class DemoManifest:
    """A runnable manifest: a named legacy file, a list child, or the legacy anchor."""

    key: str
    """`llama3.2:3b`, `gemma4:26b@llamacpp`, `gemma4:26b@mlx`, …"""
    name: Name
    runner: str | None
    format: str | None
    digest: Digest
    """sha256 of the manifest bytes: the model ID."""
    raw: bytes
    path: Path | None
    """The named manifest file; None for a list child, which is only a blob."""
    config: DemoLayer
    layers: tuple[DemoLayer, ...]
    mtime: float | None = None

    @property
    def size(self) -> int:
        """Layers plus config, as Ollama's Manifest.Size."""
        return self.config.size + sum(layer.size for layer in self.layers)

    def files(self) -> dict[str, Digest]:
        """Mount file name -> blob digest, for the layers that become files."""
        return {layer.file: layer.digest for layer in self.layers if layer.file}

    def layer(self, file: str) -> DemoLayer:
        for layer in self.layers:
            if layer.file == file:
                return layer
        raise KeyError(f"{self.key} has no layer that becomes {file!r}")


@dataclass(frozen=True, slots=True)
class DemoList:
    """A manifest list and the `manifests-v2/` entry that points at it."""

    name: Name
    digest: Digest
    raw: bytes
    path: Path
    children: tuple[tuple[str, str, Digest], ...]
    """(runner, format, child manifest digest), in list order."""
    mtime: float


@dataclass(frozen=True)
class DemoStore:
    """A summary of everything `build_demo_store` wrote, for tests to assert against."""

    root: Path
    names: tuple[str, ...]
    """Shortest names, newest first (the order `ollama list` shows)."""
    manifests: dict[str, DemoManifest]
    """Every runnable manifest by key: plain names, and `name@runner` for list children."""
    lists: dict[str, DemoList]
    anchors: dict[str, DemoManifest]
    """Legacy manifests that a v2 entry of the same name hides."""
    variant_anchors: dict[str, DemoManifest]
    """Legacy files `<tag>-<runner>` naming a list's other children (`gemma4:26b-mlx`):
    models of their own to `ollama list` and `modelfs ls`, not in `names`."""
    mtimes: dict[str, float]
    """Name -> mtime of the entry Ollama lists for it (the v2 link, else the legacy file)."""
    model_blob: Digest
    """The first model's main GGUF (`gemma4:26b@llamacpp` model.gguf); big with --size."""
    weight_bytes: int
    blobs: frozenset[Digest] = field(default_factory=frozenset)
    """Every blob written: layers, configs, child manifests, the list."""

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag `ollama list` and `modelfs ls` show: `names`, then `variant_anchors`."""
        return (*self.names, *self.variant_anchors)

    def manifest(self, key: str) -> DemoManifest:
        return self.manifests[key]

    def blob_path(self, digest: Digest) -> Path:
        return Layout(self.root).blob(digest)

    def variants(self, name: str) -> dict[str, DemoManifest]:
        """Runner -> manifest for a name: its list children, or its one manifest."""
        if name in self.lists:
            return {
                runner: self.manifests[f"{name}@{runner}"]
                for runner, _, _ in self.lists[name].children
            }
        m = self.manifests[name]
        return {m.runner or "": m}
