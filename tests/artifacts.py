"""Artifacts of other tools, built as their formats' documents lay them out and pushed to a
registry by a real client (skopeo: an OCI image layout, image-spec's image-layout.md, copied
`oci:` to `docker://` with digests preserved, so the registry holds the manifest bytes written
here). Shared by tests/test_artifacts*.py and the docs runner (tests/test_docs.py, `artifacts=`).

- Docker Model Runner, docker/model-runner@642c72117b2431a6b871796883af1aaf013fc3cf:
  pkg/distribution/internal/partial/partial.go ManifestForLayers, pkg/distribution/types/
  config.go (media types, config fields), pkg/distribution/builder/builder.go:152-155.
- ModelPack, modelpack/model-spec@d78bf3231b4f26196c4a955e1007ccc47e19a77c: docs/spec.md
  (manifest, layer media types, tar reproducibility), specs-go/v1/config.go,
  specs-go/v1/annotations.go (`org.cncf.model.filepath`).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from modelfs.demo import VOCAB_ONLY_MODEL
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from tests.registry import Registry

SKOPEO = shutil.which("skopeo")

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DMR_CONFIG = "application/vnd.docker.ai.model.config.v0.1+json"
MP_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MP_CONFIG = "application/vnd.cncf.model.config.v1+json"
MP = "application/vnd.cncf.model."
FP = "org.cncf.model.filepath"
LICENSE = b"Apache License 2.0, for the test\n"
TEMPLATE = b"{% for m in messages %}{{ m.content }}{% endfor %}"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def desc(media: str, data: bytes, **annotations: str) -> dict[str, Any]:
    d: dict[str, Any] = {"mediaType": media, "digest": sha(data), "size": len(data)}
    if annotations:
        d["annotations"] = annotations
    return d


def push_layout(
    reg: Registry,
    work: Path,
    repo: str,
    config: tuple[str, bytes],
    layers: list[tuple[dict[str, Any], bytes]],
    artifact_type: str | None = None,
) -> str:
    """Write an OCI image layout holding one manifest and push it with skopeo; the manifest's
    digest."""
    lay = work / ("layout-" + repo.replace("/", "-").replace(":", "-"))
    blobs = lay / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> None:
        (blobs / sha(data).removeprefix("sha256:")).write_bytes(data)

    put(config[1])
    for _, data in layers:
        put(data)
    manifest: dict[str, Any] = {"schemaVersion": 2, "mediaType": OCI_MANIFEST}
    if artifact_type:
        manifest["artifactType"] = artifact_type
    manifest["config"] = desc(config[0], config[1])
    manifest["layers"] = [d for d, _ in layers]
    raw = json.dumps(manifest, indent=2).encode()
    put(raw)
    repo_name, tag = repo.rsplit(":", 1)
    index = {
        "schemaVersion": 2,
        "manifests": [desc(OCI_MANIFEST, raw, **{"org.opencontainers.image.ref.name": tag})],
    }
    (lay / "index.json").write_text(json.dumps(index))
    (lay / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    subprocess.run(
        [
            str(SKOPEO),
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            "--preserve-digests",
            f"oci:{lay}:{tag}",
            f"docker://{reg.address}/{repo_name}:{tag}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return sha(raw)


def inspect_raw(reg: Registry, repo: str) -> bytes:
    return subprocess.run(
        [str(SKOPEO), "inspect", "--raw", "--tls-verify=false", f"docker://{reg.address}/{repo}"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout


def demo_gguf(root: Path) -> bytes:
    """A small real GGUF with a vocabulary llama.cpp loads: the demo store's at `root`."""
    layout = Layout(root)
    doc = json.loads(layout.legacy_manifest(parse_name(VOCAB_ONLY_MODEL)).read_bytes())
    [model] = [x for x in doc["layers"] if x["mediaType"].endswith(".model")]
    return (root / "blobs" / model["digest"].replace(":", "-")).read_bytes()


def dmr_artifact(
    reg: Registry, work: Path, gguf: bytes, repo: str, mmproj: bytes | None = b"GGUF stand-in"
) -> tuple[str, list[bytes]]:
    """A Docker Model Runner artifact as `docker model package` lays it out: GGUF, mmproj,
    license, chat template; the config with a context size."""
    layers = [(desc("application/vnd.docker.ai.gguf.v3", gguf), gguf)]
    if mmproj is not None:
        layers.append((desc("application/vnd.docker.ai.mmproj", mmproj), mmproj))
    layers += [
        (desc("application/vnd.docker.ai.license", LICENSE), LICENSE),
        (desc("application/vnd.docker.ai.chat.template.jinja", TEMPLATE), TEMPLATE),
    ]
    config = {
        "config": {
            "format": "gguf",
            "quantization": "Q4_K_M",
            "parameters": "361.82 M",
            "architecture": "llama",
            "size": f"{len(gguf)} B",
            "context_size": 2048,
        },
        "descriptor": {"created": "2026-01-02T03:04:05Z"},
        "rootfs": {"type": "rootfs", "diff_ids": [d["digest"] for d, _ in layers]},
    }
    cfg = ("application/vnd.docker.ai.model.config.v0.1+json", json.dumps(config).encode())
    digest = push_layout(reg, work, repo, cfg, layers)
    return digest, [d for _, d in layers[:-1]]


def shards() -> list[tuple[str, dict[str, np.ndarray], bytes]]:
    """Two shards as `save_pretrained` names them, written by the safetensors library."""
    rng = np.random.default_rng(7)
    parts = [
        {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32)},
        {
            "model.norm.weight": np.ones(8, dtype=np.float16),
            "lm_head.weight": rng.standard_normal((16, 8)).astype(np.float32),
        },
    ]
    out = []
    for i, tensors in enumerate(parts, 1):
        out.append((f"model-0000{i}-of-00002.safetensors", tensors, save(tensors)))
    return out


def hf_files(names: list[tuple[str, dict[str, np.ndarray], bytes]]) -> list[tuple[str, bytes]]:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16}
    index = {"weight_map": {t: n for n, ts, _ in names for t in ts}}
    return [
        ("config.json", json.dumps(config, indent=2).encode() + b"\n"),
        ("model.safetensors.index.json", json.dumps(index).encode()),
        ("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE"}}'),
    ]


def tar_of(files: list[tuple[str, bytes]]) -> bytes:
    """A tar as the spec's Reproducibility section asks: lexicographic order, fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def modelpack_config(layers: list[tuple[dict[str, Any], bytes]]) -> tuple[str, bytes]:
    cfg = {
        "descriptor": {"family": "llama", "name": "tiny-st"},
        "config": {"architecture": "transformer", "format": "safetensors", "paramSize": "0.3k"},
        "modelfs": {"type": "layers", "diffIds": [d["digest"] for d, _ in layers]},
    }
    return MP_CONFIG, json.dumps(cfg).encode()


def modelpack_layers(packing: str) -> list[tuple[dict[str, Any], bytes]]:
    """The model as ModelPack layers: each file raw, or each shard a tar of its own and the
    config files and docs a tar each."""
    weights = shards()
    configs = hf_files(weights)
    docs = [("LICENSE", LICENSE), ("README.md", b"# tiny\n")]
    if packing == "raw":
        layers = [(desc(MP + "weight.v1.raw", d, **{FP: n}), d) for n, _, d in weights]
        layers += [(desc(MP + "weight.config.v1.raw", d, **{FP: n}), d) for n, d in configs]
        layers += [(desc(MP + "doc.v1.raw", d, **{FP: n}), d) for n, d in docs]
        return layers
    layers = []
    for n, _, d in weights:
        t = tar_of([(n, d)])
        layers.append((desc(MP + "weight.v1.tar", t, **{FP: n}), t))
    for media, files in (("weight.config.v1.tar", configs), ("doc.v1.tar", docs)):
        t = tar_of(files)
        layers.append((desc(MP + media, t), t))
    return layers


# What the docs' console blocks pull (tests/test_docs.py, `artifacts=KIND`), on the registry's
# own host as the tools that write them put them there.
DOCS_ARTIFACTS = {"docker-model": "ai/smollm2:360M-Q4_K_M", "modelpack": "acme/tiny:v1"}


def seed(reg: Registry, work: Path, kind: str, demo: Path) -> str:
    """Push the docs' `kind` artifact to `reg`: a Docker Model Runner GGUF (the demo store's),
    or a ModelPack safetensors model in tar layers; its manifest digest."""
    repo = DOCS_ARTIFACTS[kind]
    if kind == "docker-model":
        return dmr_artifact(reg, work, demo_gguf(demo), repo, mmproj=None)[0]
    layers = modelpack_layers("tar")
    return push_layout(reg, work, repo, modelpack_config(layers), layers, MP_ARTIFACT)
