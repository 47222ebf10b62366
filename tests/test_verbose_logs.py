"""Every server logs every request at `-v` without a logging error.

A log call whose arguments do not fit its format is not an exception the caller sees: the
logging module prints `--- Logging error ---` and a traceback to stderr for each record and
drops the line. So each kind of server here (`modelfs serve` with a token and keys, `serve
--mirror`, the `modelfs sync` daemon replicating from another) runs with `-v` as a real
process, takes a mix of good and bad requests, and its stderr must hold no logging error and a
request line for each request it answered.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from pathlib import Path

import httpx

from modelfs.demo import LLAMA, DemoStore
from modelfs.sync.wire.signin import peer_authorization
from tests.ollama import OllamaClient
from tests.test_daemon import complete, daemon, wait_until
from tests.test_ollama_serve import demo, keys_file, ollama, serving
from tests.test_pull_hosts import modelfs_serve

__all__ = ["demo", "ollama"]  # fixtures
TOKEN = "bG9nZ2luZy10b2tlbg=="
LOGGING_ERROR = "--- Logging error ---"


def request_mix(url: str, demo: DemoStore, *, token: str | None) -> list[tuple[str, str, int]]:
    """(method, path, status) of each request sent: the routes, credentials good and bad,
    ranges good and bad, methods a registry does not take."""
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    layer = demo.manifest(LLAMA).layer("model.gguf")
    blob = f"/v2/library/llama3.2/blobs/{layer.digest}"
    cases: list[tuple[str, str, dict[str, str]]] = [
        ("GET", "/v2/", {}),
        ("GET", "/v2/", {"Authorization": "Bearer wrong"}),
        ("GET", "/v2/", auth),
        ("GET", "/v2/_catalog?n=2", auth),
        ("GET", "/v2/library/llama3.2/tags/list", auth),
        ("GET", "/v2/library/llama3.2/manifests/3b", auth),
        ("HEAD", "/v2/library/llama3.2/manifests/3b", auth),
        ("GET", "/v2/library/nothing/manifests/here", auth),
        ("HEAD", blob, auth),
        ("GET", blob, {**auth, "Range": "bytes=0-99"}),
        ("GET", blob, {**auth, "Range": "bytes=0-1,5-9"}),
        ("GET", blob, {**auth, "Range": f"bytes={layer.size + 10}-"}),
        ("GET", "/v2/library/llama3.2/blobs/sha256:" + "0" * 64, auth),
        ("GET", "/v2/%2e%2e/etc/passwd", auth),
        ("POST", "/v2/library/llama3.2/blobs/uploads/", auth),
        ("GET", "/modelfs/v1/status", auth),
        ("GET", "/metrics", auth),
        ("GET", "/nowhere", auth),
    ]
    if token:
        cases += [
            ("GET", "/modelfs/v1/token", {"Authorization": "Basic " + _basic(token)}),
            ("GET", "/modelfs/v1/token?service=x&ts=1&nonce=n", {"Authorization": "AAAA:BBBB"}),
            ("GET", "/v2/_catalog?n=1", {"Authorization": _proof(token, "/v2/_catalog?n=1")}),
        ]
    sent = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for method, path, headers in cases:
            r = c.request(method, path, headers=headers)
            sent.append((method, path.partition("?")[0], r.status_code))
            if method == "HEAD" and "location" in r.headers and "/blobs/" in path:
                r = c.get(r.headers["location"], headers={"Range": "bytes=0-9"})
                sent.append(("GET", path, r.status_code))
    return sent


def _proof(token: str, target: str) -> str:
    return peer_authorization(token, "GET", target)


def _basic(token: str) -> str:
    return base64.b64encode(f"me:{token}".encode()).decode()


def assert_logged(log: str, sent: list[tuple[str, str, int]]) -> None:
    assert LOGGING_ERROR not in log, log[log.index(LOGGING_ERROR) :][:3000]
    assert "Traceback" not in log, log
    for method, path, status in sent:
        pattern = rf"{method} \S*{re.escape(path[:60])}\S* {status} \d+ bytes [\d.]+ s"
        assert re.search(pattern, log), (method, path, status, log[-4000:])


def test_serve_logs_each_request_at_v(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    keys = keys_file(tmp_path, ollama)
    args = ("-v", "--token-file", str(token), "--authorized-keys", str(keys))
    with serving(demo.root, tmp_path, *args) as server:
        sent = request_mix(server.url, demo, token=TOKEN)
        ollama.pull(f"{server.hostport}/library/llama3.2:3b", insecure=True)  # a sign-in
        time.sleep(0.2)
        assert_logged(server.log.read_text(), sent)
        assert server.lines("sign-in from 127.0.0.1")


def test_the_mirror_logs_each_request_at_v(demo: DemoStore, tmp_path: Path) -> None:
    store = tmp_path / "m"
    store.mkdir()
    with modelfs_serve(demo.root) as up, serving(store, tmp_path, "-v", "--mirror", up) as m:
        sent = request_mix(m.url, demo, token=None)
        # What the mirror fetched, it serves whole.
        layer = demo.manifest(LLAMA).layer("model.gguf")
        path = f"/v2/library/llama3.2/blobs/{layer.digest}"
        body = httpx.get(m.url + path, timeout=60).content
        assert hashlib.sha256(body).hexdigest() == layer.digest.hex
        sent.append(("GET", path, 200))
        time.sleep(0.2)
        assert_logged(m.log.read_text(), sent)


def test_the_daemon_logs_each_request_at_v(demo: DemoStore, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    store_b = tmp_path / "b"
    store_b.mkdir()
    with (
        daemon(tmp_path, "a", args=("-v",), store=str(demo.root), token_file=str(token)) as a,
        daemon(
            tmp_path,
            "b",
            args=("-v",),
            store=str(store_b),
            token_file=str(token),
            peers=[a.url],
            replicate=["llama3.2:3b"],
            interval="1s",
        ) as b,
    ):
        wait_until(lambda: complete(store_b, "llama3.2:3b"), what="the model at b")
        sent = request_mix(a.url, demo, token=TOKEN)
        time.sleep(0.2)
        assert_logged(a.text(), sent)
        assert LOGGING_ERROR not in b.text(), b.text()
        # b's own requests to a, proved with the token, query and all, were answered.
        assert re.search(r"GET /v2/_catalog\S* 200 \d+ bytes", a.text()), a.text()[-3000:]
