"""The file each layer of a manifest becomes in a model directory (README, "The mount").

Shared by the mount, which serves these paths, and `modelfs show`, which prints them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from modelfs.store.manifest import Layer, Manifest

# Ollama layer kind -> (stem, extension); a second layer of the same kind gets "-2", "-3", ...
_BY_KIND: dict[str, tuple[str, str]] = {
    "model": ("model", ".gguf"),
    "projector": ("mmproj", ".gguf"),
    "draft": ("draft", ".gguf"),
    "adapter": ("adapter", ".gguf"),
    "template": ("template", ".txt"),
    "prompt": ("template", ".txt"),
    "system": ("system", ".txt"),
    "params": ("params", ".json"),
    "messages": ("messages", ".json"),
    "license": ("LICENSE", ""),
}
# The .gguf file the first layer of each such kind is (the next ones are -2, -3, still .gguf).
GGUF_NAMES = {kind: f"{stem}{ext}" for kind, (stem, ext) in _BY_KIND.items() if ext == ".gguf"}

# Paths modelfs synthesizes itself; a layer never takes one of them.
RESERVED = frozenset({"Modelfile", "model.safetensors", ".ollama", "tensors", "llama.cpp"})

_UNSAFE_PART = re.compile(r"^\.\.?$|[\x00/\\]")
_KIND_CHARS = re.compile(r"[^A-Za-z0-9_.+-]")


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A blob-backed file in a model directory; `path` is relative, '/'-separated."""

    path: str
    layer: Layer
    index: int  # position of the layer in the manifest


def _safe_relpath(name: str | None) -> str | None:
    """A layer-given name usable as a relative path, or None if it could escape or collide."""
    if not name or len(name) > 1024:
        return None
    parts = name.split("/")
    if any(not p or _UNSAFE_PART.search(p) or len(p.encode()) > 255 for p in parts):
        return None
    if parts[0] in RESERVED or parts[0].startswith(".ollama"):
        return None
    return name


def _numbered(stem: str, ext: str, n: int) -> str:
    return f"{stem}{ext}" if n == 1 else f"{stem}-{n}{ext}"


def model_files(manifest: Manifest) -> list[ModelFile]:
    """Every layer's file, in manifest order. Names never repeat and never leave the dir."""
    taken: set[str] = set()
    dirs: set[str] = set()
    counts: dict[tuple[str, str], int] = {}
    files: list[ModelFile] = []

    def fallback(index: int, layer: Layer) -> str:
        return f".ollama/layers/{index}-{_KIND_CHARS.sub('_', layer.kind)[:100]}"

    for index, layer in enumerate(manifest.layers):
        kind = layer.kind
        path: str | None = None
        if kind in _BY_KIND:
            stem, ext = _BY_KIND[kind]
            n = counts.get((stem, ext), 0)
            while True:
                n += 1
                path = _numbered(stem, ext, n)
                if path not in taken:
                    break
            counts[(stem, ext)] = n
        elif kind == "tensor":
            safe = _safe_relpath(layer.name)
            if safe is not None and "/" not in safe:
                path = f"tensors/{safe}.safetensors"
        elif kind == "json":
            path = _safe_relpath(layer.name)
        if path is None or path in taken or _clashes(path, taken, dirs):
            path = fallback(index, layer)
        taken.add(path)
        parts = path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        files.append(ModelFile(path, layer, index))
    return files


def _clashes(path: str, taken: set[str], dirs: set[str]) -> bool:
    """True if `path` would be a file where a dir is, or needs a dir where a file is."""
    if path in dirs:
        return True
    parts = path.split("/")
    return any("/".join(parts[:i]) in taken for i in range(1, len(parts)))
