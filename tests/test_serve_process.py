"""`modelfs serve` as a real process: curl, skopeo, TLS, tokens, signals.

Each server listens on 127.0.0.1:0 and prints `listening on URL` once bound; the test reads
that line, talks to it, and stops it with SIGTERM, which must end it with status 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, DemoStore, build_demo_store
from modelfs.store.layout import Layout
from modelfs.sync.wire.realm import service_of

MODELFS = str(Path(sys.executable).with_name("modelfs"))
CURL = shutil.which("curl")
SKOPEO = shutil.which("skopeo")
OPENSSL = shutil.which("openssl")

needs_curl = pytest.mark.skipif(CURL is None, reason="needs curl")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line of stdout, or AssertionError with stderr if none comes in time."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"no URL from modelfs serve (exit {proc.poll()}): {err}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.2))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                continue
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"modelfs serve did not stop within {timeout} s") from None
    return proc.returncode


@contextmanager
def served(store: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    proc = subprocess.Popen(
        [MODELFS, "serve", "--store", str(store), "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = read_line(proc, 20)
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on "), proc
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                sys.stdout.write(stream.read().decode(errors="replace"))
                stream.close()


def curl(*args: str) -> subprocess.CompletedProcess[bytes]:
    assert CURL is not None
    return subprocess.run([CURL, "-sS", *args], capture_output=True, timeout=60, check=False)


def curl_status(*args: str) -> int:
    r = curl("-o", os.devnull, "-w", "%{http_code}", *args)
    return int(r.stdout.decode() or 0)


@needs_curl
def test_curl_fetches_a_blob_byte_exact(demo: DemoStore, tmp_path: Path) -> None:
    layer = demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf")
    out = tmp_path / "model.gguf"
    with served(demo.root) as (url, proc):
        assert url.startswith("http://127.0.0.1:")
        r = curl("-f", "-o", str(out), "-D", "-", f"{url}/v2/library/gemma4/blobs/{layer.digest}")
        assert r.returncode == 0, r.stderr
        assert hashlib.sha256(out.read_bytes()).hexdigest() == layer.digest.hex
        headers = r.stdout.decode().lower()
        assert f"docker-content-digest: {layer.digest}" in headers
        assert f"content-length: {layer.size}" in headers

        r = curl("-f", "-I", f"{url}/v2/library/gemma4/blobs/{layer.digest}")
        assert r.returncode == 0, r.stderr
        assert f"content-length: {layer.size}" in r.stdout.decode().lower()
        r = curl("-f", "-r", "100-199", f"{url}/v2/library/gemma4/blobs/{layer.digest}")
        assert r.stdout == demo.blob_path(layer.digest).read_bytes()[100:200]
        r = curl("-f", "-C", "1000", "-o", "-", f"{url}/v2/library/gemma4/blobs/{layer.digest}")
        assert r.stdout == demo.blob_path(layer.digest).read_bytes()[1000:]
        assert (
            curl_status("-r", f"{layer.size}-", f"{url}/v2/library/gemma4/blobs/{layer.digest}")
            == 416
        )

        r = curl("-f", f"{url}/v2/_catalog")
        assert "library/gemma4" in json.loads(r.stdout)["repositories"]
        status = json.loads(curl("-f", f"{url}/modelfs/v1/status").stdout)
        assert status["models"] == len(demo.tags)
        assert status["blobs_served"] >= 3
    err = proc.stderr
    assert err is not None


@needs_curl
def test_hostile_paths_over_the_wire(demo: DemoStore) -> None:
    with served(demo.root) as (url, _):
        for path in (
            "/v2/../../etc/passwd",
            "/v2/library/%2e%2e/%2e%2e/manifests/latest",
            "/v2/library%2fgemma4/manifests/26b",
            "/v2/library/gemma4/blobs/sha256:..%2f..%2f..%2fetc%2fpasswd",
            "/v2/library/gemma4/manifests/26b%00",
        ):
            status = curl_status("--path-as-is", f"{url}{path}")
            assert 400 <= status < 500, (path, status)


@pytest.mark.skipif(SKOPEO is None, reason="needs skopeo")
def test_skopeo_inspect_and_list_tags(demo: DemoStore) -> None:
    assert SKOPEO is not None
    llamacpp = demo.manifest(f"{GEMMA}@llamacpp")
    listed = demo.lists[GEMMA]
    with served(demo.root) as (url, _):
        hostport = url.removeprefix("http://")

        def skopeo(*args: str) -> bytes:
            r = subprocess.run(
                [SKOPEO, *args, "--tls-verify=false"],
                capture_output=True,
                timeout=60,
                check=False,
            )
            assert r.returncode == 0, r.stderr.decode()
            return r.stdout

        # skopeo does not take Ollama's list type, so the tag gives it the preferred child.
        raw = skopeo("inspect", "--raw", f"docker://{hostport}/library/gemma4:26b")
        assert raw == llamacpp.raw
        raw = skopeo("inspect", "--raw", f"docker://{hostport}/library/gemma4@{listed.digest}")
        assert raw == listed.raw
        smol = demo.manifest("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
        raw = skopeo(
            "inspect",
            "--raw",
            f"docker://{hostport}/hf.co/bartowski/smollm2-135m-instruct-gguf:Q4_K_M",
        )
        assert raw == smol.raw
        tags = json.loads(skopeo("list-tags", f"docker://{hostport}/library/gemma4"))
        assert tags["Tags"] == ["26b", "26b-mlx"]


@needs_curl
def test_token_file(demo: DemoStore, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  t0ken-abc\n")
    with served(demo.root, "--token-file", str(token_file)) as (url, _):
        assert curl_status(f"{url}/v2/") == 401
        r = curl("-D", "-", "-o", os.devnull, f"{url}/v2/")
        service = service_of(socket.gethostname())
        realm = f'www-authenticate: bearer realm="{url}/modelfs/v1/token",service="{service}"'
        assert realm in r.stdout.decode().lower()
        assert curl_status("-H", "Authorization: Bearer wrong", f"{url}/v2/") == 401
        assert curl_status("-H", "Authorization: Bearer t0ken-abc", f"{url}/v2/") == 200
        assert curl_status("-u", "me:t0ken-abc", f"{url}/v2/_catalog") == 200


@pytest.mark.parametrize(
    "content,message",
    [(b"", "is empty"), (b"  \n\t", "is empty"), (b"two words", "printable ASCII")],
)
def test_unusable_token_file(demo: DemoStore, tmp_path: Path, content: bytes, message: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    r = subprocess.run(
        [MODELFS, "serve", "--store", str(demo.root), "--token-file", str(token_file)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert r.returncode == 1
    lines = r.stderr.decode().splitlines()
    assert lines[-1].startswith("modelfs: error: ") and message in lines[-1]
    assert "Traceback" not in r.stderr.decode()
    assert r.stdout == b""


def test_startup_errors_are_one_line(demo: DemoStore, tmp_path: Path) -> None:
    busy = subprocess.Popen(
        [MODELFS, "serve", "--store", str(demo.root), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        port = read_line(busy, 20).rsplit(":", 1)[1]
        cases = [
            (["--token-file", str(tmp_path / "missing")], "cannot read token file"),
            (["--listen", "nonsense"], "invalid listen address"),
            (["--listen", "127.0.0.1:99999"], "invalid port"),
            (["--listen", f"127.0.0.1:{port}"], "cannot listen on"),
            (["--tls-cert", str(tmp_path / "cert.pem")], "go together"),
            (
                ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.key")],
                "no such file",
            ),
        ]
        for args, message in cases:
            r = subprocess.run(
                [MODELFS, "serve", "--store", str(demo.root), *args],
                capture_output=True,
                timeout=30,
                check=False,
            )
            err = r.stderr.decode()
            assert r.returncode == 1, (args, err)
            assert err.splitlines()[-1].startswith("modelfs: error: "), err
            assert message in err.splitlines()[-1], (args, err)
            assert "Traceback" not in err
    finally:
        stop(busy)
        for stream in (busy.stdout, busy.stderr):
            if stream is not None:
                stream.close()


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with openssl."""
    assert OPENSSL is not None
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [
            OPENSSL,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return cert, key


@pytest.mark.skipif(CURL is None or OPENSSL is None, reason="needs curl and openssl")
def test_tls(demo: DemoStore, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    layer = demo.manifest("qwen3:0.6b").layer("model.gguf")
    with served(demo.root, "--tls-cert", str(cert), "--tls-key", str(key)) as (url, _):
        assert url.startswith("https://127.0.0.1:")
        r = curl("-f", "--cacert", str(cert), f"{url}/v2/library/qwen3/blobs/{layer.digest}")
        assert r.returncode == 0, r.stderr
        assert hashlib.sha256(r.stdout).hexdigest() == layer.digest.hex
        # Without trusting the certificate, curl refuses; plain HTTP gets nothing useful.
        assert curl("-f", f"{url}/v2/").returncode != 0
        plain = url.replace("https://", "http://")
        assert curl("-f", "--max-time", "5", f"{plain}/v2/").returncode != 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_it_cleanly(demo: DemoStore, sig: int) -> None:
    proc = subprocess.Popen(
        [MODELFS, "serve", "--store", str(demo.root), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        read_line(proc, 20)
        started = time.monotonic()
        assert stop(proc, sig, timeout=10) == 0
        assert time.monotonic() - started < 10
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in err
        assert "store: " in err  # the root is logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@needs_curl
def test_sigterm_during_a_download(demo: DemoStore, tmp_path: Path) -> None:
    """A client in the middle of a blob does not keep the server alive past the grace."""
    layer = demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf")
    with served(demo.root) as (url, proc):
        assert CURL is not None
        slow = subprocess.Popen(
            [
                CURL,
                "-sS",
                "--limit-rate",
                "100K",
                "-o",
                os.devnull,
                f"{url}/v2/library/gemma4/blobs/{layer.digest}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1)
            started = time.monotonic()
            assert stop(proc, timeout=15) == 0
            assert time.monotonic() - started < 10
        finally:
            slow.kill()
            slow.wait()


def test_sigterm_with_a_client_that_stopped_reading(demo: DemoStore, tmp_path: Path) -> None:
    """A client that never reads pins a send inside hypercorn; the process still exits 0."""
    import socket

    big = tmp_path / "big"
    build_demo_store(big, weight_bytes=64 << 20)
    layer = Layout(big)
    from modelfs.store.scan import scan_store

    entry = scan_store(layer).lookup(GEMMA)
    model = next(
        x for v in entry.variants for x in v.manifest.layers if x.media_type.endswith(".model")
    )
    with served(big) as (url, proc):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((host, int(port)))
        stalled.sendall(
            f"GET /v2/library/gemma4/blobs/{model.digest} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        try:
            time.sleep(1)
            started = time.monotonic()
            assert stop(proc, timeout=15) == 0
            assert time.monotonic() - started < 10
        finally:
            stalled.close()


def test_listener_drops_stalled_clients() -> None:
    import socket

    from modelfs.sync.registry.serve import STALL_TIMEOUT_MS, bind

    sock = bind("127.0.0.1:0")
    try:
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            value = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
            assert value == STALL_TIMEOUT_MS
    finally:
        sock.close()
