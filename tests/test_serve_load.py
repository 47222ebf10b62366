"""`modelfs serve` under hostile load, as a real process on loopback.

While each attack runs, a normal client polls `GET /v2/` on a fresh connection every 50 ms and
every answer must come within 1 s; the server's resident memory (VmRSS, sampled as it polls)
must stay within 100 MB of its start, and once the attack is over its open fds must come back
to what they were before it. Every attack is bounded in count and in time.

Client attacks: 500 idle connections and 100 slowloris connections that send a request head a
byte a second, both cut by the head timeout (sync.serve `HEADER_TIMEOUT`); request bodies
trickled or sent at once to endpoints that take none; request heads of 20 KiB and 1 MiB; a
`Range` of 1,000 ranges. A download read slowly for longer than any of those limits is not cut.
Mirror attacks (`modelfs serve --mirror`): an upstream process (tests/hostile_upstream.py)
whose answers loop on redirects, never end, are gzip bombs or have the wrong bytes; the client
gets an error, the mirror keeps none of it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, DemoStore, build_demo_store
from modelfs.sync.registry.serve import HEADER_TIMEOUT
from tests.hostile_upstream import BAD, digest_of, manifest_of
from tests.test_mirror import NO_PROXY
from tests.test_pull_hosts import server
from tests.test_serve_process import MODELFS, read_line, stop

CURL = shutil.which("curl")
LATENCY = 1.0  # the contract: a normal client's answer within this, throughout
MEMORY = 100 << 20  # resident memory above the start, at most
SETTLE = 10.0  # seconds the fds may take to come back after an attack

pytestmark = pytest.mark.slow


# -- the server's process, watched -----------------------------------------------------------
def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Watch:
    """A normal client polling `GET /v2/`, and the server's memory, until stopped."""

    port: int
    pid: int
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v2/")
                answer = conn.getresponse()
                answer.read()
                conn.close()
                if answer.status != 200:
                    self.failures.append(f"status {answer.status}")
            except OSError as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()


@contextmanager
def watched(port: int, pid: int, what: str, fd_slack: int = 0) -> Iterator[Watch]:
    """Watch the server while the body runs; then check latency, memory and fds (at most
    `fd_slack` more than before)."""
    base_fds, base_rss = fds(pid), rss(pid)
    watch = Watch(port, pid, peak=base_rss)
    poller = threading.Thread(target=watch.run, daemon=True)
    poller.start()
    try:
        yield watch
    finally:
        watch.stop()
        poller.join(10)
    lat = sorted(watch.latencies)
    print(
        f"{what}: /v2/ answered {len(lat)} times, median {statistics.median(lat) * 1e3:.0f} ms, "
        f"max {lat[-1] * 1e3:.0f} ms; RSS {base_rss >> 20} MiB at the start, peak "
        f"{watch.peak >> 20} MiB"
    )
    assert not watch.failures, watch.failures[:5]
    assert lat, f"{what}: /v2/ was never asked"
    assert lat[-1] < LATENCY, f"{what}: /v2/ took {lat[-1]:.2f} s"
    assert watch.peak - base_rss < MEMORY, f"{what}: {watch.peak >> 20} MiB from {base_rss >> 20}"
    deadline = time.monotonic() + SETTLE
    while fds(pid) > base_fds + fd_slack:
        assert time.monotonic() < deadline, f"{what}: {fds(pid)} fds, {base_fds} before it"
        time.sleep(0.1)


@contextmanager
def serving(store: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`modelfs serve --store STORE ARGS` on 127.0.0.1:0, its log read as it comes: under
    attack it logs a line a refused request, and a full pipe would stall it. Stopped with
    SIGTERM after (exit 0), and its log must hold no traceback: bad input is one line."""
    store.mkdir(parents=True, exist_ok=True)
    argv = [MODELFS, "serve", "--store", str(store), "--listen", "127.0.0.1:0", *args]
    env = {**os.environ, **NO_PROXY}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    log: list[bytes] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        line = read_line(proc, 30)
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ").strip(), proc
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    text = b"".join(log).decode(errors="replace")
    assert "Traceback" not in text, text[-3000:]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- raw sockets ------------------------------------------------------------------------------
def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(None)  # blocking: MSG_DONTWAIT then returns at once (see closed_by_server)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """The server answered and hung up, or hung up (EOF or reset): nothing more will come."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        while chunk := sock.recv(1 << 16, socket.MSG_DONTWAIT):
            del chunk
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def send_all(sock: socket.socket, data: bytes, limit: float) -> int:
    """As much of `data` as the server takes within `limit` seconds (it may hang up early)."""
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + limit
    try:
        while sent < len(data) and time.monotonic() < deadline:
            if select.select([], [sock], [], 0.1)[1]:
                sent += sock.send(data[sent : sent + (1 << 16)])
    except OSError:
        pass
    sock.setblocking(True)
    return sent


def answer_of(sock: socket.socket, limit: float) -> bytes:
    """What the server sends until it hangs up (at most `limit` seconds): its answer."""
    sock.settimeout(limit)
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except OSError:
        pass
    return got


def trickle(socks: list[socket.socket], head: bytes, seconds: float) -> list[float | None]:
    """Send each socket `head` a byte a second, for at most `seconds`; when each was closed by
    the server, counted from the start (None: still open at the end)."""
    started = time.monotonic()
    closed: list[float | None] = [None] * len(socks)
    i = 0
    while time.monotonic() - started < seconds and None in closed:
        for n, sock in enumerate(socks):
            if closed[n] is not None:
                continue
            if closed_by_server(sock):
                closed[n] = time.monotonic() - started
                continue
            try:
                sock.send(head[i : i + 1] or b"a")
            except OSError:
                closed[n] = time.monotonic() - started
        i += 1
        time.sleep(1)
    return closed


# -- the client attacks -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    # A 24 MiB model file: a download of it, read slowly, lasts seconds.
    return build_demo_store(tmp_path_factory.mktemp("load") / "models", weight_bytes=24 << 20)


def test_idle_and_slowloris_connections_are_cut_at_the_head_timeout(demo: DemoStore) -> None:
    """500 connections that send nothing and 100 that send a request head a byte a second are
    all closed by the server within the head timeout (and a margin for a loaded machine); none
    slows a normal client, and their fds are given back. Each of the 600 connects, made at once,
    is accepted within 1 s too (any of them could be a normal client's): with a backlog of 100
    some SYNs were dropped, and their clients waited a second for the retry."""
    with serving(demo.root) as (url, proc):
        port = port_of(url)
        with watched(port, proc.pid, "500 idle + 100 slowloris heads"):
            waits: list[float] = []

            def timed_connect() -> socket.socket:
                started = time.monotonic()
                sock = connect(port)
                waits.append(time.monotonic() - started)
                return sock

            idle = [timed_connect() for _ in range(500)]
            slow = [timed_connect() for _ in range(100)]
            assert max(waits) < LATENCY, f"a connect waited {max(waits):.2f} s"
            head = b"GET /v2/ HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"s" * 100
            try:
                closed = trickle(slow, head, HEADER_TIMEOUT + 5)
                assert all(t is not None and t < HEADER_TIMEOUT + 4 for t in closed), closed
                deadline = time.monotonic() + 5
                open_idle = list(idle)
                while open_idle and time.monotonic() < deadline:
                    open_idle = [s for s in open_idle if not closed_by_server(s)]
                    time.sleep(0.1)
                assert not open_idle, f"{len(open_idle)} idle connections still open"
            finally:
                for s in idle + slow:
                    s.close()


def test_bodies_and_heads_no_endpoint_takes(demo: DemoStore) -> None:
    """Request bodies: trickled a byte a second after a `Content-Length: 1000000` (a POST of an
    upload, a GET with a body), or 4 MiB of one sent at once: no endpoint reads a body, so the
    answer comes (405, 200) and the connection is closed at once. Request heads of 20 KiB and
    1 MiB: answered (the larger with 431) or cut, never held. No connection outlives it."""
    with serving(demo.root) as (url, proc):
        port = port_of(url)
        with watched(port, proc.pid, "request bodies and large heads"):
            trickled = []
            for i in range(50):
                sock = connect(port)
                target = "POST /v2/library/x/blobs/uploads/" if i % 2 else "GET /v2/"
                sock.sendall(
                    f"{target} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n".encode()
                )
                trickled.append(sock)
            closed = trickle(trickled, b"", 5)
            assert all(t is not None and t < 3 for t in closed), closed
            for sock in trickled:
                sock.close()

            # Sent at once, to an answer the server makes slowly enough for the body to fill
            # hypercorn's queue first (the catalog: a view of the store).
            for _ in range(10):
                with connect(port) as sock:
                    head = (
                        b"GET /v2/_catalog HTTP/1.1\r\nHost: x\r\nContent-Length: 8000000\r\n\r\n"
                    )
                    send_all(sock, head + b"a" * (4 << 20), 3)
                    answer = answer_of(sock, 5)
                    assert answer.startswith(b"HTTP/1.1 200 "), answer[:80]

            for size, want in ((20 << 10, (b"200", b"431")), (1 << 20, (b"431",))):
                for _ in range(20):
                    with connect(port) as sock:
                        head = (
                            b"GET /v2/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                            + b"a" * size
                            + b"\r\n\r\n"
                        )
                        send_all(sock, head, 3)
                        answer = answer_of(sock, 5)
                        # A server that hangs up while we still send may reset the answer away.
                        assert answer == b"" or answer[9:12] in want, (size, answer[:80])


def test_a_thousand_ranges_get_the_whole_blob_at_once(demo: DemoStore) -> None:
    """`Range: bytes=0-0,2-2,…` with 1,000 ranges: several ranges are ignored (RFC 9110 lets a
    server), so the answer is the whole blob, 200 and no multipart, as cheap as a plain GET."""
    layer = demo.manifest("qwen3:0.6b").layer("model.gguf")
    data = demo.blob_path(layer.digest).read_bytes()
    ranges = "bytes=" + ",".join(f"{2 * i}-{2 * i}" for i in range(1000))
    with serving(demo.root) as (url, proc):
        port = port_of(url)
        with watched(port, proc.pid, "1,000-range requests"):
            for _ in range(100):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                started = time.monotonic()
                conn.request(
                    "GET", f"/v2/library/qwen3/blobs/{layer.digest}", headers={"Range": ranges}
                )
                answer = conn.getresponse()
                body = answer.read()
                conn.close()
                assert answer.status == 200 and body == data
                assert "multipart" not in answer.getheader("content-type", "")
                assert time.monotonic() - started < LATENCY


@pytest.mark.skipif(CURL is None, reason="needs curl")
def test_a_slow_download_is_not_cut(demo: DemoStore, tmp_path: Path) -> None:
    """A client that reads a ~17 MB blob at 2 MB/s (well past the head timeout, while it sends
    nothing) gets all of it, by the sendfile path: no limit meant for a request's head
    cuts an answer."""
    assert CURL is not None
    layer = demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf")
    out = tmp_path / "blob"
    with serving(demo.root) as (url, _):
        started = time.monotonic()
        done = subprocess.run(
            [
                CURL,
                "-sS",
                "-f",
                "--limit-rate",
                "2M",
                "-o",
                str(out),
                f"{url}/v2/library/gemma4/blobs/{layer.digest}",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr.decode()
        # The download must outlast the head timeout to show it is not cut; curl's rate limit
        # is an average, so allow a burst at either end.
        assert took > HEADER_TIMEOUT + 1, took
        assert hashlib.sha256(out.read_bytes()).hexdigest() == layer.digest.hex


# -- a hostile upstream for `modelfs serve --mirror` ------------------------------------------
def fetch(port: int, path: str) -> tuple[int, bytes, bool]:
    """(status, body, whole): whole is False when the server cut the answer short."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        try:
            return answer.status, answer.read(), True
        except (http.client.IncompleteRead, OSError) as exc:
            partial = exc.partial if isinstance(exc, http.client.IncompleteRead) else b""
            return answer.status, partial, False
    finally:
        conn.close()


ROUNDS = 5  # each attack on the mirror, so many times


def test_a_hostile_upstream_gets_nothing_kept(tmp_path: Path) -> None:
    """Through `modelfs serve --mirror`: a redirect loop (a manifest's and a blob's), an
    endless manifest and blob, a gzip bomb of a manifest and of a blob (1 GiB of zeros in 1 MiB),
    a blob of the wrong bytes, a corrupt gzip body, each `ROUNDS` times. Each manifest is a 502
    that says why; each blob answer is an error or cut short (its bytes are never all sent);
    nothing of them is kept, no temp file is left; and the mirror stays within memory and
    answers `/v2/` in time throughout. A manifest compressed honestly (gzip, deflate) comes
    through byte for byte."""
    store = tmp_path / "m"
    argv = [sys.executable, "-m", "tests.hostile_upstream"]
    with server(argv) as upstream, serving(store, "--mirror", upstream) as (url, proc):
        port = port_of(url)
        # Slack for the connections to upstream that the mirror keeps alive (httpx's pool).
        with watched(port, proc.pid, "hostile upstream", fd_slack=2):
            for _ in range(ROUNDS):
                for mode, why in (
                    ("redirect", "too many redirects"),
                    ("endless", "larger than a manifest can be"),
                    ("gzip", "larger than a manifest can be"),
                ):
                    status, body, _ = fetch(port, f"/v2/library/{mode}/manifests/1")
                    assert status == 502, (mode, status, body[:200])
                    assert why in json.loads(body)["errors"][0]["message"], (mode, body[:200])
                status, body, _ = fetch(port, "/v2/library/corrupt/manifests/1")
                assert status == 502 and b"broken response" in body, (status, body[:200])
                status, body, _ = fetch(port, f"/v2/library/redirect/blobs/{digest_of(b'r')}")
                assert status == 502 and b"too many redirects" in body, (status, body[:200])

                # The blobs of a good manifest, answered badly (the manifest's GET starts their
                # fetch; the client's GET joins it, or starts another).
                for mode in ("endless-blob", "gzip-blob", "wrong-blob"):
                    status, _, _ = fetch(port, f"/v2/library/{mode}/manifests/1")
                    assert status == 200, mode
                    status, body, whole = fetch(port, f"/v2/library/{mode}/blobs/{BAD[mode]}")
                    assert not (status == 200 and whole), (mode, status, len(body))
            # Compressed honestly, as a CDN may: inflated, the manifest byte for byte.
            for mode in ("gzipped", "deflated"):
                status, body, whole = fetch(port, f"/v2/library/{mode}/manifests/1")
                assert (status, body, whole) == (200, manifest_of("wrong-blob"), True), mode
        for mode, digest in BAD.items():
            assert not (store / "blobs" / digest.replace(":", "-")).exists(), mode
        tmp = store / ".modelfs" / "tmp"
        assert not list(tmp.glob("pull-*")) if tmp.exists() else True
