from __future__ import annotations

import json

from modelfs.store.digest import Digest
from modelfs.store.manifest import Manifest, parse_manifest
from modelfs.store.tools.files import model_files

HEX = "ab" * 32


def manifest(*layers: tuple[str, str | None]) -> Manifest:
    objs = []
    for kind, name in layers:
        media = kind if "/" in kind else f"application/vnd.ollama.image.{kind}"
        obj = {"mediaType": media, "digest": f"sha256:{HEX}", "size": 1}
        if name is not None:
            obj["name"] = name
        objs.append(obj)
    m = parse_manifest(json.dumps({"layers": objs}).encode(), "m")
    assert isinstance(m, Manifest)
    return m


def paths(m: Manifest) -> list[str]:
    return [f.path for f in model_files(m)]


def test_names_by_media_type() -> None:
    m = manifest(
        ("model", None),
        ("projector", None),
        ("draft", None),
        ("adapter", None),
        ("adapter", None),
        ("template", None),
        ("system", None),
        ("params", None),
        ("messages", None),
        ("license", None),
        ("license", None),
        ("license", None),
    )
    assert paths(m) == [
        "model.gguf", "mmproj.gguf", "draft.gguf", "adapter.gguf", "adapter-2.gguf",
        "template.txt", "system.txt", "params.json", "messages.json",
        "LICENSE", "LICENSE-2", "LICENSE-3",
    ]  # fmt: skip
    assert all(f.layer.digest == Digest(HEX) for f in model_files(m))


def test_tensor_and_json_names() -> None:
    m = manifest(
        ("tensor", "model.layers.0.mlp.up_proj.weight"),
        ("json", "config.json"),
        ("json", "draft/config.json"),
        ("template", None),
        ("prompt", None),
    )
    assert paths(m) == [
        "tensors/model.layers.0.mlp.up_proj.weight.safetensors",
        "config.json",
        "draft/config.json",
        "template.txt",
        "template-2.txt",
    ]


def test_hostile_layer_names_fall_back() -> None:
    bad = [
        "../etc/passwd",
        "/abs",
        "a//b",
        "a/../b",
        ".",
        "x\x00y",
        "Modelfile",
        ".ollama/manifest.json",
        "tensors/x",
        "model.safetensors",
        "",
        "a\\b",
        "x" * 300,
    ]
    m = manifest(*[("json", b) for b in bad], ("tensor", "a/b"), ("tensor", ".."), ("embed", None))
    got = paths(m)
    assert all(p.startswith(".ollama/layers/") for p in got), got
    assert got[-1] == f".ollama/layers/{len(bad) + 2}-embed"
    assert len(set(got)) == len(got)


def test_file_dir_clash_and_duplicates() -> None:
    m = manifest(("json", "a"), ("json", "a/b"), ("json", "c"), ("json", "c"))
    assert paths(m) == ["a", ".ollama/layers/1-json", "c", ".ollama/layers/3-json"]
