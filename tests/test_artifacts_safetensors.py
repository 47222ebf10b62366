"""ModelPack and Docker Model Runner artifacts whose weights are safetensors, in raw and tar
layers, pulled into the store as Ollama's safetensors models and pushed back as they came.

The layouts are the formats' own:

- ModelPack, modelpack/model-spec@d78bf3231b4f26196c4a955e1007ccc47e19a77c: docs/spec.md
  ("layers": `application/vnd.cncf.model.weight.v1.raw` and `.v1.tar`, "If the model has
  multiple weight files, they SHOULD be packaged into separate layers";
  `weight.config.v1.raw|tar` for tokenizer.json, config.json; `doc.v1.raw|tar` for README.md,
  LICENSE; `+gzip`/`+zstd` compressed tars), specs-go/v1/mediatype.go (the media types),
  specs-go/v1/annotations.go (`org.cncf.model.filepath`), specs-go/v1/config.go (config).
- Docker Model Runner, docker/model-runner@642c72117b2431a6b871796883af1aaf013fc3cf
  pkg/distribution/types/config.go: `application/vnd.docker.ai.safetensors` weights and
  `application/vnd.docker.ai.model.file` files, each named by `org.cncf.model.filepath`
  (pkg/distribution/internal/partial/layer.go), under the v0.2 config (layer per file).

Ollama lays a safetensors model out as `application/vnd.ollama.image.tensor` layers (its mlx
runner loads every tensor of each, x/mlxrunner/runner.go loadTensorsFromManifest) and an
`application/vnd.ollama.image.json` layer per `.json` file but the shard index
(x/create/pipeline.go importConfigBlobs), ollama/ollama@fb30760. The weights are written with
the `safetensors` library and read back through a real mount with it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelfs.fsd.builder import short_path
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from tests import ollama_local
from tests.artifacts import (
    FP,
    LICENSE,
    MP,
    MP_ARTIFACT,
    MP_CONFIG,
    desc,
    hf_files,
    inspect_raw,
    modelpack_config,
    modelpack_layers,
    push_layout,
    sha,
    shards,
    tar_of,
)
from tests.mounting import fuse, mounted
from tests.registry import Registry, running_registry
from tests.test_artifacts import (  # noqa: F401 - pytestmark: the same needs
    assert_nothing_written,
    blob,
    blob_gets,
    demo,
    pytestmark,
    registry,
    store_manifest,
)
from tests.test_registries import error_line, modelfs, pull

safe_open = pytest.importorskip("safetensors").safe_open

TENSOR = "application/vnd.ollama.image.tensor"
JSON = "application/vnd.ollama.image.json"


def mounted_model(mnt: Path, name: str) -> Path:
    return mnt.joinpath(*short_path(parse_name(name)))


def blob_path(store: Path, digest: str) -> Path:
    return store / "blobs" / digest.replace(":", "-")


def registry_digest(reg: Registry, repo: str) -> str:
    return sha(inspect_raw(reg, repo))


@fuse
@pytest.mark.parametrize("packing", ["raw", "tar"])
def test_a_modelpack_safetensors_artifact_lands_opens_and_goes_back_as_it_came(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    packing: str,
) -> None:
    """Pulled: listed by Ollama's /api/tags as a safetensors model; each shard a tensor layer
    of the shard's own digest (a tar's member copied out, the tar kept), each `.json` but the
    shard index a json layer named by its path; through the mount, `tensors/<shard>` and
    `model.safetensors` open with the safetensors library and hold the tensors written. A
    re-pull fetches nothing; `push --format modelpack` gives the registry the artifact's own
    manifest (the same digest), and a fresh store pulls the same Ollama model from it."""
    name = f"ghcr.io/kit/tiny-st:{packing}"
    layers = modelpack_layers(packing)
    digest = push_layout(
        registry, tmp_path, name, modelpack_config(layers), layers, artifact_type=MP_ARTIFACT
    )
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr

    [tags] = ollama_local.api_tags(store)
    assert tags["name"] == name
    assert (tags["details"]["format"], tags["details"]["family"]) == ("safetensors", "llama")
    assert tags["capabilities"] == ["completion"]  # what Ollama asks before it generates
    doc = store_manifest(store, name)
    weights = shards()
    tensors = [x for x in doc["layers"] if x["mediaType"] == TENSOR]
    assert [(x["name"], x["digest"]) for x in tensors] == [
        (n.removesuffix(".safetensors"), sha(d)) for n, _, d in weights
    ]
    jsons = {x["name"]: x["digest"] for x in doc["layers"] if x["mediaType"] == JSON}
    configs = dict(hf_files(weights))
    assert jsons == {n: sha(d) for n, d in configs.items() if n != "model.safetensors.index.json"}
    [lic] = [x for x in doc["layers"] if x["mediaType"] == "application/vnd.ollama.image.license"]
    assert blob(store, lic["digest"]) == LICENSE
    kept = {x["digest"] for x in doc["layers"]}
    assert {sha(d) for _, d in layers} <= kept  # raw layers and tars alike, as they came
    source = json.loads(blob(store, doc["config"]["digest"]))["modelfs_source"]
    assert source["digest"] == digest
    # Every blob landed is a layer: a stock Ollama's prune two hours on and our GC keep all.
    held = sorted(p.name for p in (store / "blobs").iterdir())
    assert ollama_local.startup_prune(store, now=time.time() + 7200) == set()
    for _ in range(2):  # a blob no manifest names goes on the second run
        r = modelfs("gc", "--store", str(store), "--grace", "0s", "--grace-below-floor")
        assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (store / "blobs").iterdir()) == held

    mnt = tmp_path / "mnt"
    with mounted(store, mnt):
        model = mounted_model(mnt, name)
        for n, expected, _ in weights:
            with safe_open(str(model / "tensors" / n), framework="numpy") as f:
                assert sorted(f.keys()) == sorted(expected)
                for key, value in expected.items():
                    np.testing.assert_array_equal(f.get_tensor(key), value)
        with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
            merged = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open's API
        assert merged.keys() == {k for _, ts, _ in weights for k in ts}
        for _, ts, _ in weights:
            for key, value in ts.items():
                np.testing.assert_array_equal(merged[key], value)
        assert (model / "config.json").read_bytes() == configs["config.json"]

    landed = Layout(store).legacy_manifest(parse_name(name)).read_bytes()
    before = len(blob_gets(registry))
    inodes = {x["digest"]: blob_path(store, x["digest"]).stat().st_ino for x in tensors}
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    assert len(blob_gets(registry)) == before
    # A tar's members found here are not written again.
    assert {d: blob_path(store, d).stat().st_ino for d in inodes} == inodes
    assert Layout(store).legacy_manifest(parse_name(name)).read_bytes() == landed

    # Into a registry that has none of its blobs: every one uploaded, the manifest as it came.
    with running_registry(tmp_path / "other") as other:
        r = modelfs("push", "--store", str(store), name, "--to", other.url, "--format", "modelpack")
        assert r.returncode == 0, r.stderr
        assert registry_digest(other, f"ghcr.io/kit/tiny-st:{packing}") == digest
        again = tmp_path / "again"
        r = pull(again, other.url, name)
        assert r.returncode == 0, r.stderr
        assert Layout(again).legacy_manifest(parse_name(name)).read_bytes() == landed


@pytest.mark.parametrize("version", ["v0.1", "v0.2"])
def test_a_docker_model_runner_safetensors_artifact_lands(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    version: str,
) -> None:
    """`application/vnd.docker.ai.safetensors` shards, with the config files in one
    `application/vnd.docker.ai.vllm.config.tar` (config v0.1, which DMR's
    internal/bundle/unpack.go unpackConfigArchive extracts beside the weights) or each an
    `application/vnd.docker.ai.model.file` (config v0.2, a layer per file): tensor layers of
    the shards' digests and json layers by path; pushed back as docker-model, the registry
    gets the artifact's own manifest."""
    weights = shards()
    layers = [
        (desc("application/vnd.docker.ai.safetensors", d, **{FP: n}), d) for n, _, d in weights
    ]
    if version == "v0.1":
        t = tar_of(hf_files(weights))
        layers.append((desc("application/vnd.docker.ai.vllm.config.tar", t), t))
    else:
        layers += [
            (desc("application/vnd.docker.ai.model.file", d, **{FP: n}), d)
            for n, d in hf_files(weights)
        ]
    cfg = {
        "config": {"format": "safetensors", "architecture": "llama", "context_size": 4096},
        "descriptor": {},
        "rootfs": {"type": "rootfs", "diff_ids": [d["digest"] for d, _ in layers]},
    }
    config = (f"application/vnd.docker.ai.model.config.{version}+json", json.dumps(cfg).encode())
    name = "docker.io/ai/tiny-st:latest"
    digest = push_layout(registry, tmp_path, name, config, layers)
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    [tags] = ollama_local.api_tags(store)
    assert tags["details"]["format"] == "safetensors"
    doc = store_manifest(store, name)
    assert [x["digest"] for x in doc["layers"] if x["mediaType"] == TENSOR] == [
        sha(d) for _, _, d in weights
    ]
    jsons = {x["name"]: x["digest"] for x in doc["layers"] if x["mediaType"] == JSON}
    configs = dict(hf_files(weights))
    assert jsons == {n: sha(configs[n]) for n in ("config.json", "tokenizer.json")}
    assert all(blob(store, d) == configs[n] for n, d in jsons.items())
    [params] = [x for x in doc["layers"] if x["mediaType"] == "application/vnd.ollama.image.params"]
    assert json.loads(blob(store, params["digest"])) == {"num_ctx": 4096}
    r = modelfs(
        "push", "--store", str(store), name, "--to", registry.url, "--format", "docker-model"
    )
    assert r.returncode == 0, r.stderr
    assert registry_digest(registry, "docker.io/ai/tiny-st:latest") == digest


def pax_tar(bodies: list[bytes], name: str, data: bytes, kind: bytes = tarfile.XHDTYPE) -> bytes:
    """A tar of one member preceded by extended headers of the bodies given, as they are
    (tarfile writes only well-formed ones)."""
    out = b""
    for body in bodies:
        head = tarfile.TarInfo("././@PaxHeader")
        head.size, head.type = len(body), kind
        out += head.tobuf(tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return out + info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512 + 1024)


def bad_tar(case: str) -> bytes:
    """A tar whose members could not be a model's files, written by Python's tarfile; or
    whose headers lie to the stdlib's tar reader."""
    buf = io.BytesIO()
    data = shards()[0][2]
    if case == "negative-size":  # the member would read the rest of the tar
        return pax_tar([b"12 size=-10\n"], "model.safetensors", data)
    if case == "pax-digits":  # quadratic in Python < 3.11.10's PAX parser (CVE-2024-6232)
        return pax_tar([b"9" * 60_000 + b" "], "model.safetensors", data)
    if case == "pax-chain":  # one recursion per header: a RecursionError
        return pax_tar([b"26 path=model.safetensors\n"] * 2000, "model.safetensors", data)
    if case == "sparse-map":  # tarfile parses it with int(): a ValueError
        return pax_tar([b"22 GNU.sparse.map=a,b\n"], "model.safetensors", data)
    if case == "non-utf8":  # tarfile gives the byte as a lone surrogate
        return pax_tar([b"27 path=model\xff.safetensors\n"], "model.safetensors", data)
    if case == "long-header":  # read whole into memory, however big
        return pax_tar([b"m" * (128 << 10)], "x", data, tarfile.GNUTYPE_LONGNAME)
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:

        def add(
            name: str, kind: bytes = tarfile.REGTYPE, payload: bytes = b"", link: str = ""
        ) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(payload) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(payload) if payload else None)

        if case == "traversal":
            add("../../model.safetensors", payload=data)
        elif case == "absolute":
            add("/etc/model.safetensors", payload=data)
        elif case == "symlink":
            add("model.safetensors", tarfile.SYMTYPE, link="/etc/passwd")
        elif case == "hardlink":
            add("a.safetensors", payload=data)
            add("model.safetensors", tarfile.LNKTYPE, link="a.safetensors")
        elif case == "device":
            add("model.safetensors", tarfile.CHRTYPE)
        elif case == "fifo":
            add("model.safetensors", tarfile.FIFOTYPE)
        elif case == "duplicate":
            add("model.safetensors", payload=data)
            add("./model.safetensors", payload=data)
        elif case == "huge":
            for i in range(4097):
                add(f"f{i}.safetensors")
    return buf.getvalue()


BAD = {
    "traversal": "not a plain relative path",
    "absolute": "not a plain relative path",
    "symlink": "is a symlink",
    "hardlink": "is a hard link",
    "device": "is a device",
    "fifo": "is a FIFO",
    "duplicate": "appears twice",
    "huge": "more than 4096 members",
    "not-a-tar": "not an uncompressed tar",
    "negative-size": "has a negative size",
    "pax-digits": "a PAX header that is not PAX records",
    "pax-chain": "more than 8 extended headers in a row",
    "long-header": "an extended header of 131072 bytes",
    "non-utf8": "not a plain relative path",
    "sparse-map": "a GNU sparse file's PAX header",
}


def pull_refused(
    to: Registry, tmp_path: Path, name: str, layers: list[tuple[dict[str, Any], bytes]]
) -> str:
    """Push a ModelPack artifact of `layers` to `to`, pull it into an empty store: the pull
    fails without a traceback and leaves nothing in the store. Returns its stderr."""
    push_layout(to, tmp_path, name, modelpack_config(layers), layers, MP_ARTIFACT)
    store = tmp_path / "store"
    r = pull(store, to.url, name)
    assert r.returncode == 1, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    assert_nothing_written(store)
    return r.stderr


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_tar_that_is_no_model_directory_is_refused_whole(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    case: str,
) -> None:
    """A weight tar with a member outside the model's directory, a link, a device, a FIFO, a
    name twice, more members than a model has, or bytes that are no tar; headers that lie to
    Python's tarfile (a negative PAX size, a PAX header of a long digit run, thousands of
    headers in a row, a 128 KiB GNU long name) are refused before tarfile acts on them (the old
    code took a member of size -10, spent quadratic time, or died of a RecursionError); one
    line naming why,
    no traceback, and nothing left in the store (the blobs fetched for it go again)."""
    data = b"\x1f\x8b" + bytes(1022) if case == "not-a-tar" else bad_tar(case)
    layers = [(desc(MP + "weight.v1.tar", data), data)]
    stderr = pull_refused(registry, tmp_path, f"ghcr.io/bad/{case}:v1", layers)
    assert BAD[case] in error_line(stderr), stderr
    assert len([x for x in stderr.splitlines() if "error" in x]) == 1, stderr


@pytest.mark.parametrize("media", ["weight.v1.tar+gzip", "weight.config.v1.tar+zstd"])
def test_a_compressed_weight_tar_is_refused_before_any_fetch(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    media: str,
) -> None:
    """A `+gzip`/`+zstd` weight (or weight config) tar: its files would be inflated bytes
    that are not the artifact's; one line saying it is compressed, no blob fetched."""
    data = hashlib.sha256(media.encode()).digest() * 8
    layers = [(desc(MP + media, data), data)]
    name = "ghcr.io/bad/compressed:v1"
    push_layout(registry, tmp_path, name, modelpack_config(layers), layers, MP_ARTIFACT)
    store = tmp_path / "store"
    before = len(blob_gets(registry))
    r = pull(store, registry.url, name)
    assert r.returncode == 1
    assert f"{MP}{media} is a compressed tar" in error_line(r.stderr)
    assert len(blob_gets(registry)) == before
    assert_nothing_written(store)


@pytest.mark.parametrize(
    ("fmt", "weight_type", "config_type"),
    [
        ("modelpack", MP + "weight.v1.raw", MP_CONFIG),
        (
            "docker-model",
            "application/vnd.docker.ai.safetensors",
            "application/vnd.docker.ai.model.config.v0.2+json",
        ),
    ],
)
def test_an_ollama_safetensors_model_pushes_as_an_artifact_and_comes_back(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    demo: Path,  # noqa: F811 - the fixture
    fmt: str,
    weight_type: str,
    config_type: str,
) -> None:
    """The demo's `gemma4:26b-mlx` (Ollama's safetensors layout, as x/create writes it) pushed
    `--format`: each tensor layer a weight layer of its own digest named `<tensor>.safetensors`,
    each json layer a config file named by its path (ModelPack: `weight.v1.raw` and
    `weight.config.v1.raw`, as docker/model-runner's pkg/distribution/modelpack/convert.go
    maps them; Docker Model Runner: its safetensors and model.file types under the v0.2
    config); pulled back, the identical Ollama model."""
    name = "gemma4:26b-mlx"
    r = modelfs("push", "--store", str(demo), name, "--to", registry.url, "--format", fmt)
    assert r.returncode == 0, r.stderr
    original = Layout(demo).legacy_manifest(parse_name(name)).read_bytes()
    doc = json.loads(original)
    artifact = json.loads(inspect_raw(registry, "library/gemma4:26b-mlx"))
    assert artifact["config"]["mediaType"] == config_type
    by_digest = {x["digest"]: x for x in artifact["layers"]}
    for layer in doc["layers"]:
        packed = by_digest[layer["digest"]]
        if layer["mediaType"] == TENSOR:
            assert packed["mediaType"] == weight_type
            assert packed["annotations"][FP] == layer["name"] + ".safetensors"
        elif layer["mediaType"] == JSON:
            assert packed["annotations"][FP] == layer["name"]

    back = tmp_path / "back"
    r = pull(back, registry.url, name)
    assert r.returncode == 0, r.stderr
    assert Layout(back).legacy_manifest(parse_name(name)).read_bytes() == original
    [tags] = ollama_local.api_tags(back)
    assert tags["details"]["format"] == "safetensors"


REFUSED = {
    "mixed": "both GGUF and safetensors weights",
    "pickle": "no GGUF or safetensors weights",
    "broken": "model.safetensors: header length",
    "twice": "two files are named 'model.safetensors'",
    "not-gguf": "model.gguf is no GGUF file (it starts b'\\x80\\x02}q'); refused",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_weights_ollama_cannot_run_are_one_line_and_nothing_left(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    case: str,
) -> None:
    """GGUF and safetensors weights together, a pickled `pytorch_model.bin`, a `.safetensors`
    file that is none, two layers naming one file, a `.gguf` file that is none (the old code
    landed it as the model): one line, and the blobs fetched for the artifact removed
    again."""
    good = shards()[0][2]
    raw = MP + "weight.v1.raw"
    files = {
        "mixed": [("model.gguf", b"GGUF" + bytes(60)), ("model.safetensors", good)],
        "pickle": [("pytorch_model.bin", b"\x80\x02}q\x00.")],
        "broken": [("model.safetensors", (1 << 40).to_bytes(8, "little") + b"{}")],
        "twice": [("model.safetensors", good), ("model.safetensors", good + b" ")],
        "not-gguf": [("model.gguf", b"\x80\x02}q\x00.")],
    }[case]
    layers = [(desc(raw, data, **{FP: path}), data) for path, data in files]
    stderr = pull_refused(registry, tmp_path, f"ghcr.io/bad/{case}:v1", layers)
    assert REFUSED[case] in error_line(stderr), stderr
