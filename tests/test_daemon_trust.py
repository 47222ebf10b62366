"""The sync daemon as a user meets it: `modelfs status` finds it through its config, and a
host takes catalogs and manifests only from peers that prove they hold the shared token.
Daemons and impostors are separate processes on loopback."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.test_daemon import MODELFS, REPO, complete, daemon, names, wait_until
from tests.test_pull_hosts import _env, fakepeer, server
from tests.test_serve_process import served


def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MODELFS, "status", *args], capture_output=True, text=True, timeout=30, env=_env()
    )


def get(url: str, token: Path) -> httpx.Response:
    auth = {"Authorization": f"Bearer {token.read_text().strip()}"}
    return httpx.get(url, headers=auth, timeout=10)


def test_status_finds_the_daemon_through_its_config_alone(tmp_path: Path) -> None:
    """No --url, no --token-file: the listen address and the token come from the config."""
    token = tmp_path / "token"
    token.write_text("c3RhdHVzLWZpbmRzLWl0cy1kYWVtb24=\n")
    with daemon(tmp_path, "solo", store=str(tmp_path / "s"), token_file=str(token)) as d:
        r = status_cli("--config", str(d.config))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("host solo: store "), r.stdout
        # --url still wins over the config's address.
        r = status_cli("--config", str(d.config), "--url", "http://127.0.0.1:9")
        assert r.returncode == 1 and "no sync daemon answers at http://127.0.0.1:9" in r.stderr
    missing = tmp_path / "nowhere.toml"
    r = status_cli("--config", str(missing))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"modelfs: error: {missing}: cannot read: No such file or directory"
    ]


def test_impostors_on_peer_addresses_are_refused_and_named(tmp_path: Path) -> None:
    """b's peers, in order: a tokenless `modelfs serve`, one with another token, the real
    daemon a. Both impostors hold `gemma4:26b` as another model; the first peer's version
    would win, so without proofs b would take the impostor's. b takes only a's, says which
    peers failed (log, status, /metrics), and still uses a configured registry as before.
    Both are UNTRUSTED, the one with another token (it answers 401) too, not DOWN."""
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("dGhlLXNoYXJlZC10b2tlbi1vZi10aGUtaG9zdHM=\n")
    wrong.write_text("YW5vdGhlci10b2tlbi1lbnRpcmVseQ==\n")
    real, fake, reg = (TinyStore(tmp_path / n) for n in ("real", "fake", "reg"))
    real.gguf_model("gemma4:26b", b"the real gemma")
    fake.gguf_model("gemma4:26b", b"an impostor's gemma")
    fake.gguf_model("evil:1", b"only the impostors have this")
    reg.gguf_model("fromreg:1", b"a registry's model")
    b = tmp_path / "b"
    with (
        served(fake.root) as (tokenless, _),
        served(fake.root, "--token-file", str(wrong)) as (other_token, _),
        served(reg.root) as (registry, _),
        daemon(tmp_path, "a", store=str(real.root), token_file=str(token)) as a,
        daemon(
            tmp_path,
            "b",
            store=str(b),
            token_file=str(token),
            peers=[tokenless, other_token, a.url],
            registries=[registry],
            replicate=["*"],
            interval="1s",
        ) as d,
    ):
        wait_until(lambda: complete(b, "gemma4:26b"), what="gemma4 from a")
        wait_until(lambda: complete(b, "fromreg:1"), what="the registry's model")
        wait_until(
            lambda: all(
                p["error"] for p in get(f"{d.url}/modelfs/v1/status", token).json()["peers"][:2]
            ),
            what="both impostors tried",
        )
        assert names(b) == {"gemma4:26b", "fromreg:1"}
        here = {e.name.shortest: e.digest for e in scan_store(b)}
        assert (
            here["gemma4:26b"]
            == {e.name.shortest: e.digest for e in scan_store(real.root)}["gemma4:26b"]
        )
        peers = {p["url"]: p for p in get(f"{d.url}/modelfs/v1/status", token).json()["peers"]}
        assert "not a peer holding the shared token" in peers[tokenless]["error"]
        assert peers[tokenless]["unproven"] >= 1 and not peers[tokenless]["models"]
        assert "401" in peers[other_token]["error"] and not peers[other_token]["models"]
        # Another token answers 401: not a peer of ours, so UNTRUSTED, not DOWN.
        assert peers[tokenless]["untrusted"] == "no proof of the shared token"
        assert peers[other_token]["untrusted"] == "refuses the shared token"
        assert peers[a.url]["untrusted"] is None and peers[registry]["untrusted"] is None
        assert peers[a.url]["ok"] and peers[registry]["proof"] == "registry"
        assert f"peer {tokenless}: not a peer holding the shared token" in d.text()
        assert f"{tokenless}: {tokenless}" not in d.text()  # the URL once, not twice
        metrics = get(f"{d.url}/metrics", token).text
        assert f'modelfs_peer_up{{peer="{tokenless}"}} 0' in metrics
        assert f'modelfs_peer_up{{peer="{other_token}"}} 0' in metrics
        reason = 'reason="refuses the shared token"'
        assert f'modelfs_peer_untrusted{{peer="{other_token}",{reason}}} 1' in metrics
        assert f'modelfs_peer_untrusted{{peer="{a.url}"}} 0' in metrics
        unproven = [
            line
            for line in metrics.splitlines()
            if line.startswith(f'modelfs_peer_unproven_total{{peer="{tokenless}"}} ')
        ]
        assert unproven and int(unproven[0].split()[-1]) >= 1, metrics
        r = status_cli("--config", str(d.config))
        assert r.returncode == 0, r.stderr
        for url in (tokenless, other_token):
            row = next(line for line in r.stdout.splitlines() if line.strip().startswith(url))
            assert row.split()[1] == "UNTRUSTED:", r.stdout


def test_every_status_word_is_defined_in_help_and_docs() -> None:
    """The words `render_status` prints are each explained where a user looks (`status --help`
    and docs/sync.md, which the README links)."""
    source = (REPO / "modelfs" / "cli" / "status.py").read_text()
    words = ["ok", "DOWN", "UNTRUSTED", "listed", "same", "pulling", "waiting", "behind"]
    for word in words:
        assert f'"{word}' in source or f"'{word}" in source or f"{word}:" in source, word
    r = status_cli("--help")
    assert r.returncode == 0, r.stderr
    page = (REPO / "docs" / "sync.md").read_text()
    for word in words:
        assert f"\n    {word} " in r.stdout, (word, r.stdout)
        assert f"| `{word}" in page, word


def test_replication_lag_is_zero_for_names_in_step(tmp_path: Path) -> None:
    """A dashboard tells "in step" from "not measured": each selected name has a series."""
    a = TinyStore(tmp_path / "a")
    a.gguf_model("qwen3:0.6b", b"qwen weights")
    b = tmp_path / "b"
    with (
        fakepeer(a.root) as peer_url,
        daemon(tmp_path, "b", store=str(b), peers=[peer_url], replicate=["*"], interval="1s") as d,
    ):
        wait_until(lambda: complete(b, "qwen3:0.6b"), what="qwen3 on b")
        wait_until(
            lambda: (
                'modelfs_replication_lag_seconds{name="qwen3:0.6b"} 0\n'
                in httpx.get(f"{d.url}/metrics", timeout=10).text
            ),
            what="a lag series of 0",
        )


def test_a_registry_added_by_reload_is_used_without_a_proof(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("cmVsb2FkZWQtcmVnaXN0cmllcy10b2tlbg==\n")
    reg = TinyStore(tmp_path / "reg")
    reg.gguf_model("fromreg:1", b"a registry's model")
    b, reg_log = tmp_path / "b", tmp_path / "registry.log"
    with (
        fakepeer(reg.root, log=reg_log) as registry,
        daemon(
            tmp_path, "b", store=str(b), token_file=str(token), replicate=["*"], interval="1s"
        ) as d,
    ):
        d.reload(registries=[registry])
        wait_until(lambda: complete(b, "fromreg:1"), what="the registry's model after SIGHUP")
        peers = get(f"{d.url}/modelfs/v1/status", token).json()["peers"]
        assert [(p["url"], p["proof"], p["unproven"]) for p in peers] == [(registry, "registry", 0)]
        # A registry added by a reload is sent none of the token's proofs either.
        asked = [json.loads(line) for line in reg_log.read_text().splitlines()]
        assert asked and not any(s["authorization"] for s in asked), asked


def test_a_relay_on_a_peer_address_learns_no_token_and_cannot_swap_a_manifest(
    tmp_path: Path,
) -> None:
    """b's first peer is a relay (tests/relaypeer.py) that holds no token, passes b's
    requests on to the real daemon a, and answers for a's `gemma4:26b` with a's `other:1`
    manifest, a's proof kept. b sends peers a proof of the token made for each request, never
    the token, so nothing the relay saw lets it in at a (each header it was sent, sent again,
    is refused). The proof a sends covers the body, so b refuses the swapped manifest, names
    the relay, and takes `gemma4:26b` as a holds it. A configured registry is sent nothing."""
    secret = "cmVsYXllZC10b2tlbi1uZXZlci1zZWVu"
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    real = TinyStore(tmp_path / "real")
    real.gguf_model("gemma4:26b", b"the real gemma")
    real.gguf_model("other:1", b"another model of a's")
    swapped = tmp_path / "swapped.json"
    swapped.write_bytes(real.layout.legacy_manifest(parse_name("other:1")).read_bytes())
    reg = TinyStore(tmp_path / "reg")
    reg.gguf_model("fromreg:1", b"a registry's model")
    log, reg_log = tmp_path / "relay.log", tmp_path / "registry.log"
    relay_argv = [sys.executable, "-m", "tests.relaypeer", "--log", str(log)]
    b = tmp_path / "b"
    with (
        daemon(tmp_path, "a", store=str(real.root), token_file=str(token)) as a,
        server([*relay_argv, "--upstream", a.url, "--swap", f"/manifests/26b={swapped}"]) as relay,
        fakepeer(reg.root, log=reg_log) as registry,
        daemon(
            tmp_path,
            "b",
            store=str(b),
            token_file=str(token),
            peers=[relay, a.url],
            registries=[registry],
            replicate=["gemma4:26b", "fromreg:1"],
            interval="1s",
        ) as d,
    ):
        wait_until(lambda: complete(b, "gemma4:26b"), what="gemma4 from a")
        wait_until(lambda: complete(b, "fromreg:1"), what="the registry's model")
        wait_until(
            lambda: f"peer {relay}: not a peer holding the shared token" in d.text(),
            what="the relay named",
        )
        ids = {e.name.shortest: e.digest for e in scan_store(real.root)}
        assert {e.name.shortest: e.digest for e in scan_store(b)}["gemma4:26b"] == ids["gemma4:26b"]

        seen = [json.loads(line) for line in log.read_text().splitlines()]
        assert any("/manifests/" in s["path"] for s in seen), seen
        encoded = base64.b64encode(f"x:{secret}".encode()).decode()[4:]
        for s in seen:
            assert s["authorization"].startswith("Modelfs-Peer "), s
            assert secret not in s["authorization"] and encoded not in s["authorization"]
            again = httpx.request(
                s["method"], a.url + s["path"], headers={"Authorization": s["authorization"]}
            )
            assert again.status_code == 401, (s, again.status_code)
        asked = [json.loads(line) for line in reg_log.read_text().splitlines()]
        assert asked and not any(s["authorization"] for s in asked), asked


class _DeepCatalog(BaseHTTPRequestHandler):
    """A registry whose catalog is JSON nested deeper than Python reads."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"[" * 200_000
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _EndlessCatalog(_DeepCatalog):
    """A registry whose catalog goes on for 64 MiB, four times what a listing page may be."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"[" + b" " * (1 << 20)
        try:
            for _ in range(64):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the daemon stopped reading, as it should


def test_a_registry_with_a_hostile_catalog_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """A catalog nested 200,000 deep (Python's JSON reader raises RecursionError) and one that
    goes on for 64 MiB are each that source's error: the daemon keeps running, its memory
    stays bounded, and the next round asks again."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (_DeepCatalog, _EndlessCatalog)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    deep, endless = (f"http://127.0.0.1:{s.server_port}" for s in servers)
    try:
        with daemon(
            tmp_path,
            "b",
            store=str(tmp_path / "b"),
            registries=[deep, endless],
            replicate=["*"],
            interval="1s",
        ) as d:
            wait_until(
                lambda: (
                    sum(1 for p in d.status()["peers"] if p["error"]) == 2
                    and "more than 16 MiB" in d.text()
                ),
                what="both catalogs refused",
            )
            time.sleep(2)  # another round
            assert d.proc.poll() is None, d.text()
            assert "Traceback" not in d.text()
            rss = next(
                int(line.split()[1])
                for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:")
            )
            assert rss < 400 << 10, f"peak RSS {rss} kB"
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
