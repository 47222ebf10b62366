"""Artifacts from a hostile or broken registry, and pulled while something else happens to
the store: another pull landing a blob a refused artifact's pull fetched; files an artifact
names that are no plain path; a disk that fills while a tar's members are copied out; a
context size Docker Model Runner would not read; a carried Ollama manifest, or the registry's
manifest, naming a blob at a size it does not have. A real docker-registry, pushed to by
skopeo (tests/artifacts.py), and where a pull must be held in the middle or a manifest no
client would push served, a forwarding server on loopback in front of it.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from tests.artifacts import (
    DMR_CONFIG,
    FP,
    MP,
    MP_ARTIFACT,
    desc,
    modelpack_config,
    push_layout,
    sha,
    shards,
    tar_of,
)
from tests.conftest import tmpfs
from tests.registry import Registry
from tests.test_artifacts import (  # noqa: F401 - pytestmark: the same needs
    assert_nothing_written,
    demo,
    pytestmark,
    registry,
    store_manifest,
)
from tests.test_artifacts_safetensors import bad_tar, blob_path
from tests.test_registries import MODELFS, error_line, modelfs, pull

_HOP = {"connection", "transfer-encoding", "keep-alive"}
OLLAMA_MODEL = "application/vnd.ollama.image.model"


@contextmanager
def gate(
    upstream: Registry, held: str = "", served: dict[str, tuple[str, bytes]] | None = None
) -> Iterator[tuple[str, threading.Event]]:
    """A server forwarding every request to `upstream`; a GET of blob `held` waits until the
    event is set, and a path of `served` is answered with its media type and bytes instead.
    Its URL and the event."""
    release = threading.Event()
    host, port = upstream.address.split(":")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _forward(self, method: str) -> None:
            media, own = (served or {}).get(self.path, ("", b""))
            if media:
                self.send_response(200)
                self.send_header("Content-Type", media)
                self.send_header("Docker-Content-Digest", sha(own))
                self.send_header("Content-Length", str(len(own)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(own)
                return
            if held and method == "GET" and self.path.endswith(f"/blobs/{held}"):
                release.wait(60)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(method, self.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in (*_HOP, "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)
            conn.close()

        def do_GET(self) -> None:
            self._forward("GET")

        def do_HEAD(self) -> None:
            self._forward("HEAD")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_refused_artifact_leaves_a_blob_another_pull_landed_meanwhile(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """Pull A fetches an artifact whose weight tar is refused (it holds a symlink); while its
    tar is still on the way, pull B lands another model naming A's shard, which it finds
    here and so does not fetch. A's refusal then removes what it fetched, but not the shard,
    which B's manifest names now (the old code removed it: B's model lost its weights)."""
    shard = shards()[0][2]
    weight = (desc(MP + "weight.v1.raw", shard, **{FP: "model.safetensors"}), shard)
    tar = bad_tar("symlink")
    bad = [weight, (desc(MP + "weight.v1.tar", tar), tar)]
    push_layout(registry, tmp_path, "ghcr.io/kit/bad:v1", modelpack_config(bad), bad, MP_ARTIFACT)
    good = [weight]
    push_layout(
        registry, tmp_path, "ghcr.io/kit/good:v1", modelpack_config(good), good, MP_ARTIFACT
    )
    store = tmp_path / "store"
    store.mkdir()
    with gate(registry, sha(tar)) as (url, release):
        a = subprocess.Popen(
            [MODELFS, "pull", "--store", str(store), "ghcr.io/kit/bad:v1", "--from", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not blob_path(store, sha(shard)).exists():
                assert a.poll() is None and time.monotonic() < deadline, a.communicate()
                time.sleep(0.05)
            b = pull(store, registry.url, "ghcr.io/kit/good:v1")
            assert b.returncode == 0, b.stderr
            release.set()
            _, err = a.communicate(timeout=60)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert a.returncode == 1
    assert "is a symlink" in error_line(err), err
    doc = store_manifest(store, "ghcr.io/kit/good:v1")
    for ref in [doc["config"], *doc["layers"]]:
        assert blob_path(store, ref["digest"]).stat().st_size == ref["size"], ref
    assert not blob_path(store, sha(tar)).exists()  # what only A wanted went again
    assert Layout(store).legacy_manifest(parse_name("ghcr.io/kit/good:v1")).exists()


@pytest.mark.parametrize(
    "path",
    ["../../model.safetensors", "/etc/model.safetensors", "a/./model.safetensors", "a\nb.json"],
)
def test_a_filepath_annotation_that_is_no_plain_path_is_refused(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    path: str,
) -> None:
    """A raw layer's `org.cncf.model.filepath` names the file as a tar member's name does, and
    is held to the same rule: a path out of the model's directory (or with a control
    character) is one line, nothing left (the old code named a tensor or json layer by it)."""
    shard = shards()[0][2]
    name = "model.safetensors" if path.endswith(".json") else path
    layers = [(desc(MP + "weight.v1.raw", shard, **{FP: name}), shard)]
    if path.endswith(".json"):
        cfg = b'{"model_type": "llama"}'
        layers.append((desc(MP + "weight.config.v1.raw", cfg, **{FP: path}), cfg))
    push_layout(
        registry, tmp_path, "ghcr.io/kit/path:v1", modelpack_config(layers), layers, MP_ARTIFACT
    )
    store = tmp_path / "store"
    r = pull(store, registry.url, "ghcr.io/kit/path:v1")
    assert r.returncode == 1, r.stderr
    assert "is not a plain relative path" in error_line(r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_written(store)


def test_a_disk_that_fills_while_a_tar_is_copied_out_is_one_line_naming_the_store(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """The tar layer fits, its member copied out does not: one line naming the model and the
    store (the old code said only "No space left on device"), no manifest, no temp file; the
    fetched tar stays, so a pull with room lands it without fetching it again."""
    weights = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    shard = save({"w": weights})  # 1 MiB
    t = tar_of([("model.safetensors", shard)])
    layers = [(desc(MP + "weight.v1.tar", t), t)]
    name = "ghcr.io/kit/full:v1"
    push_layout(registry, tmp_path, name, modelpack_config(layers), layers, MP_ARTIFACT)
    with tmpfs(tmp_path / "small", "1600k") as mnt:
        store = mnt / "store"
        r = pull(store, registry.url, name)
        assert r.returncode == 1, r.stderr
        line = error_line(r.stderr)
        assert f"no space left on device for the files of {name} in the store {store}" in line
        assert not Layout(store).legacy_manifest(parse_name(name)).exists()
        assert not list((store / ".modelfs" / "tmp").iterdir())
        assert blob_path(store, sha(t)).exists()
        gets = len([uri for method, uri in registry.requests() if "/blobs/" in uri])
        roomy = tmp_path / "roomy"
        (roomy / "blobs").mkdir(parents=True)
        shutil.copyfile(blob_path(store, sha(t)), blob_path(roomy, sha(t)))  # more room
    store = roomy
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    assert store_manifest(store, name)["layers"][0]["digest"] == sha(shard)
    assert len([uri for method, uri in registry.requests() if "/blobs/" in uri]) == gets + 1


@pytest.mark.parametrize("context", [1 << 31, 10**30, 0, -4096, "4096", 4096.5, True])
def test_a_context_size_docker_model_runner_would_not_read_is_no_params_layer(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    context: object,
) -> None:
    """Docker Model Runner's context_size is an int32 (docker/model-runner@1d14f67b
    pkg/distribution/types/config.go): a larger number, a negative one, a string, a float or
    a bool in it becomes no `num_ctx` (the old code wrote 2**31 and 10**30 as they were); the
    model lands without a params layer, as one without a context size does."""
    gguf = b"GGUF" + bytes(60)
    layers = [(desc("application/vnd.docker.ai.gguf.v3", gguf), gguf)]
    cfg = {"config": {"format": "gguf", "context_size": context}, "descriptor": {}}
    cfg["rootfs"] = {"type": "rootfs", "diff_ids": [sha(gguf)]}
    name = "docker.io/ai/ctx:v1"
    push_layout(registry, tmp_path, name, (DMR_CONFIG, json.dumps(cfg).encode()), layers)
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    media = [x["mediaType"] for x in store_manifest(store, name)["layers"]]
    assert "application/vnd.ollama.image.params" not in media


def test_a_carried_ollama_manifest_naming_another_size_is_not_taken(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """An artifact carrying an Ollama manifest (as `push --format` packs one) whose layer
    names the GGUF's digest with another size: that manifest names a blob that is not here,
    so the artifact is landed from its own layers instead; every blob the landed manifest
    names is here at its size (the old code wrote the carried manifest as it was)."""
    gguf = b"GGUF" + bytes(60)
    ollama_cfg = b'{"model_format":"gguf","architecture":"amd64","os":"linux"}'
    inner = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": desc("application/vnd.docker.container.image.v1+json", ollama_cfg),
        "layers": [
            {"mediaType": OLLAMA_MODEL, "digest": sha(gguf), "size": len(gguf) + 4096},
        ],
    }
    carried = json.dumps(inner).encode()
    layers = [
        (desc("application/vnd.docker.ai.gguf.v3", gguf), gguf),
        (desc("application/vnd.docker.container.image.v1+json", ollama_cfg), ollama_cfg),
        (desc("application/vnd.docker.distribution.manifest.v2+json", carried), carried),
    ]
    cfg = {"config": {"format": "gguf"}, "descriptor": {}}
    cfg["rootfs"] = {"type": "rootfs", "diff_ids": [sha(d) for _, d in layers]}
    name = "docker.io/ai/carried:v1"
    push_layout(registry, tmp_path, name, (DMR_CONFIG, json.dumps(cfg).encode()), layers)
    store = tmp_path / "store"
    r = pull(store, registry.url, name)
    assert r.returncode == 0, r.stderr
    doc = store_manifest(store, name)
    for ref in [doc["config"], *doc["layers"]]:
        assert blob_path(store, ref["digest"]).stat().st_size == ref["size"], ref
    assert [x["size"] for x in doc["layers"] if x["mediaType"] == OLLAMA_MODEL] == [len(gguf)]


def test_a_manifest_naming_one_blob_at_two_sizes_is_refused_before_any_fetch(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """A registry's manifest naming the GGUF's digest again, for its license, at another size:
    fetched at one size, the landed manifest would name it at the other, a blob never here.
    One line naming the blob, no blob fetched, nothing written (the old code wrote it)."""
    gguf = b"GGUF" + bytes(60)
    layers = [(desc("application/vnd.docker.ai.gguf.v3", gguf), gguf)]
    cfg = {"config": {"format": "gguf"}, "descriptor": {}, "rootfs": {"type": "rootfs"}}
    config = (DMR_CONFIG, json.dumps(cfg).encode())
    name = "docker.io/ai/twice:v1"
    push_layout(registry, tmp_path, name, config, layers)
    twice = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json"}
    twice["config"] = desc(*config)
    license_ = desc("application/vnd.docker.ai.license", gguf) | {"size": len(gguf) + 100}
    twice["layers"] = [layers[0][0], license_]
    raw = json.dumps(twice).encode()
    before = len([uri for _, uri in registry.requests() if "/blobs/" in uri])
    repos = ("ai/twice", "docker.io/ai/twice")
    paths = {f"/v2/{repo}/manifests/v1": (twice["mediaType"], raw) for repo in repos}
    with gate(registry, served=paths) as (url, _):
        store = tmp_path / "store"
        r = pull(store, url, name)
    assert r.returncode == 1, r.stderr
    assert f"names blob {sha(gguf)} with two sizes" in error_line(r.stderr), r.stderr
    assert len([uri for _, uri in registry.requests() if "/blobs/" in uri]) == before
    assert_nothing_written(store)


def test_a_config_larger_than_any_is_refused_before_any_fetch(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """A config of 5 MiB (valid JSON, padded; skopeo will not push one, so a forwarding server
    serves the manifest and the config): landing reads it whole, so it is refused from the
    manifest alone, no blob fetched (the old code fetched it, read it into memory and then
    refused it; a registry's config of gigabytes would fill the disk and the memory first)."""
    gguf = b"GGUF" + bytes(60)
    layers = [(desc("application/vnd.docker.ai.gguf.v3", gguf), gguf)]
    small = json.dumps({"config": {"format": "gguf"}}).encode()
    name = "docker.io/ai/bigcfg:v1"
    push_layout(registry, tmp_path, name, (DMR_CONFIG, small), layers)
    cfg = small + b" " * (5 << 20)
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json"}
    doc |= {"config": desc(DMR_CONFIG, cfg), "layers": [layers[0][0]]}
    served: dict[str, tuple[str, bytes]] = {}
    for repo in ("ai/bigcfg", "docker.io/ai/bigcfg"):
        served[f"/v2/{repo}/manifests/v1"] = (doc["mediaType"], json.dumps(doc).encode())
        served[f"/v2/{repo}/blobs/{sha(cfg)}"] = ("application/octet-stream", cfg)
    before = len([uri for _, uri in registry.requests() if "/blobs/" in uri])
    store = tmp_path / "store"
    with gate(registry, served=served) as (url, _):
        r = pull(store, url, name)
    assert r.returncode == 1, r.stderr
    assert f"a config of {len(cfg)} bytes, more than a model's config can be" in error_line(
        r.stderr
    ), r.stderr
    assert len([uri for _, uri in registry.requests() if "/blobs/" in uri]) == before
    assert_nothing_written(store)


@pytest.mark.parametrize("fmt", ["modelpack", "docker-model"])
def test_a_layer_name_that_is_no_plain_path_is_not_pushed_as_a_file(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
    demo: Path,  # noqa: F811 - the fixture
    fmt: str,
) -> None:
    """An Ollama safetensors model whose tensor layer is named `../../evil` (a manifest from
    any registry may say so): `push --format` would give it as the filepath other tools unpack
    the artifact by, out of their model's directory. One line, nothing pushed (the old code
    pushed `../../evil.safetensors`)."""
    store = tmp_path / "store"
    shutil.copytree(demo, store, symlinks=True)
    layout = Layout(store)
    doc = json.loads(layout.legacy_manifest(parse_name("gemma4:26b-mlx")).read_bytes())
    [first] = [x for x in doc["layers"] if x["mediaType"].endswith(".tensor")][:1]
    first["name"] = "../../evil"
    target = layout.legacy_manifest(parse_name("gemma4:evil"))
    target.write_bytes(json.dumps(doc).encode())
    r = modelfs("push", "--store", str(store), "gemma4:evil", "--to", registry.url, "--format", fmt)
    assert r.returncode == 1, r.stderr
    assert "'../../evil.safetensors' is not a plain relative path" in error_line(r.stderr)
    assert not [uri for method, uri in registry.requests() if method in ("PUT", "POST")]


def test_an_image_index_is_one_line_saying_so(
    registry: Registry,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """An OCI image index naming an artifact (as a registry serves a multi-platform tag): one
    line saying it is an image index (the old code said "'layers' is missing or not a list"),
    nothing fetched or written."""
    gguf = b"GGUF" + bytes(60)
    layers = [(desc("application/vnd.docker.ai.gguf.v3", gguf), gguf)]
    name = "docker.io/ai/index:v1"
    cfg = (DMR_CONFIG, b'{"config": {"format": "gguf"}}')
    digest = push_layout(registry, tmp_path, name, cfg, layers)
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json"}
    child = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest}
    index["manifests"] = [child | {"size": 1, "platform": {"architecture": "amd64", "os": "linux"}}]
    raw = json.dumps(index).encode()
    served = {f"/v2/{r}/manifests/v1": (index["mediaType"], raw) for r in ("ai/index", name[:-3])}
    store = tmp_path / "store"
    with gate(registry, served=served) as (url, _):
        r = pull(store, url, name)
    assert r.returncode == 1, r.stderr
    line = error_line(r.stderr)
    assert "an image index (application/vnd.oci.image.index.v1+json), not a model's" in line
    assert_nothing_written(store)
