"""Other tools' model artifacts (Docker Model Runner, CNCF ModelPack) pulled into the store as
Ollama models.

Each artifact is laid out as an OCI image layout (image-spec's image-layout.md: `oci-layout`,
`index.json`, `blobs/sha256/`) and pushed by a real client, skopeo (`oci:` to `docker://`,
digests preserved, so the registry holds the manifest bytes written here), to Debian's
docker-registry, under the repository `modelfs pull` asks for the name (sync.registry_names:
a host other than Ollama's is the first component). The layouts are the formats' own:

- Docker Model Runner, docker/model-runner@642c72117b2431a6b871796883af1aaf013fc3cf:
  pkg/distribution/internal/partial/partial.go ManifestForLayers (an OCI manifest, no
  artifactType, config `application/vnd.docker.ai.model.config.v0.1+json`),
  pkg/distribution/types/config.go (layer media types; the config's `config`, `descriptor`,
  `rootfs` fields), pkg/distribution/builder/builder.go:152-155 (rootfs type "rootfs").
- ModelPack, modelpack/model-spec@d78bf3231b4f26196c4a955e1007ccc47e19a77c: docs/spec.md
  (manifest: artifactType and config media type; layer media types),
  specs-go/v1/config.go (config fields), specs-go/v1/annotations.go (filepath annotation).

(oras, the client the formats' own documents use, is not packaged in Debian bookworm; skopeo
is, and it copies an artifact's manifest byte for byte.)

The store is then read as a stock Ollama reads it (tests/ollama_local.py, /api/tags), and the
GGUF is loaded through the mount by llama.cpp.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelfs.demo import VOCAB_ONLY_MODEL, build_demo_store
from modelfs.fsd.builder import short_path
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from modelfs.sync.wire.registry_names import own_repository
from tests import ollama_local
from tests.artifacts import (
    DMR_CONFIG,
    LICENSE,
    MP_ARTIFACT,
    MP_CONFIG,
    OCI_MANIFEST,
    SKOPEO,
    TEMPLATE,
    demo_gguf,
    desc,
    dmr_artifact,
    inspect_raw,
    push_layout,
    sha,
    tar_of,
)
from tests.mounting import fuse, mounted
from tests.registry import Registry, needs_registry, running_registry
from tests.test_registries import error_line, modelfs, pull

pytestmark = [
    needs_registry,
    pytest.mark.skipif(SKOPEO is None, reason="needs skopeo (scripts/setup installs it)"),
]

NAME = "docker.io/ai/smollm2:360M-Q4_K_M"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small real GGUF with a vocabulary llama.cpp loads: the demo store's."""
    root = tmp_path_factory.mktemp("demo")
    build_demo_store(root)
    return demo_gguf(root)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with running_registry(tmp_path / "registry") as reg:
        yield reg


def store_manifest(store: Path, name: str) -> dict[str, Any]:
    return dict(json.loads(Layout(store).legacy_manifest(parse_name(name)).read_bytes()))


def blob(store: Path, digest: str) -> bytes:
    return (store / "blobs" / digest.replace(":", "-")).read_bytes()


def blob_gets(reg: Registry) -> list[str]:
    return [uri for method, uri in reg.requests() if method == "GET" and "/blobs/" in uri]


def test_a_docker_model_runner_artifact_lands_as_an_ollama_model(
    registry: Registry, tmp_path: Path, weights: bytes
) -> None:
    """Pulled by the name asked, listed by Ollama's /api/tags with the artifact's facts, the
    weight, projector and license the artifact's own blobs (same digests), the context size
    a params layer, the source recorded; a re-pull fetches no blob."""
    digest, (gguf, mmproj, lic) = dmr_artifact(registry, tmp_path, weights, NAME)
    store = tmp_path / "store"
    r = pull(store, registry.url, NAME)
    assert r.returncode == 0, r.stderr

    [tags] = ollama_local.api_tags(store)
    assert tags["name"] == NAME
    details = tags["details"]
    assert (details["format"], details["family"], details["families"]) == (
        "gguf",
        "llama",
        ["llama"],
    )
    assert (details["parameter_size"], details["quantization_level"]) == ("361.82 M", "Q4_K_M")
    assert "vision" in tags["capabilities"]  # the projector

    doc = store_manifest(store, NAME)
    by_type = {x["mediaType"]: x for x in doc["layers"]}
    assert by_type["application/vnd.ollama.image.model"]["digest"] == sha(gguf)
    assert by_type["application/vnd.ollama.image.projector"]["digest"] == sha(mmproj)
    assert by_type["application/vnd.ollama.image.license"]["digest"] == sha(lic)
    params = by_type["application/vnd.ollama.image.params"]
    assert json.loads(blob(store, params["digest"])) == {"num_ctx": 2048}
    # Ollama skips what it does not know; the Jinja template is no Go template.
    assert by_type["application/vnd.docker.ai.chat.template.jinja"]["digest"] == sha(TEMPLATE)
    assert "application/vnd.ollama.image.template" not in by_type
    config = json.loads(blob(store, doc["config"]["digest"]))
    assert config["modelfs_source"] == {
        "format": "docker-model",
        "digest": digest,
        "mediaType": OCI_MANIFEST,
    }
    assert blob(store, by_type["application/vnd.ollama.image.model"]["digest"]) == gguf

    r = modelfs("show", "--store", str(store), NAME)
    assert f"from the docker-model artifact {digest}" in r.stdout
    before = len(blob_gets(registry))
    raw = Layout(store).legacy_manifest(parse_name(NAME)).read_bytes()
    r = pull(store, registry.url, NAME)
    assert r.returncode == 0, r.stderr
    assert len(blob_gets(registry)) == before
    assert Layout(store).legacy_manifest(parse_name(NAME)).read_bytes() == raw


def test_a_modelpack_artifact_lands_as_an_ollama_model(
    registry: Registry, tmp_path: Path, weights: bytes
) -> None:
    """A ModelPack artifact with raw GGUF weight layers (the model, a projector named
    `mmproj*`), a raw LICENSE and a raw weight config file: the weights and the license keep
    their digests under Ollama's types."""
    gguf = weights
    mmproj = b"GGUF projector stand-in"
    tokenizer = b'{"version": "1.0"}'
    fp = "org.cncf.model.filepath"
    raw = "application/vnd.cncf.model.weight.v1.raw"
    layers = [
        (desc(raw, gguf, **{fp: "model.gguf"}), gguf),
        (desc(raw, mmproj, **{fp: "mmproj-f16.gguf"}), mmproj),
        (
            desc("application/vnd.cncf.model.weight.config.v1.raw", tokenizer, **{fp: "t.json"}),
            tokenizer,
        ),
        (desc("application/vnd.cncf.model.doc.v1.raw", LICENSE, **{fp: "LICENSE"}), LICENSE),
    ]
    config = {
        "descriptor": {"createdAt": "2026-01-02T03:04:05Z", "family": "llama", "name": "tiny"},
        "config": {"architecture": "transformer", "format": "gguf", "paramSize": "1m"},
        "modelfs": {"type": "layers", "diffIds": [d["digest"] for d, _ in layers]},
    }
    digest = push_layout(
        registry,
        tmp_path,
        "ghcr.io/kit/tiny:1m",
        ("application/vnd.cncf.model.config.v1+json", json.dumps(config).encode()),
        layers,
        artifact_type="application/vnd.cncf.model.manifest.v1+json",
    )
    store = tmp_path / "store"
    name = "ghcr.io/kit/tiny:1m"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    [tags] = ollama_local.api_tags(store)
    assert tags["name"] == name
    assert (tags["details"]["family"], tags["details"]["parameter_size"]) == ("llama", "1m")
    doc = store_manifest(store, name)
    by_type = {x["mediaType"]: x["digest"] for x in doc["layers"]}
    assert by_type["application/vnd.ollama.image.model"] == sha(gguf)
    assert by_type["application/vnd.ollama.image.license"] == sha(LICENSE)
    assert by_type["application/vnd.ollama.image.projector"] == sha(mmproj)
    assert by_type["application/vnd.cncf.model.weight.config.v1.raw"] == sha(tokenizer)
    source = json.loads(blob(store, doc["config"]["digest"]))["modelfs_source"]
    assert source["digest"] == digest
    assert source["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"


def assert_nothing_written(store: Path) -> None:
    assert not [p for p in (store / "manifests").rglob("*") if p.is_file()]
    assert not list((store / "blobs").iterdir())


def test_an_unknown_artifact_type_is_one_line_and_nothing_written(
    registry: Registry, tmp_path: Path
) -> None:
    """An artifact modelfs does not know: one line naming its artifactType and its media
    types; no blob fetched, nothing written."""
    sbom = b'{"spdxVersion": "SPDX-2.3"}'
    push_layout(
        registry,
        tmp_path,
        "ghcr.io/misc/thing:v1",
        ("application/vnd.oci.empty.v1+json", b"{}"),
        [(desc("application/spdx+json", sbom), sbom)],
        artifact_type="application/vnd.example.sbom.v1",
    )
    store = tmp_path / "store"
    before = len(blob_gets(registry))
    r = pull(store, registry.url, "ghcr.io/misc/thing:v1")
    assert r.returncode == 1
    line = error_line(r.stderr)
    assert "artifactType application/vnd.example.sbom.v1" in line
    assert "application/vnd.oci.empty.v1+json" in line and "application/spdx+json" in line
    assert "Traceback" not in r.stderr
    assert len(blob_gets(registry)) == before
    assert_nothing_written(store)


def test_a_modelpack_gguf_in_a_tar_layer_lands_and_goes_back_as_it_came(
    registry: Registry, tmp_path: Path, weights: bytes
) -> None:
    """A GGUF in a ModelPack tar weight layer (docs/spec.md
    `application/vnd.cncf.model.weight.v1.tar`): the member copied out is the model layer (the
    GGUF's own digest), the tar kept; pushed back as modelpack, the registry gets the
    artifact's own manifest (the same digest)."""
    data = tar_of([("model.gguf", weights)])
    layers = [(desc("application/vnd.cncf.model.weight.v1.tar", data), data)]
    cfg = {"config": {"format": "gguf"}, "modelfs": {"type": "layers", "diffIds": [sha(data)]}}
    config = ("application/vnd.cncf.model.config.v1+json", json.dumps(cfg).encode())
    name = "ghcr.io/kit/tarred:v1"
    digest = push_layout(registry, tmp_path, name, config, layers, MP_ARTIFACT)
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    doc = store_manifest(store, name)
    by_type = {x["mediaType"]: x["digest"] for x in doc["layers"]}
    assert by_type["application/vnd.ollama.image.model"] == sha(weights)
    assert by_type["application/vnd.cncf.model.weight.v1.tar"] == sha(data)
    assert blob(store, sha(weights)) == weights
    with running_registry(tmp_path / "other") as other:  # none of its blobs there yet
        r = modelfs("push", "--store", str(store), name, "--to", other.url, "--format", "modelpack")
        assert r.returncode == 0, r.stderr
        assert ("PUT", "/v2/ghcr.io/kit/tarred/manifests/v1") in other.requests()
        assert sha(inspect_raw(other, "ghcr.io/kit/tarred:v1")) == digest


@pytest.mark.parametrize("case", ["docker-model-shards", "docker-dduf"])
def test_layers_not_landed_yet_are_one_line_before_any_fetch(
    registry: Registry, tmp_path: Path, weights: bytes, case: str
) -> None:
    """A GGUF in shards (several `application/vnd.docker.ai.gguf.v3` layers, as
    `docker model package` writes a split GGUF) and DDUF weights are not landed yet: one line
    naming what, no blob fetched, nothing written."""
    media = {
        "docker-model-shards": "application/vnd.docker.ai.gguf.v3",
        "docker-dduf": "application/vnd.docker.ai.dduf",
    }[case]
    parts = [weights[: len(weights) // 2], weights[len(weights) // 2 :]]
    cfg = {"config": {"format": "gguf"}, "descriptor": {}, "rootfs": {"type": "rootfs"}}
    config = ("application/vnd.docker.ai.model.config.v0.1+json", json.dumps(cfg).encode())
    layers = [(desc(media, p), p) for p in parts]
    artifact_type = None
    said = {"docker-model-shards": "2 shards", "docker-dduf": "no GGUF"}[case]
    name = f"ghcr.io/refused/{case}:v1"
    push_layout(registry, tmp_path, name, config, layers, artifact_type)
    store = tmp_path / "store"
    before = len(blob_gets(registry))
    r = pull(store, registry.url, name)
    assert r.returncode == 1
    assert said in error_line(r.stderr)
    assert "Traceback" not in r.stderr
    assert len(blob_gets(registry)) == before
    assert_nothing_written(store)


@fuse
@pytest.mark.slow
@pytest.mark.parametrize("packing", ["docker-model", "modelpack-tar"])
def test_llama_cpp_loads_the_pulled_artifact_through_the_mount(
    registry: Registry, tmp_path: Path, weights: bytes, packing: str
) -> None:
    """llama.cpp reads the vocabulary of the pulled GGUF (a Docker Model Runner layer, or a
    ModelPack tar layer's member copied out) from the mount's plain path, as from the bytes
    pushed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if packing == "docker-model":
        name = NAME
        dmr_artifact(registry, tmp_path, weights, name)
    else:
        name = "ghcr.io/kit/tarred:v1"
        data = tar_of([("model.gguf", weights)])
        layers = [(desc("application/vnd.cncf.model.weight.v1.tar", data), data)]
        cfg = {"config": {"format": "gguf"}, "modelfs": {"type": "layers", "diffIds": []}}
        config = (MP_CONFIG, json.dumps(cfg).encode())
        push_layout(registry, tmp_path, name, config, layers, MP_ARTIFACT)
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    source = tmp_path / "weights.gguf"
    source.write_bytes(weights)
    mnt = tmp_path / "mnt"
    with mounted(store, mnt):
        path = mnt.joinpath(*short_path(parse_name(name)), "model.gguf")
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        native = llama_cpp.Llama(model_path=str(source), vocab_only=True, verbose=False)
        assert llm.tokenize(b"hello world", add_bos=False) == native.tokenize(
            b"hello world", add_bos=False
        )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo-store")
    build_demo_store(root)
    return root


@pytest.mark.parametrize(
    ("fmt", "artifact_type", "config_type", "model_type"),
    [
        ("docker-model", None, DMR_CONFIG, "application/vnd.docker.ai.gguf.v3"),
        ("modelpack", MP_ARTIFACT, MP_CONFIG, "application/vnd.cncf.model.weight.v1.raw"),
    ],
)
def test_push_as_an_artifact_and_pull_back_the_identical_model(
    registry: Registry,
    tmp_path: Path,
    demo: Path,
    fmt: str,
    artifact_type: str | None,
    config_type: str,
    model_type: str,
) -> None:
    """`push --format` writes the format's layout (read back by skopeo, a real client), the
    weights under the format's type with their own digests; pulling it back gives the Ollama
    manifest byte for byte, and every blob it names."""
    name = VOCAB_ONLY_MODEL
    r = modelfs("push", "--store", str(demo), name, "--to", registry.url, "--format", fmt)
    assert r.returncode == 0, r.stderr
    n = parse_name(name)
    original = Layout(demo).legacy_manifest(n).read_bytes()
    doc = json.loads(original)
    [model] = [x for x in doc["layers"] if x["mediaType"] == "application/vnd.ollama.image.model"]

    repo = f"{registry.address}/{n.namespace}/{n.model}:{n.tag}"
    raw = subprocess.run(
        [str(SKOPEO), "inspect", "--raw", "--tls-verify=false", f"docker://{repo}"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    artifact = json.loads(raw)
    assert artifact["mediaType"] == OCI_MANIFEST
    assert artifact.get("artifactType") == artifact_type
    assert artifact["config"]["mediaType"] == config_type
    weights = [x for x in artifact["layers"] if x["digest"] == model["digest"]]
    assert [x["mediaType"] for x in weights] == [model_type]

    store = tmp_path / "back"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    assert Layout(store).legacy_manifest(n).read_bytes() == original
    for layer in [doc["config"], *doc["layers"]]:
        assert blob(store, layer["digest"]) == blob(demo, layer["digest"])
    [tags] = ollama_local.api_tags(store)
    [demo_tags] = [t for t in ollama_local.api_tags(demo) if t["name"] == tags["name"]]
    assert tags["digest"] == demo_tags["digest"]


def test_a_name_on_the_registrys_own_host_is_its_repository_there(
    registry: Registry, tmp_path: Path, weights: bytes
) -> None:
    """`HOST/ai/smollm2:TAG` from the registry at HOST is its `ai/smollm2` there, where
    `docker model push` and every other client put it; the model keeps the name asked, and is
    pushed back there as it came (the same manifest digest)."""
    digest, _ = dmr_artifact(registry, tmp_path, weights, repo="ai/smollm2:360M-Q4_K_M")
    store = tmp_path / "store"
    name = f"{registry.address}/ai/smollm2:360M-Q4_K_M"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    [tags] = ollama_local.api_tags(store)
    assert tags["name"] == name
    assert ("GET", "/v2/ai/smollm2/manifests/360M-Q4_K_M") in registry.requests()

    # Pushed back as a Docker Model Runner artifact: to `ai/smollm2` again, the weights the
    # same blobs; pulled back into a fresh store, the same Ollama model.
    landed = Layout(store).legacy_manifest(parse_name(name)).read_bytes()
    r = modelfs(
        "push", "--store", str(store), name, "--to", registry.url, "--format", "docker-model"
    )
    assert r.returncode == 0, r.stderr
    assert "/ai/smollm2:360M-Q4_K_M" in r.stdout
    # The artifact as it came: the manifest the registry holds already (so not put again).
    assert sha(inspect_raw(registry, "ai/smollm2:360M-Q4_K_M")) == digest
    again = tmp_path / "again"
    r = pull(again, registry.url, name)
    assert r.returncode == 0, r.stderr
    assert Layout(again).legacy_manifest(parse_name(name)).read_bytes() == landed


@pytest.mark.parametrize(
    ("name", "url", "repo"),
    [
        ("docker.io/ai/smollm2:360M-Q4_K_M", "https://registry-1.docker.io", "ai/smollm2"),
        ("docker.io/ai/smollm2:1", "https://index.docker.io", "ai/smollm2"),
        ("ghcr.io/Org/M:1", "https://ghcr.io", "org/m"),
        ("ghcr.io/org/m:1", "https://registry.example", None),
        ("org/m:1", "https://ghcr.io", None),
    ],
)
def test_own_repository(name: str, url: str, repo: str | None) -> None:
    assert own_repository(parse_name(name), url) == repo


def test_weights_an_ollama_model_has_are_not_fetched_again(
    registry: Registry, tmp_path: Path, demo: Path, weights: bytes
) -> None:
    """Into a store whose Ollama model has the same GGUF: that blob is not fetched, and both
    models name the one file."""
    dmr_artifact(registry, tmp_path, weights, NAME)
    store = tmp_path / "store"
    shutil.copytree(demo, store, symlinks=True)
    r = pull(store, registry.url, NAME)
    assert r.returncode == 0, r.stderr
    assert not [uri for uri in blob_gets(registry) if uri.endswith(sha(weights))]
    names = {t["name"] for t in ollama_local.api_tags(store)}
    assert {NAME, VOCAB_ONLY_MODEL} <= names
