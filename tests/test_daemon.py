"""`modelfs sync`, the daemon: config checking, replication between real processes, the
systemd notify protocol on a real datagram socket, signals, kill -9 and resume, unit files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelfs.store.digest import Digest
from modelfs.store.scan import scan_store
from modelfs.sync.pull.options import PullOptions
from tests.builders import TinyStore
from tests.test_pull_hosts import _env, fakepeer
from tests.throttle import Throttle

REPO = Path(__file__).resolve().parent.parent
MODELFS = str(Path(sys.executable).with_name("modelfs"))
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or cond}")


def toml_value(value: Any) -> str:
    """JSON spelling, but tables inline (`{ url = …, pin = … }`), as TOML writes them."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(path: Path, **keys: Any) -> Path:
    gc = keys.pop("gc", None)
    lines = [f"{k} = {toml_value(v)}" for k, v in keys.items()]
    if gc is not None:
        lines.append("[gc]")
        lines += [f"{k} = {toml_value(v)}" for k, v in gc.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    def __init__(
        self, proc: subprocess.Popen[bytes], log: Path, url: str, config: Path, keys: dict[str, Any]
    ) -> None:
        self.proc, self.log, self.url, self.config = proc, log, url, config
        self.keys = keys  # what its config file says

    def reload(self, **changes: Any) -> None:
        """Rewrite its config with `changes` and send SIGHUP."""
        self.keys = {**self.keys, **changes}
        write_config(self.config, **self.keys)
        self.proc.send_signal(signal.SIGHUP)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/modelfs/v1/status", timeout=10).json()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def status_cli(self) -> str:
        """`modelfs status --url` of this daemon: its output (exit status 0 asserted)."""
        r = subprocess.run(
            [MODELFS, "status", "--url", self.url],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(),
        )
        assert r.returncode == 0, r.stderr
        return r.stdout


@contextmanager
def daemon(
    tmp: Path,
    name: str,
    *,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    **keys: Any,
) -> Iterator[Daemon]:
    port = free_port()
    keys.setdefault("listen", f"127.0.0.1:{port}")
    keys.setdefault("host_id", name)
    config = write_config(tmp / f"{name}.toml", **keys)
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(
        [MODELFS, "sync", "--config", str(config), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child owns it
        cwd=REPO,
        env={**_env(), **(env or {})},
    )
    try:
        wait_until(
            lambda: "ready: serving on" in log.read_text() or proc.poll() is not None,
            what=f"{name} to be ready",
        )
        assert proc.poll() is None, log.read_text()
        scheme = "https" if "tls_cert" in keys else "http"
        yield Daemon(proc, log, f"{scheme}://{keys['listen']}", config, keys)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def names(store: Path) -> set[str]:
    return {e.name.shortest for e in scan_store(store)}


def complete(store: Path, name: str) -> bool:
    """The tag is there and every blob it needs is present and hashes to its name."""
    index = scan_store(store)
    try:
        entry = index.lookup(name)
    except Exception:
        return False
    for variant in entry.variants:
        if index.missing_blobs(variant.manifest):
            return False
        for d in variant.manifest.blob_digests():
            if hashlib.sha256(index.layout.blob(d).read_bytes()).hexdigest() != d.hex:
                return False
    return bool(entry.variants)


def partial_bytes(store: Path, digest_hex: str) -> int:
    """Bytes of a blob a pull has on disk in `.modelfs/tmp/` so far, by its sidecar."""
    sidecar = store / ".modelfs" / "tmp" / f"pull-sha256-{digest_hex}.json"
    try:
        return sum(e - s for s, e in json.loads(sidecar.read_text())["done"])
    except (OSError, ValueError, KeyError):
        return 0


def big_model(store: TinyStore, name: str, size: int, seed: int = 1) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    payload = (block * (size // len(block) + 1))[:size]
    return store.gguf_model(name, payload)


A_PIN = "sha256:" + "a" * 64  # well-formed


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('intervall = "60s"\n', "intervall: unknown key"),
        ("interval = 60\n", "interval: expected a string, got an integer"),
        ('interval = "soon"\n', "interval: expected a duration"),
        ('interval = "0s"\n', "interval: expected a positive duration"),
        ('[gc]\nenabled = "yes"\n', "gc.enabled: expected true or false"),
        ('[gc]\ngrace = "1 hour"\n', "gc.grace: expected a duration"),
        ('[gc]\nretention = "1d"\n', "gc.retention: unknown key"),
        ('peers = ["ftp://x"]\n', "peers[0]: expected http://HOST[:PORT]"),
        ('peers = "http://x"\n', "peers: expected a list"),
        ('replicate = ["gemma4:*", ""]\n', "replicate[1]: expected a non-empty string"),
        ('listen = "nowhere"\n', "listen: invalid listen address"),
        ('tls_cert = "/c.pem"\n', "tls_cert: tls_cert and tls_key go together"),
        (
            'tls_cert = "/none/c.pem"\ntls_key = "/none/k.pem"\n',
            "tls_cert, tls_key: /none/c.pem: no such file",
        ),
        ('peers = [{ url = "https://x:1", pin = "sha1:ab" }]\n', "peers[0].pin: expected sha256:"),
        ('peers = [{ url = "https://x:1" }]\n', "peers[0].pin: missing"),
        (
            f'peers = [{{ url = "ftp://x", pin = "{A_PIN}" }}]\n',
            "peers[0].url: expected http",
        ),
        (
            f'peers = [{{ url = "http://x:1", pin = "{A_PIN}" }}]\n',
            "peers[0].pin: a pinned peer is reached by https://, not http://x:1",
        ),
        (
            f'peers = [{{ url = "https://x:1", pin = "{A_PIN}", pins = 1 }}]\n',
            "peers[0].pins: unknown key",
        ),
        ("peers = [1]\n", "peers[0]: expected a URL or a table { url = …, pin = … }"),
        ('host_id = "a b"\n', "host_id: expected a host name"),
        ("store = [\n", "not valid TOML"),
        ('token_file = "/nonexistent/token"\n', "token_file: cannot read token file"),
    ],
)
def test_a_bad_config_fails_fast_with_one_line_naming_the_key(
    tmp_path: Path, body: str, needle: str
) -> None:
    config = tmp_path / "config.toml"
    base = {"store": f'"{tmp_path}"', "listen": '"127.0.0.1:0"'}
    top = "".join(f"{k} = {v}\n" for k, v in base.items() if not body.startswith(k))
    config.write_text(top + body)
    t = time.monotonic()
    r = subprocess.run(
        [MODELFS, "sync", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
    )
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("modelfs: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(config) in errors[0] and needle in errors[0], errors[0]
    assert "ready" not in r.stderr and time.monotonic() - t < 10


# -- systemd -------------------------------------------------------------------------------------
def test_notify_ready_status_watchdog_and_stopping_on_a_real_socket(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(15)
    store = TinyStore(tmp_path / "store")
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"}
    with daemon(tmp_path, "n1", env=env, store=str(store.root), interval="1s") as d:
        messages: list[str] = []

        def receive_until(cond: Callable[[], bool]) -> None:
            while not cond():
                messages.extend(sock.recv(4096).decode().splitlines())

        receive_until(lambda: "READY=1" in messages and messages.count("WATCHDOG=1") >= 3)
        assert any(m.startswith("STATUS=serving") for m in messages)
        lease = list(store.layout.leases.glob("n1.*.sync.json"))
        assert len(lease) == 1
        t = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        receive_until(lambda: "STOPPING=1" in messages)
        assert d.proc.wait(timeout=10) == 0
        assert time.monotonic() - t < 10
        assert not lease[0].exists()
    sock.close()


def test_unit_files_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    units = sorted((REPO / "systemd").iterdir())
    assert {u.name for u in units} == {
        "modelfs-mount.service",
        "modelfs-sync.service",
        "modelfs-gc.service",
        "modelfs-gc.timer",
    }
    for unit in units:
        # verify wants ExecStart= binaries to exist: point them at this checkout's.
        text = unit.read_text().replace("/usr/local/bin/modelfs", MODELFS)
        (tmp_path / unit.name).write_text(text)
    r = subprocess.run(
        [analyze, "verify", *(str(tmp_path / u.name) for u in units)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r
    sync = (REPO / "systemd" / "modelfs-sync.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "ProtectSystem=strict",
        "ReadWritePaths=",
        "NoNewPrivileges=yes",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ):
        assert line in sync, line
    assert "ProtectSystem=strict" in (REPO / "systemd" / "modelfs-gc.service").read_text()
    mount = (REPO / "systemd" / "modelfs-mount.service").read_text()
    assert "Type=notify" in mount and "\nProtectSystem=" not in mount  # see its comment


# -- replication ---------------------------------------------------------------------------------
def test_replicates_selected_names_reloads_on_sighup_and_survives_a_bad_reload(
    tmp_path: Path,
) -> None:
    a = TinyStore(tmp_path / "a")
    a.gguf_model("qwen3:0.6b", b"qwen weights")
    a.gguf_model("gemma4:26b", b"gemma weights")
    a.gguf_model("other:1", b"not selected")
    b = tmp_path / "b"
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        fakepeer(a.root) as peer_url,
        daemon(
            tmp_path,
            "b",
            store=str(b),
            peers=[dead, peer_url],
            replicate=["qwen3:*"],
            interval="1s",
        ) as d,
    ):
        wait_until(lambda: complete(b, "qwen3:0.6b"), what="qwen3 on b")
        assert names(b) == {"qwen3:0.6b"}
        status = d.status()
        peers = {p["url"]: p for p in status["peers"]}
        assert peers[peer_url]["ok"] and not peers[dead]["ok"]
        assert "cannot connect" in peers[dead]["error"]
        assert status["daemon"]["models"] == {
            "qwen3:0.6b": status["daemon"]["models"]["qwen3:0.6b"]
        }

        metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
        assert f'modelfs_peer_up{{peer="{peer_url}"}} 1' in metrics
        assert f'modelfs_peer_up{{peer="{dead}"}} 0' in metrics
        assert f'modelfs_peer_blobs_received_total{{peer="{peer_url}"}}' in metrics

        out = d.status_cli()
        assert "qwen3:0.6b" in out and "same" in out and "DOWN" in out

        d.reload(peers=[peer_url], replicate=["qwen3:*", "gemma4:*"])
        wait_until(lambda: complete(b, "gemma4:26b"), what="gemma4 after SIGHUP")
        assert "other:1" not in names(b)

        d.config.write_text("interval = \n")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "keeping the running config" in d.text(), what="reload error")
        assert d.proc.poll() is None and d.status()["daemon"]["replicate"] == [
            "qwen3:*",
            "gemma4:*",
        ]


@pytest.mark.slow
def test_three_hosts_two_sharing_a_store_never_fetch_twice_nor_lose_blobs_to_gc(
    tmp_path: Path,
) -> None:
    origin = TinyStore(tmp_path / "origin")
    origin.gguf_model("seed:1", b"small")
    log = tmp_path / "peer.jsonl"
    b, shared = tmp_path / "b", tmp_path / "shared"
    common = {
        "interval": "1s",
        "replicate": ["*"],
        "gc": {"interval": "1s", "grace": "0s", "grace_below_floor": True, "trash_retention": "0s"},
    }
    with fakepeer(origin.root, "throttle=8M", log=log) as url:
        common["peers"] = [url]
        with (
            daemon(tmp_path, "b", store=str(b), **common),
            daemon(tmp_path, "c1", store=str(shared), **common),
            daemon(tmp_path, "c2", store=str(shared), **common),
        ):
            wait_until(lambda: complete(b, "seed:1") and complete(shared, "seed:1"), 60)
            # Published on the origin while everybody runs: 24 MiB at 8 MB/s, ~3 s a copy.
            raw = big_model(origin, "big:1", 24 * MiB)
            wait_until(lambda: complete(b, "big:1") and complete(shared, "big:1"), 90, "big:1")
            time.sleep(3)  # a few more GC rounds on both sharing hosts
            assert complete(shared, "big:1") and complete(b, "big:1")
    big = json.loads(raw)["layers"][0]["digest"]
    gets = [json.loads(line) for line in log.read_text().splitlines()]
    big_gets = [g for g in gets if g["method"] == "GET" and g["digest"] == big.split(":")[1]]
    assert len(big_gets) == 2, big_gets  # once for b, once for the shared store


def test_a_daemon_killed_mid_transfer_resumes_after_restart(tmp_path: Path) -> None:
    origin = TinyStore(tmp_path / "origin")
    raw = big_model(origin, "big:1", 32 * MiB)
    digest = json.loads(raw)["layers"][0]["digest"].split(":")[1]
    store = tmp_path / "store"
    log = tmp_path / "peer.jsonl"
    keys = {"store": str(store), "interval": "1s", "replicate": ["big:*"]}
    with fakepeer(origin.root, "throttle=6M", log=log) as url:
        keys["peers"] = [url]

        def done_bytes() -> int:
            return partial_bytes(store, digest)

        with daemon(tmp_path, "k", **keys) as d:
            wait_until(lambda: done_bytes() > 8 * MiB, 60, "a third of the blob")
            d.proc.kill()
        before = done_bytes()
        with daemon(tmp_path, "k", **keys):
            wait_until(lambda: complete(store, "big:1"), 90, "the model after restart")
    gets = [json.loads(line) for line in log.read_text().splitlines()]
    ranges = [g["range"] for g in gets if g["method"] == "GET" and g["digest"] == digest]
    assert ranges[0] is None or ranges[0].startswith("bytes=0-")
    resumed = ranges[-1]
    assert resumed is not None and int(resumed.split("=")[1].split("-")[0]) >= before > 0


@pytest.mark.slow
def test_tag_history_keeps_the_replaced_version_for_its_retention(tmp_path: Path) -> None:
    store = TinyStore(tmp_path / "store")
    old_raw = store.gguf_model("m:1", b"version one weights")
    old_blob = json.loads(old_raw)["layers"][0]["digest"]
    for name in os.listdir(store.layout.blobs):
        os.utime(store.layout.blobs / name, (time.time() - 7200,) * 2)
    keys = {
        "store": str(store.root),
        "interval": "1s",
        "gc": {
            "interval": "1s",
            "grace": "2s",
            "grace_below_floor": True,
            "trash_retention": "0s",
            "history_retention": "6s",
        },
    }
    history = store.layout.state / "history" / "log.jsonl"
    with daemon(tmp_path, "h", **keys) as d:
        wait_until(lambda: history.exists() and "m:1" in history.read_text(), 20, "first look")
        store.gguf_model("m:1", b"version two weights")  # `ollama pull` moved the tag
        os.utime(store.layout.blob(Digest.parse(old_blob)), (time.time() - 7200,) * 2)
        wait_until(lambda: len(history.read_text().splitlines()) >= 2, 20, "the change")
        wait_until(lambda: "tag history: m:1 changed" in d.text(), 5, "the log line")
        t = time.monotonic()
        while time.monotonic() - t < 4:  # several GC rounds within the retention
            assert store.layout.blob(Digest.parse(old_blob)).exists()
            time.sleep(0.2)
        r = subprocess.run(
            [MODELFS, "diff", "--store", str(store.root), "m:1", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["kind"] == "new weights"
        wait_until(
            lambda: not store.layout.blob(Digest.parse(old_blob)).exists(),
            30,
            "the old version to go after the retention",
        )


def test_a_peer_that_lies_is_counted_and_the_model_still_arrives_whole(tmp_path: Path) -> None:
    origin = TinyStore(tmp_path / "origin")
    raw = big_model(origin, "m:1", 12 * MiB)
    blob = json.loads(raw)["layers"][0]["digest"].split(":")[1]
    store = tmp_path / "store"
    with (
        fakepeer(origin.root, f"flip@{blob[:12]}#1") as peer,  # lies once, then tells the truth
        daemon(
            tmp_path, "v", store=str(store), peers=[peer], replicate=["m:*"], interval="1s"
        ) as d,
    ):
        wait_until(lambda: complete(store, "m:1"), 60, "m:1 after the lie")
        metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
        assert f'modelfs_verify_failures_total{{peer="{peer}"}} 1' in metrics
        assert "modelfs_pull_failures_total 1" in metrics


def test_a_model_published_on_one_daemon_reaches_the_others_through_a_chain(
    tmp_path: Path,
) -> None:
    a, b, c = (TinyStore(tmp_path / n) for n in ("a", "b", "c"))
    a.gguf_model("first:1", b"first")
    fast = {"interval": "1s", "replicate": ["*"]}
    with (
        daemon(tmp_path, "a", store=str(a.root), interval="1s") as da,
        daemon(tmp_path, "b", store=str(b.root), peers=[da.url], **fast) as db,
        daemon(tmp_path, "c", store=str(c.root), peers=[db.url], **fast),
    ):
        wait_until(lambda: complete(c.root, "first:1"), 30, "first:1 on c")
        a.gguf_model("second:1", b"published on a later")  # as `ollama create` does
        wait_until(lambda: complete(c.root, "second:1"), 30, "second:1 on c, via b")
        assert complete(b.root, "second:1")
        for name in ("first:1", "second:1"):
            ours = {s.name.shortest: s.digest for s in scan_store(c.root)}[name]
            assert ours == {s.name.shortest: s.digest for s in scan_store(a.root)}[name]


@pytest.mark.slow
def test_two_daemons_with_a_token_replicate_a_large_model_and_resume_after_kill_9(
    tmp_path: Path,
) -> None:
    """docs/sync.md's setup: two daemons, each the other's peer, one shared token_file. Every
    request carries the token, on the large-blob path too (blobs from `small_max` on), and a
    transfer cut by kill -9 of the source resumes from its partial once the source is back.
    b reaches a through a throttling proxy, so the kill lands mid-transfer."""
    large = PullOptions().small_max  # the smallest blob that takes the large path
    token = tmp_path / "token"
    token.write_text("c2VjcmV0LXRva2VuLWZvci10aGUtdGVzdA==\n")
    a, b = TinyStore(tmp_path / "a"), TinyStore(tmp_path / "b")
    big_model(a, "fresh:1", large, seed=1)
    big_model(b, "back:1", large, seed=2)
    port_a, port_b = free_port(), free_port()
    common = {"interval": "1s", "replicate": ["*"], "token_file": str(token)}
    keys_a = {"store": str(a.root), "listen": f"127.0.0.1:{port_a}", **common}
    keys_a["peers"] = [f"http://127.0.0.1:{port_b}"]
    with Throttle(("127.0.0.1", port_a), rate=64 * MiB) as proxy:
        keys_b = {"store": str(b.root), "listen": f"127.0.0.1:{port_b}", **common}
        keys_b["peers"] = [proxy.url]
        with daemon(tmp_path, "b", **keys_b):
            with daemon(tmp_path, "a", **keys_a) as da:
                wait_until(lambda: complete(b.root, "fresh:1"), 60, "fresh:1 on b")
                wait_until(lambda: complete(a.root, "back:1"), 60, "back:1 on a")
                proxy.rate = 2 * MiB  # 4 s for the next model: time to kill a mid-way
                start = proxy.relayed
                raw = big_model(a, "big:1", large, seed=3)
                blob = json.loads(raw)["layers"][0]["digest"].split(":")[1]
                sidecar = b.layout.tmp / f"pull-sha256-{blob}.json"
                wait_until(lambda: proxy.relayed - start > 2 * MiB, 60, "a part of big:1")
                da.proc.kill()
                da.proc.wait()

            def done_bytes() -> int:
                try:
                    return sum(e - s for s, e in json.loads(sidecar.read_text())["done"])
                except (OSError, ValueError, KeyError):
                    return 0

            # b keeps what it received (the sidecar says how much) for the resume.
            wait_until(lambda: done_bytes() > MiB, 30, "b to keep the bytes it had")
            before = done_bytes()
            assert 0 < before < large
            assert (b.layout.tmp / f"pull-sha256-{blob}.partial").exists()
            assert not complete(b.root, "big:1")
            proxy.rate = 64 * MiB
            with daemon(tmp_path, "a", **keys_a):
                wait_until(lambda: complete(b.root, "big:1"), 60, "big:1 after a's restart")
    assert proxy.requests and all(r.authorized for r in proxy.requests), proxy.requests
    gets = [r for r in proxy.requests if r.method == "GET" and r.path.endswith(blob)]
    assert gets[0].range is not None and gets[0].range.startswith("bytes=0-")
    resumed = gets[-1].range
    assert resumed is not None and int(resumed.split("=")[1].split("-")[0]) >= before
    assert not list(b.layout.tmp.glob("pull-*"))  # nothing left over once it is whole
