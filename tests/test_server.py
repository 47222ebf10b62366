"""The OCI distribution server, in process.

Most tests talk to `RegistryApp` through `httpx.ASGITransport` under trio. URLs that httpx
would normalise (`..`, `%2e%2e`, encoded slashes) go straight to the ASGI callable with a
hand-made scope, as a server hands them over, via `call()`.
"""

from __future__ import annotations

import base64
import builtins
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import trio
import trio.lowlevel
import zstandard

import modelfs.sync.registry.blobs as blobs
import modelfs.sync.registry.server as server
from modelfs.demo import GEMMA, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.errors import (
    CorruptBlobError,
    InvalidDigestError,
    InvalidNameError,
    ManifestError,
    MissingBlobError,
    ModelNotFoundError,
    StoreError,
)
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST
from modelfs.sync.registry.http import HTTPError, error_status, parse_range, split_path
from modelfs.sync.registry.server import RegistryApp
from modelfs.sync.wire.realm import service_of
from tests.builders import TinyStore

LIST_ACCEPT = {"Accept": f"{MEDIA_LIST}, {MEDIA_MANIFEST}"}
OLD_ACCEPT = {"Accept": MEDIA_MANIFEST}
LOOPBACK = ("127.0.0.1", 40000)


# -- harness ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


@pytest.fixture
def tiny(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


def app_for(root: Path, **kw: Any) -> RegistryApp:
    kw.setdefault("token", None)
    return RegistryApp(Layout(root), **kw)


@asynccontextmanager
async def client_for(
    app: RegistryApp, client: tuple[str, int] = LOOPBACK, **kw: Any
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://modelfs", **kw) as c:
        yield c


async def call(
    app: RegistryApp,
    raw_path: bytes,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    query: bytes = b"",
    client: tuple[str, int] | None = LOOPBACK,
) -> tuple[int, dict[str, str], bytes]:
    """One request straight into the ASGI app, the path exactly as given."""
    messages: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()],
        "client": client,
        "server": ("127.0.0.1", 11500),
    }
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = messages[0]
    assert start["type"] == "http.response.start"
    body = b"".join(m.get("body", b"") for m in messages[1:])
    assert not messages[-1].get("more_body", False)
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def error_code(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/json"
    errors = response.json()["errors"]
    assert len(errors) == 1 and errors[0]["message"]
    return errors[0]["code"]


def blob_url(repo: str, digest: Digest) -> str:
    return f"/v2/{repo}/blobs/{digest}"


# -- base, errors ----------------------------------------------------------------------------
async def test_base_endpoint(tiny: TinyStore) -> None:
    async with client_for(app_for(tiny.root)) as c:
        for path in ("/v2/", "/v2"):
            r = await c.get(path)
            assert r.status_code == 200
            assert r.json() == {}
            assert r.headers["docker-distribution-api-version"] == "registry/2.0"
            assert r.headers["content-type"] == "application/json"


async def test_unknown_routes_are_oci_404s(tiny: TinyStore) -> None:
    async with client_for(app_for(tiny.root)) as c:
        for path in ("/", "/v1/", "/v2/library/x/nothing/here", "/modelfs/v1/nope", "/v2/x"):
            r = await c.get(path)
            assert r.status_code == 404, path
            assert error_code(r) == "NOT_FOUND"
            assert r.headers["docker-distribution-api-version"] == "registry/2.0"


def test_error_status_is_one_mapping() -> None:
    cases = [
        (InvalidNameError("x"), 400, "NAME_INVALID"),
        (InvalidDigestError("x"), 400, "DIGEST_INVALID"),
        (ModelNotFoundError("x"), 404, "MANIFEST_UNKNOWN"),
        (ManifestError("x"), 404, "MANIFEST_UNKNOWN"),
        (MissingBlobError("x"), 404, "BLOB_UNKNOWN"),
        (CorruptBlobError("x"), 404, "BLOB_UNKNOWN"),
        (StoreError("x"), 500, "UNKNOWN"),
        (PermissionError(13, "Permission denied"), 500, "UNKNOWN"),
        (RuntimeError("secret detail"), 500, "UNKNOWN"),
        (HTTPError(416, "RANGE_INVALID", "x"), 416, "RANGE_INVALID"),
    ]
    for exc, status, code in cases:
        err = error_status(exc)
        assert (err.status, err.code) == (status, code), exc
    assert "secret" not in error_status(RuntimeError("secret detail")).message


async def test_head_errors_have_headers_but_no_body(tiny: TinyStore) -> None:
    async with client_for(app_for(tiny.root)) as c:
        r = await c.head("/v2/library/nothing/manifests/latest")
        assert r.status_code == 404
        assert r.content == b""
        assert int(r.headers["content-length"]) > 0


async def test_lifespan_is_answered(tiny: TinyStore) -> None:
    app = app_for(tiny.root)
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    outbox: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        outbox.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert [m["type"] for m in outbox] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]


# -- manifests -------------------------------------------------------------------------------
async def test_manifest_by_tag_plain(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("llama3.2:3b")
    digest = Digest.of_bytes(raw)
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/llama3.2/manifests/3b", headers=OLD_ACCEPT)
        assert r.status_code == 200
        assert r.content == raw
        assert r.headers["content-type"] == MEDIA_MANIFEST
        assert r.headers["docker-content-digest"] == str(digest)
        assert r.headers["content-length"] == str(len(raw))
        assert r.headers["etag"] == f'"{digest}"'
        # A plain manifest is served whatever the client says it takes.
        r = await c.get("/v2/library/llama3.2/manifests/3b", headers=LIST_ACCEPT)
        assert r.content == raw

        h = await c.head("/v2/library/llama3.2/manifests/3b")
        assert h.status_code == 200
        assert h.content == b""
        for key in ("content-type", "docker-content-digest", "content-length", "etag"):
            assert h.headers[key] == r.headers[key]


async def test_manifest_tags_are_case_insensitive(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("llama3.2:3b")
    async with client_for(app_for(tiny.root)) as c:
        for path in (
            "/v2/library/LLAMA3.2/manifests/3B",
            "/v2/Library/llama3.2/manifests/3b",
            "/v2/registry.ollama.ai/library/llama3.2/manifests/3b",
        ):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.content == raw
        # `ollama.com` is a host of its own, as in Ollama's names.
        r = await c.get("/v2/ollama.com/library/llama3.2/manifests/3b")
        assert r.status_code == 404


async def test_manifest_other_host_and_namespace(demo: DemoStore) -> None:
    async with client_for(app_for(demo.root)) as c:
        smol = demo.manifest("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
        r = await c.get("/v2/hf.co/bartowski/smollm2-135m-instruct-gguf/manifests/Q4_K_M")
        assert r.status_code == 200
        assert r.content == smol.raw
        r = await c.get("/v2/someuser/tiny/manifests/q8")
        assert r.content == demo.manifest("someuser/tiny:q8").raw
        # Without a host, hf.co/bartowski/... would be ns "hf.co": not a valid namespace.
        r = await c.get("/v2/bartowski/smollm2-135m-instruct-gguf/manifests/Q4_K_M")
        assert r.status_code == 404
        assert error_code(r) == "MANIFEST_UNKNOWN"


async def test_manifest_list_by_accept(demo: DemoStore) -> None:
    listed = demo.lists[GEMMA]
    llamacpp = demo.manifest(f"{GEMMA}@llamacpp")
    mlx = demo.manifest(f"{GEMMA}@mlx")
    async with client_for(app_for(demo.root)) as c:
        url = "/v2/library/gemma4/manifests/26b"
        r = await c.get(url, headers=LIST_ACCEPT)
        assert r.status_code == 200
        assert r.content == listed.raw
        assert r.headers["content-type"] == MEDIA_LIST
        assert r.headers["docker-content-digest"] == str(listed.digest)
        assert r.headers["vary"] == "Accept"

        # Old clients, and clients that take anything, get the runnable preferred child.
        for headers in (OLD_ACCEPT, {}, {"Accept": "*/*"}, {"Accept": f"{MEDIA_LIST};q=0"}):
            r = await c.get(url, headers=headers)
            assert r.content == llamacpp.raw, headers
            assert r.headers["content-type"] == MEDIA_MANIFEST
            assert r.headers["docker-content-digest"] == str(llamacpp.digest)
        # The list type split over two Accept lines, with parameters, still counts.
        r = await c.get(
            url, headers=[("Accept", MEDIA_MANIFEST), ("Accept", f"{MEDIA_LIST}; q=0.5")]
        )
        assert r.content == listed.raw

    async with client_for(app_for(demo.root, prefer=("mlx", "llamacpp"))) as c:
        r = await c.get("/v2/library/gemma4/manifests/26b", headers=OLD_ACCEPT)
        assert r.content == mlx.raw


async def test_manifest_by_digest(demo: DemoStore) -> None:
    listed = demo.lists[GEMMA]
    async with client_for(app_for(demo.root)) as c:
        for key in (f"{GEMMA}@llamacpp", f"{GEMMA}@mlx", "qwen3:0.6b"):
            m = demo.manifest(key)
            r = await c.get(f"/v2/library/gemma4/manifests/{m.digest}", headers=OLD_ACCEPT)
            assert r.status_code == 200, key
            assert r.content == m.raw
            assert r.headers["docker-content-digest"] == str(m.digest)
            assert "vary" not in r.headers
        # By digest, the list is served whatever Accept says: the client named those bytes.
        r = await c.get(f"/v2/library/gemma4/manifests/{listed.digest}", headers=OLD_ACCEPT)
        assert r.content == listed.raw
        assert r.headers["content-type"] == MEDIA_LIST
        # Uppercase hex names the same bytes.
        r = await c.get(f"/v2/library/gemma4/manifests/sha256:{listed.digest.hex.upper()}")
        assert r.content == listed.raw

        unknown = Digest("0" * 64)
        r = await c.get(f"/v2/library/gemma4/manifests/{unknown}")
        assert r.status_code == 404
        assert error_code(r) == "MANIFEST_UNKNOWN"
        # A config blob is a blob, not a manifest.
        config = demo.manifest("qwen3:0.6b").config.digest
        r = await c.get(f"/v2/library/qwen3/manifests/{config}")
        assert r.status_code == 404
        r = await c.get("/v2/library/gemma4/manifests/sha256:abc")
        assert r.status_code == 400
        assert error_code(r) == "DIGEST_INVALID"


async def test_manifest_held_only_as_a_blob_is_served_by_digest(tiny: TinyStore) -> None:
    raw = tiny.manifest([tiny.layer("model", b"w")])
    digest = tiny.blob(raw)  # no tag names it
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(f"/v2/library/x/manifests/{digest}")
        assert r.status_code == 200
        assert r.content == raw
        assert r.headers["docker-content-digest"] == str(digest)
    # A blob whose bytes no longer match its name is not a manifest anyone asked for.
    tiny.layout.blob(digest).write_bytes(raw + b" ")
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(f"/v2/library/x/manifests/{digest}")
        assert r.status_code == 404


async def test_manifest_list_without_local_children(tiny: TinyStore) -> None:
    child = tiny.manifest([tiny.layer("model", b"w")])
    raw = tiny.manifest_list([(child, "llamacpp", "gguf")])
    tiny.layout.blob(Digest.of_bytes(child)).unlink()  # only the list is here
    tiny.v2("gemma4:26b", raw)
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/gemma4/manifests/26b", headers=LIST_ACCEPT)
        assert r.content == raw
        r = await c.get("/v2/library/gemma4/manifests/26b", headers=OLD_ACCEPT)
        assert r.status_code == 404
        assert error_code(r) == "MANIFEST_UNKNOWN"
        assert MEDIA_LIST in r.json()["errors"][0]["message"]


async def test_a_tag_that_looks_like_a_digest_is_a_tag(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("x:sha256-" + "a" * 64)
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/x/manifests/sha256-" + "a" * 64)
        assert r.status_code == 200
        assert r.content == raw


async def test_a_media_type_that_cannot_be_a_header(tiny: TinyStore) -> None:
    raw = tiny.manifest([tiny.layer("model", b"w")], mediaType="text/x\r\nX-Evil: 1")
    tiny.legacy("x:evil", raw)
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/x/manifests/evil")
        assert r.status_code == 200
        assert r.content == raw
        assert r.headers["content-type"] == "application/json"
        assert "x-evil" not in r.headers


async def test_manifest_unknown_and_invalid(tiny: TinyStore) -> None:
    tiny.gguf_model("llama3.2:3b")
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/llama3.2/manifests/7b")
        assert r.status_code == 404
        assert error_code(r) == "MANIFEST_UNKNOWN"
        r = await c.get("/v2/library/llama3.2/manifests/-bad")
        assert r.status_code == 400
        assert error_code(r) == "NAME_INVALID"
        r = await c.get("/v2/a/b/c/d/manifests/latest")
        assert r.status_code == 400
        assert error_code(r) == "NAME_INVALID"


async def test_conditional_get(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("llama3.2:3b")
    etag = f'"{Digest.of_bytes(raw)}"'
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/llama3.2/manifests/3b", headers={"If-None-Match": etag})
        assert r.status_code == 304
        assert r.content == b""
        assert r.headers["etag"] == etag
        r = await c.get("/v2/library/llama3.2/manifests/3b", headers={"If-None-Match": '"x"'})
        assert r.status_code == 200


# -- blobs -----------------------------------------------------------------------------------
async def test_blob_get_and_head(demo: DemoStore) -> None:
    layer = demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf")
    data = demo.blob_path(layer.digest).read_bytes()
    async with client_for(app_for(demo.root)) as c:
        r = await c.get(blob_url("library/gemma4", layer.digest))
        assert r.status_code == 200
        assert r.content == data
        assert r.headers["docker-content-digest"] == str(layer.digest)
        assert r.headers["content-length"] == str(len(data))
        assert r.headers["accept-ranges"] == "bytes"
        assert r.headers["content-type"] == "application/octet-stream"
        assert r.headers["etag"] == f'"{layer.digest}"'
        h = await c.head(blob_url("library/gemma4", layer.digest))
        assert h.status_code == 200
        assert h.content == b""
        assert h.headers["content-length"] == str(len(data))
        assert h.headers["docker-content-digest"] == str(layer.digest)


async def test_blob_streams_in_chunks(demo: DemoStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs, "CHUNK", 64 << 10)
    layer = demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf")
    data = demo.blob_path(layer.digest).read_bytes()
    for headers, expected in (({}, data), ({"Range": "bytes=100000-900000"}, data[100000:900001])):
        status, _, body = await call(
            app_for(demo.root), f"/v2/library/gemma4/blobs/{layer.digest}".encode(), headers=headers
        )
        assert status in (200, 206)
        assert body == expected


def _range_cases(n: int) -> list[tuple[str, int, tuple[int, int] | None]]:
    """(Range header, status, (first, last) inclusive or None for all) for a blob of n bytes."""
    return [
        ("bytes=0-9", 206, (0, 9)),
        ("bytes=10-", 206, (10, n - 1)),
        ("bytes=-5", 206, (n - 5, n - 1)),
        ("bytes=0-", 206, (0, n - 1)),
        ("bytes=5-99999999", 206, (5, n - 1)),
        ("bytes=-99999999", 206, (0, n - 1)),
        (f"bytes={n - 1}-{n - 1}", 206, (n - 1, n - 1)),
        ("BYTES = 3 - 4", 206, (3, 4)),
        (f"bytes={n}-", 416, None),
        (f"bytes={n}-{n + 10}", 416, None),
        ("bytes=-0", 416, None),
        ("bytes=9-3", 416, None),
        ("bytes=abc", 416, None),
        ("bytes=-", 416, None),
        ("bytes=1-2-3", 416, None),
        ("bytes=+1-2", 416, None),
        ("bytes=0x10-", 416, None),
        ("bytes=99999999999999999999999-", 416, None),
        ("bytes=", 416, None),
        # Several ranges, or another unit: ignored, the whole blob (RFC 9110 §14.2).
        ("bytes=0-1,5-6", 200, None),
        ("items=0-1", 200, None),
        ("garbage", 200, None),
    ]


async def test_blob_ranges(tiny: TinyStore) -> None:
    data = bytes(range(256)) * 40
    digest = tiny.blob(data)
    n = len(data)
    async with client_for(app_for(tiny.root)) as c:
        url = blob_url("library/x", digest)
        for header, status, span in _range_cases(n):
            r = await c.get(url, headers={"Range": header})
            assert r.status_code == status, header
            if status == 206:
                assert span is not None
                first, last = span
                assert r.content == data[first : last + 1], header
                assert r.headers["content-range"] == f"bytes {first}-{last}/{n}"
                assert r.headers["content-length"] == str(last - first + 1)
                assert r.headers["docker-content-digest"] == str(digest)
                h = await c.head(url, headers={"Range": header})
                assert h.status_code == 206 and h.content == b""
                assert h.headers["content-range"] == r.headers["content-range"]
            elif status == 416:
                assert r.headers["content-range"] == f"bytes */{n}", header
                assert error_code(r) == "RANGE_INVALID"
            else:
                assert r.content == data
                assert "content-range" not in r.headers


async def test_blob_if_range(tiny: TinyStore) -> None:
    data = b"0123456789" * 10
    digest = tiny.blob(data)
    async with client_for(app_for(tiny.root)) as c:
        url = blob_url("library/x", digest)
        r = await c.get(url, headers={"Range": "bytes=5-", "If-Range": f'"{digest}"'})
        assert r.status_code == 206 and r.content == data[5:]
        r = await c.get(url, headers={"Range": "bytes=5-", "If-Range": '"sha256:other"'})
        assert r.status_code == 200 and r.content == data
        r = await c.get(url, headers={"If-None-Match": f'"{digest}"'})
        assert r.status_code == 304 and r.content == b""


async def test_empty_blob(tiny: TinyStore) -> None:
    digest = tiny.blob(b"")
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(blob_url("library/x", digest))
        assert r.status_code == 200
        assert r.content == b""
        assert r.headers["content-length"] == "0"
        r = await c.get(blob_url("library/x", digest), headers={"Range": "bytes=0-"})
        assert r.status_code == 416
        assert r.headers["content-range"] == "bytes */0"


def test_parse_range_is_pure() -> None:
    assert parse_range("bytes=0-0", 1) == (0, 0)
    assert parse_range("bytes=-1", 1) == (0, 0)
    assert parse_range("bytes=0-1,2-3", 10) is None
    with pytest.raises(HTTPError) as info:
        parse_range("bytes=1-", 1)
    assert info.value.status == 416


async def test_blob_missing_and_invalid(tiny: TinyStore) -> None:
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(blob_url("library/x", Digest("1" * 64)))
        assert r.status_code == 404
        assert error_code(r) == "BLOB_UNKNOWN"
        for bad in ("sha256:123", "sha512:" + "0" * 128, "1" * 64, "sha256:" + "g" * 64):
            r = await c.get(f"/v2/library/x/blobs/{bad}")
            assert r.status_code == 400, bad
            assert error_code(r) == "DIGEST_INVALID"


async def test_blob_symlink_is_never_followed(tiny: TinyStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0\n")
    digest = Digest.of_bytes(secret.read_bytes())
    os.symlink(secret, tiny.layout.blob(digest))
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(blob_url("library/x", digest))
        assert r.status_code == 404
        assert b"root:x" not in r.content
        r = await c.get(f"/v2/library/x/manifests/{digest}")
        assert r.status_code == 404


async def test_blob_that_is_a_directory(tiny: TinyStore) -> None:
    digest = Digest("2" * 64)
    tiny.layout.blob(digest).mkdir()
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get(blob_url("library/x", digest))
        assert r.status_code == 404


async def test_blob_of_wrong_size_or_quarantined_is_not_served(tiny: TinyStore) -> None:
    tiny.gguf_model("llama3.2:3b", payload=b"weights " * 100)
    index_app = app_for(tiny.root)
    view = await index_app.view()
    entry = view.index.lookup("llama3.2:3b")
    model = entry.variants[0].manifest.layers[0]
    template = entry.variants[0].manifest.layers[1]
    license_ = entry.variants[0].manifest.layers[2]
    path = tiny.layout.blob(model.digest)
    path.write_bytes(path.read_bytes()[:-1])  # truncated behind our back
    tiny.layout.quarantine.mkdir(parents=True)
    # The quarantined file itself, still linked in blobs/ (a quarantine cut short).
    os.link(tiny.layout.blob(template.digest), tiny.layout.quarantine / template.digest.blob_name)
    # An older, bad copy in quarantine; blobs/ has a good one since (a repair): served.
    (tiny.layout.quarantine / license_.digest.blob_name).write_bytes(b"")
    async with client_for(app_for(tiny.root)) as c:
        for digest in (model.digest, template.digest):
            r = await c.get(blob_url("library/llama3.2", digest))
            assert r.status_code == 404
            assert error_code(r) == "BLOB_UNKNOWN"
            r = await c.head(blob_url("library/llama3.2", digest))
            assert r.status_code == 404
        r = await c.get(blob_url("library/llama3.2", license_.digest))
        assert r.status_code == 200
        assert r.content == b"MIT"


async def test_blob_of_any_repo_is_served(demo: DemoStore) -> None:
    """Blobs are content-addressed: any valid repository name reaches any present blob."""
    layer = demo.manifest("qwen3:0.6b").layer("model.gguf")
    async with client_for(app_for(demo.root)) as c:
        r = await c.head(blob_url("someone/else", layer.digest))
        assert r.status_code == 200
        r = await c.head(f"/v2/bad..name!/x/blobs/{layer.digest}")
        assert r.status_code == 400


async def test_client_that_hangs_up_stops_the_stream(
    tiny: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs, "CHUNK", 4096)
    data = os.urandom(4096 * 200)
    digest = tiny.blob(data)
    app = app_for(tiny.root)
    gone = trio.Event()
    chunks = 0
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body":
            chunks += 1
            if chunks == 3:
                gone.set()
            await trio.lowlevel.checkpoint()

    scope = {
        "type": "http",
        "method": "GET",
        "raw_path": f"/v2/library/x/blobs/{digest}".encode(),
        "path": f"/v2/library/x/blobs/{digest}",
        "query_string": b"",
        "headers": [],
        "client": LOOPBACK,
    }
    with trio.fail_after(5):
        await app(scope, receive, send)
    assert 3 <= chunks < 20


# -- zstd ------------------------------------------------------------------------------------
async def test_zstd_for_text_layers_only(demo: DemoStore) -> None:
    app = app_for(demo.root)
    mlx = demo.manifest(f"{GEMMA}@mlx")
    tokenizer = mlx.layer("tokenizer.json")
    data = demo.blob_path(tokenizer.digest).read_bytes()
    url = f"/v2/library/gemma4/blobs/{tokenizer.digest}".encode()
    zstd = {"Accept-Encoding": "gzip, zstd"}

    status, headers, body = await call(app, url, headers=zstd)
    assert status == 200
    assert headers["content-encoding"] == "zstd"
    assert headers["vary"] == "Accept-Encoding"
    assert headers["docker-content-digest"] == str(tokenizer.digest)
    assert int(headers["content-length"]) == len(body) < len(data)
    assert headers["etag"] != f'"{tokenizer.digest}"'
    assert zstandard.ZstdDecompressor().decompress(body, max_output_size=len(data)) == data
    # Again, from the cache; and a client holding it revalidates with its ETag.
    assert (await call(app, url, headers=zstd))[2] == body
    status, _, _ = await call(app, url, headers={**zstd, "If-None-Match": headers["etag"]})
    assert status == 304
    _, identity, _ = await call(app, url)
    assert identity["vary"] == "Accept-Encoding"

    # Not asked for, refused with q=0, a range, or a HEAD: the identity bytes.
    for method, extra in (
        ("GET", {}),
        ("GET", {"Accept-Encoding": "zstd;q=0"}),
        ("GET", {**zstd, "Range": "bytes=0-"}),
        ("HEAD", zstd),
    ):
        status, headers, body = await call(app, url, method=method, headers=extra)
        assert "content-encoding" not in headers, (method, extra)
        assert headers["content-length"] == str(len(data))

    # Never for weights, or for a layer too small to gain.
    for digest in (
        demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf").digest,
        demo.manifest(f"{GEMMA}@llamacpp").layer("params.json").digest,
    ):
        _, headers, _ = await call(app, f"/v2/library/gemma4/blobs/{digest}".encode(), headers=zstd)
        assert "content-encoding" not in headers

    # httpx decodes it transparently.
    async with client_for(app, headers=zstd) as c:
        r = await c.get(url.decode())
        assert r.headers["content-encoding"] == "zstd"
        assert r.content == data

    # Off by configuration.
    _, headers, _ = await call(app_for(demo.root, zstd=False), url, headers=zstd)
    assert "content-encoding" not in headers


async def test_zstd_for_a_list_manifest_blob(demo: DemoStore) -> None:
    listed = demo.lists[GEMMA]
    url = f"/v2/library/gemma4/blobs/{listed.digest}".encode()
    _, headers, body = await call(app_for(demo.root), url, headers={"Accept-Encoding": "zstd"})
    if len(listed.raw) >= blobs.ZSTD_MIN:
        assert headers["content-encoding"] == "zstd"
        assert zstandard.ZstdDecompressor().decompress(body) == listed.raw
    else:
        assert body == listed.raw


# -- catalog and tags ------------------------------------------------------------------------
async def test_catalog_and_pagination(demo: DemoStore) -> None:
    expected = [
        "hf.co/bartowski/smollm2-135m-instruct-gguf",
        "library/gemma4",
        "library/llama3.2",
        "library/qwen3",
        "someuser/tiny",
    ]
    async with client_for(app_for(demo.root)) as c:
        r = await c.get("/v2/_catalog")
        assert r.status_code == 200
        assert r.json() == {"repositories": expected}
        assert "link" not in r.headers

        seen: list[str] = []
        url = "/v2/_catalog?n=2"
        pages = 0
        while url:
            r = await c.get(url)
            page = r.json()["repositories"]
            assert len(page) <= 2
            seen += page
            pages += 1
            link = r.headers.get("link")
            url = link[1 : link.index(">")] if link else ""
            if link:
                assert link.endswith('; rel="next"')
        assert seen == expected
        assert pages == 3

        r = await c.get("/v2/_catalog", params={"last": "library/llama3.2"})
        assert r.json()["repositories"] == expected[3:]
        r = await c.get("/v2/_catalog", params={"last": "zzz"})
        assert r.json()["repositories"] == []
        r = await c.get("/v2/_catalog?n=0")
        assert r.json()["repositories"] == []
        for bad in ("-1", "abc", "1e3", ""):
            r = await c.get("/v2/_catalog", params={"n": bad})
            assert r.status_code == 400, bad
            assert error_code(r) == "PAGINATION_NUMBER_INVALID"


async def test_tags_list_and_pagination(tiny: TinyStore) -> None:
    for tag in ("3b", "1b", "latest", "8B-Q4"):
        tiny.gguf_model(f"llama3.2:{tag}", payload=tag.encode())
    async with client_for(app_for(tiny.root)) as c:
        r = await c.get("/v2/library/llama3.2/tags/list")
        assert r.status_code == 200
        tags = ["1b", "3b", "8B-Q4", "latest"]
        assert r.json() == {
            "name": "library/llama3.2",
            "tags": tags,
            "modelfs.names": [f"llama3.2:{t}" for t in tags],
        }
        r = await c.get("/v2/library/LLAMA3.2/tags/list?n=1&last=3b")
        assert r.json()["tags"] == ["8B-Q4"]
        assert r.headers["link"] == '</v2/library/LLAMA3.2/tags/list?last=8B-Q4&n=1>; rel="next"'
        r = await c.get("/v2/library/llama3.2/tags/list?n=5&last=8b-q4")
        assert r.json()["tags"] == ["latest"]
        assert "link" not in r.headers

        r = await c.get("/v2/library/nothing/tags/list")
        assert r.status_code == 404
        assert error_code(r) == "NAME_UNKNOWN"
        r = await c.get("/v2/libr@ry/x/tags/list")
        assert r.status_code == 400
        assert error_code(r) == "NAME_INVALID"


async def test_catalog_names_are_oci_names_tags_list_agrees(demo: DemoStore) -> None:
    """Every repository `_catalog` lists is a valid OCI name (lowercase; skopeo and docker
    refuse others), `tags/list` of it answers with that same name, and a manifest is found by
    the lowercase name and by the store's spelling."""
    from modelfs.sync.wire.registry_names import COMPONENT

    async with client_for(app_for(demo.root)) as c:
        repos = (await c.get("/v2/_catalog")).json()["repositories"]
        assert "hf.co/bartowski/smollm2-135m-instruct-gguf" in repos
        for repo in repos:
            assert all(COMPONENT.fullmatch(part) for part in repo.split("/")), repo
            r = await c.get(f"/v2/{repo}/tags/list")
            assert r.status_code == 200, repo
            assert r.json()["name"] == repo
            for tag in r.json()["tags"]:
                got = await c.get(f"/v2/{repo}/manifests/{tag}")
                assert got.status_code == 200, (repo, tag)
        mixed = "/v2/hf.co/bartowski/SmolLM2-135M-Instruct-GGUF"
        r = await c.get(f"{mixed}/tags/list")
        lower = "hf.co/bartowski/smollm2-135m-instruct-gguf"
        # The store's spelling for modelfs peers, so a replica keeps it; OCI clients skip it.
        assert r.json() == {
            "name": lower,
            "tags": ["Q4_K_M"],
            "modelfs.names": ["hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"],
        }
        assert (await c.get(f"{mixed}/manifests/Q4_K_M")).status_code == 200


# -- live ------------------------------------------------------------------------------------
async def test_a_rebuild_logs_its_counts_in_words(
    tiny: TinyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """`1 model`, `2 blobs`, `0 problems`: counted in words like every other line, never `(s)`."""
    tiny.gguf_model("qwen3:0.6b")
    with caplog.at_level(logging.INFO, logger="modelfs.sync.registry.server"):
        view = await app_for(tiny.root).view()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("store ")]
    assert len(view.index.blob_names) > 1
    assert f": 1 model, {len(view.index.blob_names)} blobs, 0 problems (" in line, line


async def test_new_model_shows_without_restart(tiny: TinyStore) -> None:
    app = app_for(tiny.root)  # the default: look at most once a second
    async with client_for(app) as c:
        r = await c.get("/v2/library/qwen3/manifests/0.6b")
        assert r.status_code == 404
        raw = tiny.gguf_model("qwen3:0.6b")
        await trio.sleep(server.REFRESH_INTERVAL + 0.1)
        r = await c.get("/v2/library/qwen3/manifests/0.6b")
        assert r.status_code == 200
        assert r.content == raw
        assert (await c.get("/v2/_catalog")).json()["repositories"] == ["library/qwen3"]

        # Removed (`ollama rm`): gone as quickly.
        tiny.layout.legacy_manifest(tiny_name("qwen3:0.6b")).unlink()
        await trio.sleep(server.REFRESH_INTERVAL + 0.1)
        r = await c.get("/v2/library/qwen3/manifests/0.6b")
        assert r.status_code == 404


async def test_store_is_not_rescanned_on_every_request(
    tiny: TinyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny.gguf_model("qwen3:0.6b")
    app = app_for(tiny.root)
    looks = 0
    real = server.store_signature

    def counting(layout: Layout) -> tuple[object, ...]:
        nonlocal looks
        looks += 1
        return real(layout)

    monkeypatch.setattr(server, "store_signature", counting)
    async with client_for(app) as c:
        for _ in range(20):
            assert (await c.get("/v2/library/qwen3/manifests/0.6b")).status_code == 200
    assert looks == 1


def tiny_name(text: str) -> Any:
    from modelfs.store.names import parse_name

    return parse_name(text)


# -- hostile URLs ----------------------------------------------------------------------------
HOSTILE = [
    b"/v2/../../etc/passwd",
    b"/v2/library/../../../etc/passwd/manifests/latest",
    b"/v2/library/%2e%2e/manifests/latest",
    b"/v2/%2e%2e/%2e%2e/manifests/latest",
    b"/v2/library%2fgemma4/manifests/26b",
    b"/v2/library/gemma4%2F..%2F..%2Fetc/manifests/passwd",
    b"/v2/library/gemma4/manifests/..%2f..%2f..%2fetc%2fpasswd",
    b"/v2/library/gemma4/manifests/%2e%2e",
    b"/v2/library/gemma4/manifests/26b%00",
    b"/v2/library/gemma4/manifests/26b%00.txt",
    b"/v2/library/gemma4/blobs/sha256:../../../../etc/passwd",
    b"/v2/library/gemma4/blobs/sha256%3a..%2f..%2fetc%2fpasswd",
    b"/v2/library/gemma4/blobs/..%2fsecret",
    b"/v2/library/gemma4/blobs/sha256-" + b"a" * 64 + b"/../../secret",
    b"/v2/library/gemma4/blobs/sha256:" + b"a" * 64 + b"%00",
    b"/v2/library/gemma4/blobs/%2Fetc%2Fpasswd",
    b"/v2/library\\gemma4/manifests/26b",
    b"/v2/library/gemma4%5c..%5csecret/manifests/26b",
    b"/v2/.hidden/gemma4/manifests/latest",
    b"/v2/%c0%ae%c0%ae/%c0%ae%c0%ae/manifests/latest",
    b"/v2/library/gemma4/manifests/" + b"a" * 5000,
    b"/v2/" + b"h" * 400 + b"/ns/model/manifests/latest",
    b"/v2//etc/passwd/manifests/latest",
    b"/v2/library/gemma4/tags/list/../../../secret",
    b"/v2/library/gemma4/manifests/26b%0d%0aX-Injected:%201",
    b"/modelfs/v1/../../secret",
]


async def test_hostile_urls_never_leave_the_store(
    demo: DemoStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "secret").write_bytes(b"the secret bytes")
    root = str(demo.root.resolve())
    touched: list[str] = []

    def spy(real: Any) -> Any:
        def wrapper(path: Any, *args: Any, **kw: Any) -> Any:
            if isinstance(path, str | bytes | os.PathLike):
                touched.append(os.fsdecode(os.path.abspath(os.fsdecode(path))))
            return real(path, *args, **kw)

        return wrapper

    app = app_for(demo.root)
    await app.view()  # the scan happens before the spies go in
    for module, attr in ((os, "open"), (os, "stat"), (os, "lstat"), (builtins, "open")):
        monkeypatch.setattr(module, attr, spy(getattr(module, attr)))
    monkeypatch.setattr(os.path, "lexists", spy(os.path.lexists))

    for raw_path in HOSTILE:
        for method in ("GET", "HEAD"):
            status, headers, body = await call(app, raw_path, method=method)
            assert 400 <= status < 500, (raw_path, status)
            assert b"the secret bytes" not in body
            assert all("\n" not in v and "\r" not in v for v in headers.values())
            if method == "GET":
                assert "errors" in json.loads(body)
    outside = [p for p in touched if not p.startswith(root + os.sep)]
    assert outside == []
    # The spies do see what a request opens.
    digest = demo.manifest("qwen3:0.6b").layer("model.gguf").digest
    status, _, _ = await call(app, f"/v2/library/qwen3/blobs/{digest}".encode(), method="HEAD")
    assert status == 200
    assert str(demo.blob_path(digest)) in touched


def test_split_path() -> None:
    assert split_path(b"/v2/library/x/manifests/latest") == [
        "v2",
        "library",
        "x",
        "manifests",
        "latest",
    ]
    assert split_path(b"/v2/") == ["v2", ""]
    assert split_path(b"/v2/hf.co/a/b/blobs/sha256%3Aab") == [
        "v2",
        "hf.co",
        "a",
        "b",
        "blobs",
        "sha256:ab",
    ]
    for bad in (b"v2", b"/v2//x", b"/v2/%2e", b"/a%2fb", b"/%ff", b"/a%00"):
        with pytest.raises(HTTPError):
            split_path(bad)


# -- access ----------------------------------------------------------------------------------
TOKEN = "s3cr3t-t0ken"


async def test_token_is_required(tiny: TinyStore) -> None:
    tiny.gguf_model("qwen3:0.6b")
    app = app_for(tiny.root, token=TOKEN)
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    async with client_for(app) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": f"Bearer {TOKEN[:-1]}"},
            {"Authorization": "Bearer " + "A" * 10_000},
            {"Authorization": TOKEN},
            {"Authorization": f"Token {TOKEN}"},
            {"Authorization": "Bearer"},
            {"Authorization": "Basic !!!"},
            {"Authorization": "Basic " + base64.b64encode(TOKEN.encode()).decode()},
        ):
            for path in (
                "/v2/",
                "/v2/library/qwen3/manifests/0.6b",
                "/v2/_catalog",
                "/modelfs/v1/status",
                "/metrics",
            ):
                r = await c.get(path, headers=headers)
                assert r.status_code == 401, (headers, path)
                # An absolute realm on the request's own host, which Ollama requires.
                assert r.headers["www-authenticate"].startswith(
                    'Bearer realm="http://modelfs/modelfs/v1/token",'
                    f'service="{service_of(socket.gethostname())}"'
                )
                assert error_code(r) == "UNAUTHORIZED"
        for headers in (
            {"Authorization": f"Bearer {TOKEN}"},
            {"Authorization": f"bearer  {TOKEN} "},
            {"Authorization": f"Basic {basic}"},
        ):
            r = await c.get("/v2/library/qwen3/manifests/0.6b", headers=headers)
            assert r.status_code == 200, headers
    # With a token, any address is served.
    async with client_for(app, client=("203.0.113.9", 5555)) as c:
        r = await c.get("/v2/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


@pytest.mark.parametrize(
    "address,allowed",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.1.2.3", False),
        ("192.168.1.20", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1", False),
        ("localhost", False),  # an ASGI server gives addresses, never names
        ("", False),
    ],
)
async def test_without_token_only_loopback(tiny: TinyStore, address: str, allowed: bool) -> None:
    app = app_for(tiny.root)
    status, _, body = await call(app, b"/v2/", client=(address, 1234))
    assert status == (200 if allowed else 403)
    if not allowed:
        assert json.loads(body)["errors"][0]["code"] == "DENIED"


async def test_without_token_and_no_client_address(tiny: TinyStore) -> None:
    status, _, _ = await call(app_for(tiny.root), b"/v2/", client=None)
    assert status == 403


async def test_read_only(tiny: TinyStore) -> None:
    raw = tiny.gguf_model("qwen3:0.6b")
    async with client_for(app_for(tiny.root)) as c:
        for method in ("PUT", "POST", "PATCH", "DELETE", "OPTIONS", "BREW"):
            r = await c.request(method, "/v2/library/qwen3/manifests/0.6b", content=b"{}")
            assert r.status_code == 405, method
            assert error_code(r) == "UNSUPPORTED"
            assert r.headers["allow"] == "GET, HEAD"
        r = await c.post("/v2/library/qwen3/blobs/uploads/")
        assert r.status_code == 405
    assert tiny.layout.legacy_manifest(tiny_name("qwen3:0.6b")).read_bytes() == raw
    # Without the token, the answer is 401 whatever the method.
    async with client_for(app_for(tiny.root, token=TOKEN)) as c:
        r = await c.delete("/v2/library/qwen3/manifests/0.6b")
        assert r.status_code == 401


# -- status and metrics ----------------------------------------------------------------------
async def test_status_and_metrics(demo: DemoStore) -> None:
    app = app_for(demo.root, host_id="gpu-01")
    layer = demo.manifest("qwen3:0.6b").layer("model.gguf")
    async with client_for(app) as c:
        r = await c.get(blob_url("library/qwen3", layer.digest))
        assert r.status_code == 200
        await c.get(blob_url("library/qwen3", layer.digest), headers={"Range": "bytes=0-9"})
        await c.get("/v2/library/qwen3/manifests/0.6b")
        await c.get("/v2/library/qwen3/manifests/nope")

        r = await c.get("/modelfs/v1/status")
        assert r.status_code == 200
        status = r.json()
        assert status["host_id"] == "gpu-01"
        assert status["store"] == str(demo.root.absolute())
        assert status["models"] == len(demo.tags)
        assert status["blobs"] == len(demo.blobs)
        assert status["requests"] == 4
        assert status["bytes_served"] >= layer.size + 10
        assert status["blobs_served"] == 2
        assert status["manifests_served"] == 1
        assert status["uptime_seconds"] >= 0
        assert status["auth"] == "loopback"

        r = await c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = {}
        for line in r.text.splitlines():
            if line.startswith("#"):
                assert line.split()[1] in ("HELP", "TYPE")
                continue
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
        # blob, manifest, status
        assert samples['modelfs_http_requests_total{method="GET",code="200"}'] == 3
        assert samples['modelfs_http_requests_total{method="GET",code="206"}'] == 1
        assert samples['modelfs_http_requests_total{method="GET",code="404"}'] == 1
        assert samples["modelfs_blobs_served_total"] == 2
        assert samples["modelfs_bytes_served_total"] >= layer.size + 10
        assert samples["modelfs_models"] == len(demo.tags)
        assert samples["modelfs_blobs"] == len(demo.blobs)
        assert "modelfs_uptime_seconds" in samples


def test_repository_names_as_push_writes_them() -> None:
    from modelfs.store.names import parse_name
    from modelfs.sync.wire.protocol import name_from_repository
    from modelfs.sync.wire.registry_names import repository_for

    name = parse_name("localhost:5000/me/m:1")
    assert name_from_repository(repository_for(name), "1").key == name.key
    assert name_from_repository("localhost:5000/me/m", "1").key == name.key
