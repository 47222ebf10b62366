"""`modelfs push` against a real registry: Debian's docker-registry (CNCF distribution 2.8) on a
loopback port (tests/registry.py). What landed is checked with plain HTTP GETs and skopeo, not
with our own client."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from modelfs.cli.app import run
from modelfs.demo import GEMMA, LLAMA, QWEN, SMOL, TINY, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.errors import CorruptBlobError
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST, MEDIA_OCI_MANIFEST, ManifestList
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.sync.client.http import make_client
from modelfs.sync.client.push import PushResult, plan_model, push_all
from modelfs.sync.errors import PeerLiedError
from modelfs.sync.wire.ocirepr import decode_list, parse_carrier
from modelfs.sync.wire.registry_names import reference_for
from tests.builders import TinyStore
from tests.registry import (
    DOCKER_REGISTRY,
    HTPASSWD_PASSWORD,
    HTPASSWD_USER,
    Registry,
    free_port,
    needs_registry,
    running_registry,
)

pytestmark = needs_registry

REPO = Path(__file__).resolve().parent.parent
NAMES = [GEMMA, LLAMA, QWEN, TINY, SMOL]
SKOPEO = shutil.which("skopeo")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with running_registry(tmp_path / "registry") as reg:
        yield reg


@pytest.fixture(autouse=True)
def _logging() -> Iterator[None]:
    """run() installs a stderr handler on the root logger; give it back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def copy_store(demo: DemoStore, dst: Path) -> Path:
    shutil.copytree(demo.root, dst, symlinks=True)
    return dst


def push_cli(store: Path, url: str, *args: str) -> int:
    return run(["push", "--store", str(store), *args, "--to", url])


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("modelfs: error:")]


def get(url: str, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept else {}
    return httpx.get(url, headers=headers, timeout=10)


def assert_blob(reg: Registry, repository: str, digest: Digest, size: int) -> None:
    r = get(f"{reg.url}/v2/{repository}/blobs/{digest}")
    assert r.status_code == 200, (repository, digest, r.text)
    assert len(r.content) == size
    assert hashlib.sha256(r.content).hexdigest() == digest.hex
    assert r.headers["Docker-Content-Digest"] == str(digest)


def assert_manifest(reg: Registry, repository: str, ref: str, raw: bytes, accept: str) -> None:
    r = get(f"{reg.url}/v2/{repository}/manifests/{ref}", accept)
    assert r.status_code == 200, (repository, ref, r.text)
    assert r.content == raw
    assert r.headers["Docker-Content-Digest"] == str(Digest.of_bytes(raw))


def head(url: str) -> int:
    return httpx.head(url, timeout=10).status_code


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def uploads(requests: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(m, u) for m, u in requests if m in ("POST", "PATCH", "PUT", "DELETE")]


# -- pushing the demo store --------------------------------------------------------------------


def test_push_the_demo_store(
    demo: DemoStore, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert push_cli(demo.root, registry.url, *NAMES) == 0
    out, err = capsys.readouterr()
    assert error_lines(err) == []
    lines = out.splitlines()
    assert len(lines) == len(NAMES)
    assert lines[0].startswith(f"pushed {GEMMA} to {registry.url}/library/gemma4:26b (")
    assert "/hf.co/bartowski/smollm2-135m-instruct-gguf:Q4_K_M (" in lines[4]

    catalog = get(f"{registry.url}/v2/_catalog").json()["repositories"]
    assert sorted(catalog) == sorted(
        [
            "library/gemma4",
            "library/llama3.2",
            "library/qwen3",
            "someuser/tiny",
            "hf.co/bartowski/smollm2-135m-instruct-gguf",
        ]
    )

    # Plain models: the manifest bytes at the tag, and every blob, under their digests.
    for key in (LLAMA, QWEN, TINY, SMOL):
        m = demo.manifest(key)
        repository, tag = reference_for(m.name)
        assert_manifest(registry, repository, tag, m.raw, MEDIA_MANIFEST)
        assert_manifest(registry, repository, str(m.digest), m.raw, MEDIA_MANIFEST)
        for layer in (m.config, *m.layers):
            assert_blob(registry, repository, layer.digest, layer.size)
        tags = get(f"{registry.url}/v2/{repository}/tags/list").json()["tags"]
        assert tags == [tag]

    # The list: a carrier at the tag, whose config blob is the list, byte for byte.
    the_list = demo.lists[GEMMA]
    r = get(f"{registry.url}/v2/library/gemma4/manifests/26b", MEDIA_OCI_MANIFEST)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == MEDIA_OCI_MANIFEST
    carrier = parse_carrier(r.content, r.headers["Content-Type"])
    assert carrier is not None
    assert r.headers["Docker-Content-Digest"] == str(carrier.digest)
    assert carrier.list_ref.digest == the_list.digest
    assert_blob(registry, "library/gemma4", the_list.digest, len(the_list.raw))
    list_raw = get(f"{registry.url}/v2/library/gemma4/blobs/{the_list.digest}").content
    decoded = decode_list(carrier, list_raw)
    assert decoded.raw == the_list.raw
    for runner, _, digest in the_list.children:
        child = demo.manifest(f"{GEMMA}@{runner}")
        assert child.digest == digest
        assert_manifest(registry, "library/gemma4", str(digest), child.raw, MEDIA_MANIFEST)
        assert_blob(registry, "library/gemma4", digest, len(child.raw))
        for layer in (child.config, *child.layers):
            assert_blob(registry, "library/gemma4", layer.digest, layer.size)
    # The carrier names every blob of both children, so the registry's GC keeps them all.
    held = {layer.digest for layer in carrier.layers}
    for runner, _, digest in the_list.children:
        child = demo.manifest(f"{GEMMA}@{runner}")
        assert {digest, child.config.digest, *(x.digest for x in child.layers)} <= held
    assert get(f"{registry.url}/v2/library/gemma4/tags/list").json()["tags"] == ["26b"]


def test_ollama_clients_get_a_clean_404_for_a_list(demo: DemoStore, registry: Registry) -> None:
    """Ollama asks for Docker v2 only (PR16590: the list type, then v2); distribution will not
    hand it the carrier, which it would save as a broken model."""
    assert push_cli(demo.root, registry.url, GEMMA) == 0
    for accept in (MEDIA_MANIFEST, f"{MEDIA_LIST}, {MEDIA_MANIFEST}"):
        r = get(f"{registry.url}/v2/library/gemma4/manifests/26b", accept)
        assert r.status_code == 404
        assert r.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN"


@pytest.mark.skipif(SKOPEO is None, reason="needs skopeo")
def test_skopeo_reads_back_the_bytes_we_pushed(demo: DemoStore, registry: Registry) -> None:
    assert push_cli(demo.root, registry.url, LLAMA, SMOL, GEMMA) == 0
    for key in (LLAMA, SMOL):
        m = demo.manifest(key)
        repository, tag = reference_for(m.name)
        raw = subprocess.run(
            [
                SKOPEO,
                "inspect",
                "--raw",
                "--tls-verify=false",
                f"docker://{registry.address}/{repository}:{tag}",
            ],
            check=True,
            capture_output=True,
        ).stdout
        assert raw == m.raw
    raw = subprocess.run(
        [
            SKOPEO,
            "inspect",
            "--raw",
            "--tls-verify=false",
            f"docker://{registry.address}/library/gemma4:26b",
        ],
        check=True,
        capture_output=True,
    ).stdout
    carrier = parse_carrier(raw)
    assert carrier is not None and carrier.list_ref.digest == demo.lists[GEMMA].digest


# -- what goes over the wire -------------------------------------------------------------------


def counting_client(log: list[tuple[str, str]]) -> httpx.AsyncClient:
    client = make_client()

    async def record(request: httpx.Request) -> None:
        log.append((request.method, request.url.path))

    client.event_hooks["request"].append(record)
    return client


async def push(
    demo_root: Path, url: str, names: list[str], client: httpx.AsyncClient, **options: int
) -> list[PushResult]:
    index = scan_store(demo_root)
    plans = [plan_model(index, n) for n in names]
    async with client:
        return await push_all(plans, url, client, **options)


async def test_pushing_twice_uploads_nothing(demo: DemoStore, registry: Registry) -> None:
    first: list[tuple[str, str]] = []
    results = await push(demo.root, registry.url, NAMES, counting_client(first))
    assert sum(r.uploaded for r in results) > 0
    assert all(r.manifests_pushed for r in results)
    mark = len(registry.requests())

    second: list[tuple[str, str]] = []
    results = await push(demo.root, registry.url, NAMES, counting_client(second))
    assert {m for m, _ in second} == {"GET", "HEAD"}
    assert [p for m, p in second if m == "GET"] == ["/v2/"]
    assert all(r.uploaded == r.mounted == r.manifests_pushed == 0 for r in results)
    assert sum(r.present for r in results) == sum(
        len(plan_model(scan_store(demo.root), n).blobs) for n in NAMES
    )
    # And the registry agrees: nothing but reads after the mark.
    assert uploads(registry.requests()[mark:]) == []


async def test_shared_blobs_are_mounted_across_repositories(
    demo: DemoStore, registry: Registry
) -> None:
    results = await push(demo.root, registry.url, [LLAMA, QWEN], make_client())
    llama, qwen = (demo.manifest(k) for k in (LLAMA, QWEN))
    shared = {x.digest for x in llama.layers} & {x.digest for x in qwen.layers}
    assert len(shared) == 2  # the template and the license
    assert results[1].mounted == len(shared)
    mounts = [u for m, u in registry.requests() if m == "POST" and "mount=" in u]
    assert len(mounts) == len(shared)
    assert all("from=library%2Fllama3.2" in u for u in mounts)
    for d in shared:
        size = next(x.size for x in qwen.layers if x.digest == d)
        assert_blob(registry, "library/qwen3", d, size)


async def test_large_blobs_go_in_patch_parts(demo: DemoStore, registry: Registry) -> None:
    log: list[tuple[str, str]] = []
    part = 300_000  # not a multiple of the 1 MiB read size, nor of anything else
    results = await push(
        demo.root, registry.url, [SMOL], counting_client(log), small=64 << 10, part=part
    )
    m = demo.manifest(SMOL)
    big = [x for x in (m.config, *m.layers) if x.size > 64 << 10]
    assert big
    patches = [p for method, p in log if method == "PATCH"]
    assert len(patches) == sum(math.ceil(x.size / part) for x in big)
    assert results[0].uploaded == len(m.layers) + 1
    for x in (m.config, *m.layers):
        assert_blob(registry, "hf.co/bartowski/smollm2-135m-instruct-gguf", x.digest, x.size)


def test_json_progress(
    demo: DemoStore, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert push_cli(demo.root, registry.url, LLAMA, GEMMA, "--json") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(list(x) == ["status", "digest", "total", "completed"] for x in lines)
    assert all(x["digest"].startswith("sha256:") for x in lines)
    success = [x for x in lines if x["status"] == "success"]
    assert [x["digest"] for x in success] == [
        str(demo.manifest(LLAMA).digest),
        str(demo.lists[GEMMA].digest),
    ]
    assert all(x["completed"] == x["total"] > 0 for x in success)
    assert lines[0]["status"] == f"pushing {LLAMA}"
    uploaded = {x["digest"] for x in lines if x["status"] == "uploaded"}
    assert str(demo.manifest(LLAMA).layer("model.gguf").digest) in uploaded


def test_registry_gc_keeps_a_pushed_list(demo: DemoStore, tmp_path: Path) -> None:
    """`registry garbage-collect --delete-untagged` drops the children's manifest revisions
    (they were pushed by digest, untagged), but the carrier names every child manifest and
    every blob they use, so all of it stays, and distribution still serves the children by
    digest from their blob links."""
    work = tmp_path / "reg"
    with running_registry(work) as reg:
        assert push_cli(demo.root, reg.url, GEMMA) == 0
    gc = subprocess.run(
        [DOCKER_REGISTRY, "garbage-collect", "--delete-untagged", str(work / "config.yml")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "blobs marked" in gc.stdout
    revisions = work / "storage/docker/registry/v2/repositories/library/gemma4/_manifests"
    assert len(list((revisions / "revisions/sha256").iterdir())) == 1  # the carrier alone
    with running_registry(work) as reg:
        the_list = demo.lists[GEMMA]
        assert_blob(reg, "library/gemma4", the_list.digest, len(the_list.raw))
        for runner, _, digest in the_list.children:
            child = demo.manifest(f"{GEMMA}@{runner}")
            assert_manifest(reg, "library/gemma4", str(digest), child.raw, MEDIA_MANIFEST)
            for layer in (child.config, *child.layers):
                assert_blob(reg, "library/gemma4", layer.digest, layer.size)


# -- lists whose children are not all here ------------------------------------------------------


def test_list_with_an_absent_child_keeps_what_the_registry_has(
    tmp_path: Path, registry: Registry
) -> None:
    a = TinyStore(tmp_path / "a")
    gguf = a.manifest([a.layer("model", b"gguf weights")], runner="llamacpp", format="gguf")
    mlx = a.manifest(
        [a.layer("tensor", b"mlx weights", name="w")],
        {"model_format": "safetensors"},
        runner="mlx",
        format="safetensors",
    )
    list_raw = a.manifest_list([(gguf, "llamacpp", "gguf"), (mlx, "mlx", "safetensors")])
    a.v2("m:1", list_raw)
    # Store b has the same list, but only the mlx child (Ollama pulls one variant).
    b = TinyStore(tmp_path / "b")
    b.blob(mlx)
    b.layer("tensor", b"mlx weights")
    b.layer(
        "application/vnd.docker.container.image.v1+json",
        json.dumps({"model_format": "safetensors"}).encode(),
    )
    b.v2("m:1", list_raw)
    # And store c only the gguf one, with nothing of it on the registry yet.
    c = TinyStore(tmp_path / "c")
    c.blob(gguf)
    c.layer("model", b"gguf weights")
    c.layer(
        "application/vnd.docker.container.image.v1+json",
        json.dumps(
            {"model_format": "gguf", "model_family": "llama", "file_type": "Q4_K_M"}
        ).encode(),
    )
    c.v2("m:1", list_raw)

    def carrier_children() -> list[str]:
        r = get(f"{registry.url}/v2/library/m/manifests/1", MEDIA_OCI_MANIFEST)
        carrier = parse_carrier(r.content)
        assert carrier is not None
        list_blob = get(f"{registry.url}/v2/library/m/blobs/{carrier.list_ref.digest}").content
        assert list_blob == list_raw
        the_list = decode_list(carrier, list_blob)
        return [ch.runner or "" for ch in carrier.children_present(the_list)]

    assert push_cli(b.root, registry.url, "m:1") == 0
    assert carrier_children() == ["mlx"]
    assert push_cli(c.root, registry.url, "m:1") == 0
    assert carrier_children() == ["llamacpp", "mlx"]  # mlx was already there: kept
    assert push_cli(a.root, registry.url, "m:1") == 0
    assert carrier_children() == ["llamacpp", "mlx"]


# -- errors: one line each -----------------------------------------------------------------------


def test_missing_blob_refused_before_any_request(
    demo: DemoStore, registry: Registry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = copy_store(demo, tmp_path / "store")
    mmproj = demo.manifest(f"{GEMMA}@llamacpp").layer("mmproj.gguf").digest
    (store / "blobs" / mmproj.blob_name).unlink()
    mark = len(registry.requests())
    assert push_cli(store, registry.url, LLAMA, GEMMA) == 1
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert "Traceback" not in err
    assert f"blob {mmproj} (projector of gemma4:26b@llamacpp) is missing" in line
    assert registry.requests()[mark:] == []  # not even llama3.2, named first


def test_short_blob_refused(
    demo: DemoStore, registry: Registry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = copy_store(demo, tmp_path / "store")
    model = demo.manifest(TINY).layer("model.gguf")
    with open(store / "blobs" / model.digest.blob_name, "r+b") as f:
        f.truncate(model.size - 1)
    assert push_cli(store, registry.url, TINY) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert f"{model.digest} (model of someuser/tiny:q8) has {model.size - 1} bytes" in line


@pytest.mark.parametrize("small", [8 << 20, 1024], ids=["whole", "parts"])
async def test_corrupt_blob_is_never_committed(
    demo: DemoStore, registry: Registry, tmp_path: Path, small: int
) -> None:
    store = copy_store(demo, tmp_path / "store")
    model = demo.manifest(TINY).layer("model.gguf")
    flip_byte(store / "blobs" / model.digest.blob_name, model.size // 2)
    with pytest.raises(CorruptBlobError, match=f"blob {model.digest} .* does not match its name"):
        await push(store, registry.url, [TINY], make_client(), small=small, part=100_000)
    assert head(f"{registry.url}/v2/someuser/tiny/blobs/{model.digest}") == 404
    assert head(f"{registry.url}/v2/someuser/tiny/manifests/q8") == 404
    # The upload session was cancelled, not left open.
    assert ("DELETE", "/v2/someuser/tiny/blobs/uploads/") in [
        (m, u.rsplit("/", 1)[0] + "/") for m, u in registry.requests()
    ]


def test_refused_connection(demo: DemoStore, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert push_cli(demo.root, url, LLAMA) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert f"{url}: cannot connect" in line


def test_not_a_registry(
    demo: DemoStore, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert push_cli(demo.root, f"{registry.url}/not/here", LLAMA) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "not an OCI registry (GET /v2/ answered 404)" in line


@pytest.mark.parametrize("url", ["127.0.0.1:5000", "ftp://x", "http://h/?a=1"])
def test_bad_url(demo: DemoStore, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert push_cli(demo.root, url, LLAMA) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "--to" in line


def test_unpushable_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("_private:1")
    assert push_cli(tiny.root, "http://127.0.0.1:9", "_private:1") == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "model '_private' is not a valid OCI repository component" in line


def test_unknown_model(demo: DemoStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert push_cli(demo.root, "http://127.0.0.1:9", "nothere:1") == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "'nothere:1' not found" in line


def test_token_auth(demo: DemoStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_registry(tmp_path / "reg", htpasswd=True) as reg:
        for token, what in (("not-the-token", "bearer"), (f"{HTPASSWD_USER}:wrong", "basic")):
            token_file = tmp_path / f"token-{what}"
            token_file.write_text(token + "\n")
            assert push_cli(demo.root, reg.url, LLAMA, "--token-file", str(token_file)) == 1
            [line] = error_lines(capsys.readouterr().err)
            assert f"GET {reg.url}/v2/: 401 (no or wrong token; see --token-file)" in line
        assert push_cli(demo.root, reg.url, LLAMA) == 1
        assert "401" in error_lines(capsys.readouterr().err)[0]

        good = tmp_path / "token-good"
        good.write_text(f"{HTPASSWD_USER}:{HTPASSWD_PASSWORD}\n")
        assert push_cli(demo.root, reg.url, LLAMA, "--token-file", str(good)) == 0
        r = httpx.get(
            f"{reg.url}/v2/library/llama3.2/manifests/3b",
            headers={"Accept": MEDIA_MANIFEST},
            auth=(HTPASSWD_USER, HTPASSWD_PASSWORD),
        )
        assert r.content == demo.manifest(LLAMA).raw


def lying_client(lie_about: str) -> httpx.AsyncClient:
    """A client whose transport forwards to the registry but rewrites Docker-Content-Digest on
    PUTs of `lie_about` ("manifests" or "blobs")."""
    inner = httpx.AsyncClient(timeout=10)
    wrong = "sha256:" + "0" * 64

    async def handler(request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in ("host", "content-length", "transfer-encoding")
        }
        r = await inner.request(request.method, request.url, headers=headers, content=body)
        out = httpx.Headers(r.headers)
        for name in ("content-length", "transfer-encoding", "content-encoding"):
            out.pop(name, None)
        if request.method == "PUT" and f"/{lie_about}/" in request.url.path:
            out["Docker-Content-Digest"] = wrong
        return httpx.Response(r.status_code, headers=out, content=r.content)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("lie_about", ["manifests", "blobs"])
async def test_registry_answering_another_digest(
    demo: DemoStore, registry: Registry, lie_about: str
) -> None:
    with pytest.raises(PeerLiedError) as info:
        await push(demo.root, registry.url, [TINY], lying_client(lie_about))
    message = str(info.value)
    assert "\n" not in message
    assert "sha256:" + "0" * 64 in message
    if lie_about == "manifests":
        assert f"the bytes we sent hash to {demo.manifest(TINY).digest}" in message
    else:
        assert "which is not what we sent" in message


def test_registry_answering_another_digest_cli(
    demo: DemoStore,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import modelfs.cli.push as cli_push

    @contextlib.asynccontextmanager
    async def lying_session(_credentials: object, **_: object) -> AsyncIterator[SimpleNamespace]:
        async with lying_client("manifests") as http:
            yield SimpleNamespace(http=http)

    monkeypatch.setattr(cli_push, "peer_session", lying_session)
    assert push_cli(demo.root, registry.url, TINY) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "answered Docker-Content-Digest sha256:000" in line


# -- the round trip (needs `modelfs pull`) ---------------------------------------------------------


def test_round_trip_through_docker_registry(
    demo: DemoStore, registry: Registry, tmp_path: Path
) -> None:
    assert push_cli(demo.root, registry.url, *NAMES) == 0
    dst = tmp_path / "pulled"
    dst.mkdir()
    rc = run(["pull", "--store", str(dst), *NAMES, "--from", registry.url, "--all-variants"])
    assert rc == 0
    src_index, dst_index = scan_store(demo.root), scan_store(dst)
    assert dst_index.problems == []
    for text in NAMES:
        name = parse_name(text)
        src, got = src_index.lookup(name), dst_index.lookup(name)
        assert got.name == src.name  # the spelling asked for is the spelling on disk
        assert got.top.raw == src.top.raw
        assert isinstance(got.top, ManifestList) == isinstance(src.top, ManifestList)
        if isinstance(src.top, ManifestList):
            assert got.source == "v2"
            assert got.path.is_symlink()
            assert got.path.resolve() == (dst / "blobs" / src.top.digest.blob_name).resolve()
        assert [v.manifest.raw for v in got.variants] == [v.manifest.raw for v in src.variants]
        for v in got.variants:
            for d in v.manifest.blob_digests():
                a = (demo.root / "blobs" / d.blob_name).read_bytes()
                assert (dst / "blobs" / d.blob_name).read_bytes() == a
