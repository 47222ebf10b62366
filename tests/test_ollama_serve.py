"""Ollama hosts pulling from `modelfs serve`: its downloader, its key sign-in, hf.co names.

The client is tests/ollama.py, a transcription of Ollama's pull (ollama/ollama fb30760
server/images.go, server/download.go, server/auth.go, auth/auth.go, x/transfer). Servers are
real `modelfs serve` processes on 127.0.0.1 over real stores; their stderr goes to a file, so
that a refusal's one log line can be read while the server runs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote_plus, urlsplit

import httpx
import pytest

from modelfs.demo import GEMMA, LLAMA, QWEN, SMOL, TINY, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.sync.registry.server import RegistryApp
from modelfs.sync.wire.realm import service_of
from tests.builders import TinyStore
from tests.ollama import EMPTY_BODY, MIN_PART, USER_AGENT, OllamaClient, OllamaError
from tests.test_cli import modelfs
from tests.test_daemon import daemon
from tests.test_serve_process import MODELFS, read_line, stop

SKOPEO = shutil.which("skopeo")
# The service a server started here hands out in its challenge, which a sign-in must name.
SERVICE = service_of(socket.gethostname())


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def hostport(self) -> str:
        return self.url.removeprefix("http://")

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if needle in line]


@contextmanager
def serving(store: Path, tmp_path: Path, *args: str) -> Iterator[Server]:
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [MODELFS, "serve", "--store", str(store), "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        line = read_line(proc, 20)
        assert line.startswith("listening on "), (line, log.read_text())
        yield Server(line.removeprefix("listening on "), proc, log)
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


# One client for the test's own requests: a new httpx client loads the CA bundle (~0.5 s).
http = httpx.Client(timeout=60, verify=False)


@pytest.fixture
def ollama(tmp_path: Path) -> Iterator[OllamaClient]:
    client = OllamaClient(tmp_path / "ollama-home")
    yield client
    client.close()


def keys_file(tmp_path: Path, *clients: OllamaClient) -> Path:
    path = tmp_path / "authorized_keys"
    path.write_text(
        "# Ollama hosts allowed to pull\n\n" + "".join(c.public_key + "\n" for c in clients)
    )
    return path


def assert_pulled(client: OllamaClient, server: Server, name: str, raw: bytes) -> None:
    """The manifest as Ollama writes it, every blob it names present with its digest."""
    host, rest = f"{server.hostport}/{name}".split("/", 1)
    ns, model_tag = rest.split("/", 1)
    model, _, tag = model_tag.partition(":")
    path = client.models / "manifests" / host / ns / model / tag
    assert path.read_bytes() == raw
    manifest = json.loads(raw)
    for layer in [*manifest["layers"], manifest["config"]]:
        blob = client.blob_path(layer["digest"])
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == layer["digest"].split(":")[1]
    assert not list((client.models / "blobs").glob("*partial*"))


# -- the downloader ----------------------------------------------------------------------------
def test_ollama_pulls_gguf_models_and_a_list_child(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Loopback only, no credentials: every blob GET names its own path as the Location."""
    with serving(demo.root, tmp_path) as server:
        for name, key in (
            ("library/llama3.2:3b", LLAMA),
            ("someuser/tiny:q8", TINY),
            # A list: Ollama's Accept names no list type, so it gets the child it can run.
            ("library/gemma4:26b", f"{GEMMA}@llamacpp"),
        ):
            ollama.pull(f"{server.hostport}/{name}", insecure=True)
            assert_pulled(ollama, server, name, demo.manifest(key).raw)
    firsts = [
        e
        for e in ollama.log
        if e.method == "GET" and "/blobs/" in e.url and "Range" not in e.headers
    ]
    assert firsts and all(urlsplit(e.url).path == e.location for e in firsts)
    parts = [e for e in ollama.log if "Range" in e.headers]
    assert parts and all(e.status == 206 and "Authorization" not in e.headers for e in parts)
    r = modelfs("verify", "--store", str(ollama.models))
    assert r.returncode == 0, r.stderr
    listed = modelfs("ls", "--store", str(ollama.models)).stdout
    assert f"{server.hostport}/library/llama3.2:3b" in listed


def test_ollama_pulls_a_safetensors_child(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Tensor layers go through x/transfer (images.go:1041-1047), which needs no Location."""
    with serving(demo.root, tmp_path, "--prefer", "mlx,llamacpp") as server:
        ollama.pull(f"{server.hostport}/library/gemma4:26b", insecure=True)
        assert_pulled(ollama, server, "library/gemma4:26b", demo.manifest(f"{GEMMA}@mlx").raw)
    assert not [e for e in ollama.log if "Range" in e.headers]


def test_parallel_parts_go_to_a_signed_url_without_authorization(
    tmp_path: Path, ollama: OllamaClient
) -> None:
    """A 101 MB blob: two parts as Ollama cuts them (download.go:158-177), each a Range GET
    to the signed Location with no Authorization; the blob's sha256 checks out."""
    store = TinyStore(tmp_path / "big")
    payload = hashlib.sha256(b"seed").digest() * (101_000_000 // 32)
    raw = store.gguf_model("library/big:latest", payload)
    digest = str(Digest.of_bytes(payload))
    with serving(store.root, tmp_path, "--authorized-keys", str(keys_file(tmp_path, ollama))) as s:
        ollama.pull(f"{s.hostport}/library/big", insecure=True)
        assert_pulled(ollama, s, "library/big:latest", raw)
    assert ollama.part_sizes[digest] == [MIN_PART, len(payload) - MIN_PART]
    parts = [e for e in ollama.log if "Range" in e.headers and digest in e.url]
    assert sorted(e.headers["Range"] for e in parts) == [
        f"bytes=0-{MIN_PART - 1}",
        f"bytes={MIN_PART}-{len(payload) - 1}",
    ]
    for e in parts:
        query = urlsplit(e.url).query
        assert "signature=" in query and "expires=" in query
        assert "Authorization" not in e.headers and e.status == 206


# -- the key sign-in ---------------------------------------------------------------------------
def test_ollama_signs_in_with_its_key(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Loopback must sign in too; the realm is on the host and port the client used."""
    keys = keys_file(tmp_path, ollama)
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as server:
        r = http.get(f"{server.url}/v2/library/llama3.2/manifests/3b")
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == (
            f'Bearer realm="{server.url}/modelfs/v1/token",service="{SERVICE}",'
            'scope="repository:library/llama3.2:pull"'
        )
        ollama.pull(f"{server.hostport}/library/llama3.2:3b", insecure=True)
        assert_pulled(ollama, server, "library/llama3.2:3b", demo.manifest(LLAMA).raw)
        # By another spelling of the host, the realm follows the Host header.
        port = server.hostport.rsplit(":", 1)[1]
        ollama.pull(f"localhost:{port}/someuser/tiny:q8", insecure=True)
        assert (ollama.models / "manifests" / f"localhost:{port}" / "someuser/tiny/q8").exists()
        ollama.pull(f"{server.hostport}/library/gemma4:26b", insecure=True)  # parts, signed
    statuses = [e.status for e in ollama.log if e.url.endswith("/manifests/3b")]
    assert statuses == [401, 200]
    tokens = [e for e in ollama.log if "/modelfs/v1/token" in e.url]
    assert len(tokens) == 3 and all(e.status == 200 for e in tokens)  # one per pull


def signed_request(
    client: OllamaClient, server: Server, *, ts: int | None = None
) -> tuple[str, str]:
    """The token URL and Authorization Ollama would send (auth.go:53-75)."""
    url = client.challenge_url(
        f"{server.url}/modelfs/v1/token", SERVICE, "repository:x/y:pull", ts=ts
    )
    return url, client.sign(f"GET,{url},{EMPTY_BODY}".encode())


def test_each_refusal_is_a_401_and_one_log_line(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    stranger = OllamaClient(tmp_path / "stranger")
    keys = keys_file(tmp_path, ollama)
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as server:
        cases: list[tuple[str, str, dict[str, str]]] = []
        url, auth = signed_request(stranger, server)
        cases.append(("key not in the file", url, {"Authorization": auth}))
        url, auth = signed_request(ollama, server)
        key = auth.split(":")[0]
        bad = base64.b64encode(bytes(64)).decode()
        cases.append(("bad signature", url, {"Authorization": f"{key}:{bad}"}))
        url, auth = signed_request(ollama, server, ts=int(time.time()) - 3600)
        cases.append(("stale timestamp", url, {"Authorization": auth}))
        url, auth = signed_request(ollama, server)
        r = http.get(url, headers={"Authorization": auth})
        assert r.status_code == 200 and r.json()["token"]
        cases.append(("replayed nonce", url, {"Authorization": auth}))

        # Signed blob URLs: take a real one, then alter its path, expiry or signature.
        token = r.json()["token"]
        layer = demo.manifest(LLAMA).layer("model.gguf")
        blob = f"{server.url}/v2/library/llama3.2/blobs/{layer.digest}"
        r = http.get(blob, headers={"Authorization": f"Bearer {token}", "Range": "bytes=0-0"})
        assert r.status_code == 206
        signed = r.headers["location"]
        assert http.get(server.url + signed, headers={"Range": "bytes=0-9"}).status_code == 206
        other = str(demo.manifest(QWEN).layer("model.gguf").digest)
        path, query = signed.split("?")
        expires = int(query.split("expires=")[1].split("&")[0])
        for why, altered in (
            ("altered path", path.replace(str(layer.digest), other) + "?" + query),
            ("altered expiry", signed.replace(f"expires={expires}", f"expires={expires + 1}")),
            ("altered signature", signed[:-2] + ("AA" if not signed.endswith("AA") else "BB")),
        ):
            cases.append((why, server.url + altered, {}))

        for why, url, headers in cases:
            before = len(server.lines("refused"))
            r = http.get(url, headers=headers)
            assert r.status_code == 401, (why, r.text)
            assert r.json()["errors"][0]["code"] == "UNAUTHORIZED"
            assert len(server.lines("refused")) == before + 1, (why, server.log.read_text())
        # A stranger's pull stops at the sign-in, with the server's reason.
        with pytest.raises(OllamaError, match=r"401: .*is not authorized"):
            stranger.pull(f"{server.hostport}/library/llama3.2:3b", insecure=True)
    stranger.close()


async def test_expired_signed_url_and_token(demo: DemoStore) -> None:
    """In process, with lifetimes already over: an expired signed URL is a 401 and one log
    line; an expired token gets a fresh 401 challenge (Ollama signs in again)."""
    app = RegistryApp(Layout(demo.root), token="t0ken")
    app.access.url_ttl = -10
    app.access.token_ttl = -10
    transport = httpx.ASGITransport(app, client=("127.0.0.1", 40000))
    layer = demo.manifest(LLAMA).layer("model.gguf")
    async with httpx.AsyncClient(transport=transport, base_url="http://modelfs") as c:
        r = await c.get("/modelfs/v1/token", auth=("me", "t0ken"))
        assert r.status_code == 200
        expired_token = r.json()["token"]
        r = await c.get("/v2/", headers={"Authorization": f"Bearer {expired_token}"})
        assert r.status_code == 401 and "realm=" in r.headers["www-authenticate"]
        r = await c.head(
            f"/v2/library/llama3.2/blobs/{layer.digest}", headers={"Authorization": "Bearer t0ken"}
        )
        assert r.status_code == 200
        with_logs = _capture("modelfs.sync.registry.auth")
        r = await c.get(r.headers["location"], headers={"Range": "bytes=0-9"})
        assert r.status_code == 401
        assert [m for m in with_logs.messages if "refused: it expired" in m]


class _capture:
    """The records one logger emits from now on."""

    def __init__(self, name: str) -> None:
        import logging

        self.messages: list[str] = []
        outer = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.messages.append(record.getMessage())

        logger = logging.getLogger(name)
        logger.addHandler(Handler())
        logger.setLevel(logging.INFO)


def test_keys_file_is_read_again_when_it_changes(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    keys = keys_file(tmp_path)  # comments only: nobody
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as server:
        name = f"{server.hostport}/library/qwen3:0.6b"
        with pytest.raises(OllamaError, match="401"):
            ollama.pull(name, insecure=True)
        keys_file(tmp_path, ollama)
        ollama.pull(name, insecure=True)
        token = next(
            e
            for e in reversed(ollama.log)
            if "Authorization" in e.headers and e.headers["Authorization"].startswith("Bearer")
        )
        bearer = token.headers["Authorization"]
        assert http.get(f"{server.url}/v2/", headers={"Authorization": bearer}).status_code == 200
        # Removed from the file: its token stops working and it cannot sign in again.
        keys.write_text("# revoked\n")
        assert http.get(f"{server.url}/v2/", headers={"Authorization": bearer}).status_code == 401
        with pytest.raises(OllamaError, match="401"):
            ollama.pull(f"{server.hostport}/someuser/tiny:q8", insecure=True)


def test_token_file_and_keys_together(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """modelfs peers keep their static token; Ollama hosts sign in; nobody else, loopback or
    not, gets in."""
    token = tmp_path / "token"
    token.write_text("peer-s3cret\n")
    keys = keys_file(tmp_path, ollama)
    args = ("--token-file", str(token), "--authorized-keys", str(keys))
    with serving(demo.root, tmp_path, *args) as server:
        assert http.get(f"{server.url}/v2/_catalog").status_code == 401
        out = tmp_path / "pulled"
        r = modelfs(
            "pull", LLAMA, "--from", server.url, "--store", str(out), "--token-file", str(token)
        )
        assert r.returncode == 0, r.stderr
        assert "llama3.2:3b" in modelfs("ls", "--store", str(out)).stdout
        ollama.pull(f"{server.hostport}/library/llama3.2:3b", insecure=True)
        assert_pulled(ollama, server, "library/llama3.2:3b", demo.manifest(LLAMA).raw)
        # Docker's token flow: the static token at the realm gets a token.
        r = http.get(f"{server.url}/modelfs/v1/token", auth=("me", "peer-s3cret"))
        assert r.status_code == 200
        issued = r.json()["token"]
        assert (
            http.get(f"{server.url}/v2/", headers={"Authorization": f"Bearer {issued}"}).status_code
            == 200
        )
        status = http.get(
            f"{server.url}/modelfs/v1/status", headers={"Authorization": f"Bearer {issued}"}
        ).json()
        assert status["auth"] == "token+keys"


@pytest.mark.skipif(SKOPEO is None, reason="needs skopeo")
def test_skopeo_with_creds_follows_the_realm(demo: DemoStore, tmp_path: Path) -> None:
    """skopeo answers the 401 challenge at the realm with its --creds (Docker's token flow)."""
    assert SKOPEO is not None
    token = tmp_path / "token"
    token.write_text("peer-s3cret\n")
    with serving(demo.root, tmp_path, "--token-file", str(token)) as server:
        r = subprocess.run(
            [
                SKOPEO,
                "inspect",
                "--raw",
                "--tls-verify=false",
                "--creds",
                "me:peer-s3cret",
                f"docker://{server.hostport}/library/llama3.2:3b",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout == demo.manifest(LLAMA).raw


def test_unreadable_keys_file_is_one_line(demo: DemoStore, tmp_path: Path) -> None:
    r = modelfs("serve", "--store", str(demo.root), "--authorized-keys", str(tmp_path / "nope"))
    assert r.returncode == 1
    last_error(r.stderr, "cannot read authorized keys file")


# -- hf.co models ------------------------------------------------------------------------------
def test_ollama_reaches_other_hosts_models_by_ns_and_model(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Ollama can only ask for `/v2/<ns>/<model>` (images.go:1273); a name the default host
    does not hold is the one other host's model of that ns/model:tag. Other clients name
    the host, so they get a 404 there as before."""
    smol = demo.manifest(SMOL)
    with serving(demo.root, tmp_path) as server:
        ollama.pull(f"{server.hostport}/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M", insecure=True)
        assert_pulled(ollama, server, "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M", smol.raw)
        path = "/v2/bartowski/SmolLM2-135M-Instruct-GGUF/manifests/Q4_K_M"
        assert http.get(server.url + path).status_code == 404


def test_default_host_first_and_two_other_hosts_are_a_404(tmp_path: Path) -> None:
    store = TinyStore(tmp_path / "models")
    store.gguf_model("hf.co/someone/m:q4", b"from hf")
    store.gguf_model("registry.ollama.ai/someone/m:q4", b"from ollama.com")
    store.gguf_model("hf.co/two/m:q4", b"hf")
    store.gguf_model("example.com/two/m:q4", b"example")
    agent = {
        "User-Agent": USER_AGENT,
        "Accept": "application/vnd.docker.distribution.manifest.v2+json",
    }
    with serving(store.root, tmp_path) as server:
        r = http.get(f"{server.url}/v2/someone/m/manifests/q4", headers=agent)
        layers = r.json()["layers"]
        assert layers[0]["digest"] == str(Digest.of_bytes(b"from ollama.com"))
        r = http.get(f"{server.url}/v2/two/m/manifests/q4", headers=agent)
        assert r.status_code == 404
        assert "hf.co" in r.text and "example.com" in r.text


def last_error(err: str, *needles: str) -> None:
    """The last stderr line is the one `modelfs: error: …` (an info line may come first)."""
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("modelfs: error: ") and all(n in last for n in needles), err


def test_sync_config_takes_authorized_keys(tmp_path: Path) -> None:
    from modelfs.sync.daemon.config import load_config

    config = tmp_path / "sync.toml"
    config.write_text('authorized_keys = "~/keys"\n')
    assert load_config(config).authorized_keys == Path("~/keys").expanduser()
    config.write_text("authorized_keys = 3\n")
    r = modelfs("sync", "--config", str(config), "--store", str(tmp_path / "s"))
    assert r.returncode == 1
    last_error(r.stderr, "authorized_keys")
    config.write_text(f'authorized_keys = "{tmp_path / "missing"}"\n')
    r = modelfs("sync", "--config", str(config), "--store", str(tmp_path / "s"))
    assert r.returncode == 1
    last_error(r.stderr, "authorized_keys", "cannot read")


def test_sync_daemon_lets_an_ollama_host_sign_in(tmp_path: Path, ollama: OllamaClient) -> None:
    """`modelfs sync` with `authorized_keys` in its config serves Ollama the same way."""
    store = TinyStore(tmp_path / "models")
    raw = store.gguf_model("library/small:latest", b"small weights")
    keys = keys_file(tmp_path, ollama)
    with daemon(tmp_path, "host", store=str(store.root), authorized_keys=str(keys)) as d:
        hostport = d.url.removeprefix("http://")
        assert http.get(f"{d.url}/v2/").status_code == 401
        ollama.pull(f"{hostport}/library/small", insecure=True)
    path = ollama.models / "manifests" / hostport / "library/small/latest"
    assert path.read_bytes() == raw


def test_the_signed_bytes_are_ollamas(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """The URL and body hash spelled out as Go writes them (auth.go:49,64-65: url.Values
    sorted, QueryEscape; base64 of the hex sha256 of no body), not through the emulator."""
    assert EMPTY_BODY == (
        "ZTNiMGM0NDI5OGZjMWMxNDlhZmJmNGM4OTk2ZmI5MjQyN2FlNDFlNDY0OWI5MzRjYTQ5NTk5MWI3ODUyYjg1NQ=="
    )
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys_file(tmp_path, ollama))) as s:
        url = (
            f"{s.url}/modelfs/v1/token?nonce=q83vEjRWeJA&"
            "scope=repository%3Alibrary%2Fllama3.2%3Apull&"
            f"service={quote_plus(SERVICE)}&ts={int(time.time())}"
        )
        assert (
            ollama.challenge_url(
                f"{s.url}/modelfs/v1/token", SERVICE, "repository:library/llama3.2:pull"
            )
            .split("&scope=")[1]
            .startswith("repository%3Alibrary%2Fllama3.2%3Apull&service=")
        )
        auth = ollama.sign(f"GET,{url},{EMPTY_BODY}".encode())
        r = http.get(url, headers={"Authorization": auth})
        assert r.status_code == 200, r.text
        token = r.json()["token"]
        assert (
            http.get(f"{s.url}/v2/", headers={"Authorization": f"Bearer {token}"}).status_code
            == 200
        )
