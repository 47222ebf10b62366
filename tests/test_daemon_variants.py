"""`modelfs sync` keeps each host's preferred variant of a manifest list, runs transfers of
different names side by side, and keeps its timing: the first GC soon after the start, a
reload that applies new intervals at once, back-off lines that say the real next try.

Daemons are separate `modelfs sync` processes on loopback; the source of a large blob is
slowed by a throttling TCP proxy in the test process (a real daemon sends at loopback speed,
too fast to be caught mid-transfer)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from modelfs.store.digest import Digest
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.mounting import fuse, mounted
from tests.test_daemon import (
    MiB,
    big_model,
    complete,
    daemon,
    free_port,
    partial_bytes,
    wait_until,
)
from tests.test_pull_hosts import fakepeer

GEMMA = "gemma4:26b"


class ThrottleProxy:
    """TCP from a local port to `upstream`, the answers sent at `rate` bytes/s. When the
    upstream is down, a connection is accepted and closed (a peer that does not answer)."""

    def __init__(self, upstream: int, rate: float) -> None:
        self.upstream, self.rate = upstream, rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.down_bytes = 0  # sent to clients, all connections
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, self.rate)

    def _pump(self, src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        """Bytes from `src` to `dst` (at `rate`, counted) until either end closes; then both."""
        t0, sent = time.monotonic(), 0
        try:
            while data := src.recv(64 * 1024):
                dst.sendall(data)
                if rate is None:
                    continue
                sent += len(data)
                with self.lock:
                    self.down_bytes += len(data)
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


def list_store(root: Path, gguf_payload: bytes, *, with_gguf: bool = True) -> tuple[bytes, bytes]:
    """A store with gemma4:26b as a manifest list of a llamacpp (GGUF) and an mlx
    (safetensors) child; without `with_gguf`, the GGUF child is named but not here (a host
    that pulled mlx only). Returns (list bytes, the GGUF child's manifest)."""
    s = TinyStore(root)
    gguf = s.manifest(
        [s.layer("model", gguf_payload), s.layer("template", b"{{ .Prompt }}")],
        {"model_format": "gguf", "model_family": "gemma4", "file_type": "Q4_K_M"},
    )
    mlx = s.manifest(
        [
            s.layer("tensor", b"\x01" * 4096, name="model.norm.weight"),
            s.layer("json", b"{}", name="config.json"),
        ],
        {"model_format": "safetensors", "model_family": "gemma4", "file_type": "int4"},
    )
    lst = s.manifest_list([(gguf, "llamacpp", "gguf"), (mlx, "mlx", "safetensors")])
    s.v2(GEMMA, lst)
    if not with_gguf:
        s.layout.blob(Digest.of_bytes(gguf)).unlink()
        s.layout.blob(Digest.of_bytes(gguf_payload)).unlink()
    return lst, gguf


def shown(mnt: Path) -> str:
    """What the mount's plain tag directory shows: gguf, safetensors, or what else."""
    try:
        files = set(os.listdir(mnt / "gemma4" / "26b"))
    except OSError as exc:
        return f"error {exc.errno}"
    if "model.gguf" in files:
        return "gguf"
    if "model.safetensors" in files:
        return "safetensors"
    return "other " + ",".join(sorted(files))


@fuse
@pytest.mark.slow
def test_failover_keeps_the_preferred_variant_says_behind_and_resumes_from_the_host_back(
    tmp_path: Path,
) -> None:
    """Host 1 holds both children of gemma4:26b's new list, host 3 (prefer = ["mlx"]) only
    the mlx child; host 2 (default prefer: llamacpp) has an older GGUF version. Host 1 is
    killed -9 while host 2 fetches the 40 MiB GGUF through a throttled link: host 2 must not
    take the list from host 3 (its mount would switch to safetensors); it keeps the old
    version, says why it is behind, and once host 1 is back resumes its partial from it."""
    size = 40 * MiB
    block = os.urandom(64 * 1024)
    payload = (block * (size // len(block)))[:size]
    lst, _ = list_store(tmp_path / "h1", payload)
    list_store(tmp_path / "h3", payload, with_gguf=False)
    old = TinyStore(tmp_path / "h2")
    old_raw = old.gguf_model(GEMMA, b"the old gemma weights")
    h2 = tmp_path / "h2"
    new_digest, old_digest = Digest.of_bytes(lst).hex, Digest.of_bytes(old_raw).hex
    blob = Digest.of_bytes(payload).hex
    sidecar = h2 / ".modelfs" / "tmp" / f"pull-sha256-{blob}.json"

    def done_bytes() -> int:
        return partial_bytes(h2, blob)

    port1 = free_port()
    h1_keys = {"store": str(tmp_path / "h1"), "listen": f"127.0.0.1:{port1}", "interval": "1s"}
    fast = {"interval": "1s", "replicate": ["gemma4:*"]}
    proxy = ThrottleProxy(port1, 8e6)
    seen: list[tuple[float, str, str]] = []  # (time, what the mount shows, digest here)
    watching = threading.Event()
    try:
        with (
            daemon(tmp_path, "h1", **h1_keys) as d1,
            daemon(
                tmp_path, "h3", store=str(tmp_path / "h3"), peers=[d1.url], prefer=["mlx"], **fast
            ) as d3,
            mounted(h2, tmp_path / "mnt"),
        ):
            mnt = tmp_path / "mnt"
            assert shown(mnt) == "gguf"

            def watch() -> None:
                while not watching.is_set():
                    digest = {e.name.shortest: e.digest.hex for e in scan_store(h2)}.get(GEMMA)
                    seen.append((time.monotonic(), shown(mnt), digest or "-"))
                    time.sleep(0.1)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            with daemon(tmp_path, "h2", store=str(h2), peers=[proxy.url, d3.url], **fast) as d2:
                wait_until(lambda: done_bytes() > 8 * MiB, 60, "host 2 mid-transfer")
                d1.proc.kill()
                d1.proc.wait()
                killed = time.monotonic()

                def said_why() -> bool:
                    assert seen[-1][1] == "gguf", f"the mount switched: {seen[-1]}"
                    b = d2.status()["daemon"].get("behind", {}).get(GEMMA) or {}
                    return "no peer has the llamacpp variant" in (b.get("error") or "")

                wait_until(said_why, 30, "status to say why gemma4:26b is behind")
                time.sleep(3)  # several more rounds with host 3 alone
                before = done_bytes()
                assert before > 8 * MiB
                assert {e.name.shortest: e.digest.hex for e in scan_store(h2)}[GEMMA] == old_digest
                out = d2.status_cli()
                line = next(x for x in out.splitlines() if x.startswith("behind: gemma4:26b"))
                assert "llamacpp variant" in line and "next try in" in line, out
                assert "no peer has its llamacpp variant" not in d2.text()

                restart = proxy.down_bytes
                with daemon(tmp_path, "h1", **h1_keys):
                    wait_until(
                        lambda: (
                            complete(h2, GEMMA)
                            and scan_store(h2).lookup(GEMMA).digest.hex == new_digest
                        ),
                        90,
                        "the new version on host 2 from host 1 back up",
                    )
                    wait_until(lambda: shown(mnt) == "gguf" and seen[-1][2] == new_digest, 10)
                    assert GEMMA not in d2.status()["daemon"]["behind"]
                # Resumed: what came through after the restart is the rest, not all of it.
                after_restart = proxy.down_bytes - restart
                assert after_restart < size - before + 2 * MiB, (after_restart, before)
                assert not sidecar.exists()
            watching.set()
            watcher.join(10)
    finally:
        watching.set()
        proxy.stop()
    entry = scan_store(h2).lookup(GEMMA)
    assert entry.preferred() is not None and entry.preferred().runner == "llamacpp"  # type: ignore[union-attr]
    assert [v.runner for v in entry.variants] == ["llamacpp"]
    shows = {what for _, what, _ in seen}
    assert shows == {"gguf"}, [s for s in seen if s[1] != "gguf"][:5]
    assert any(t > killed and d == old_digest for t, _, d in seen)


def test_a_small_change_is_not_stuck_behind_large_transfers(tmp_path: Path) -> None:
    """Two large names fetch slowly (2 MB/s each); a small one published meanwhile arrives
    while both are still in flight, and status and metrics show both."""
    origin = TinyStore(tmp_path / "origin")
    raws = [big_model(origin, f"big{i}:1", 16 * MiB, seed=i) for i in (1, 2)]
    faults = [f"throttle=2M@{json.loads(r)['layers'][0]['digest'][7:19]}" for r in raws]
    store = tmp_path / "store"
    with (
        fakepeer(origin.root, *faults) as url,
        daemon(tmp_path, "c", store=str(store), peers=[url], replicate=["*"], interval="1s") as d,
    ):

        def both_in_flight() -> bool:
            transfers = d.status()["daemon"]["transfers"]
            pulling = {t["name"] for t in transfers if t.get("state") == "pulling" and t["bytes"]}
            return pulling == {"big1:1", "big2:1"}

        wait_until(both_in_flight, 30, "both large names in flight")
        metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
        assert "modelfs_transfers_in_flight 2" in metrics
        assert re.search(r'modelfs_transfer_bytes\{name="big1:1"\} [1-9]', metrics), metrics
        origin.gguf_model("small:1", b"a small change")
        wait_until(lambda: complete(store, "small:1"), 20, "the small name")
        assert not complete(store, "big1:1") and not complete(store, "big2:1")
        assert {t["name"] for t in d.status()["daemon"]["transfers"]} == {"big1:1", "big2:1"}
        wait_until(lambda: complete(store, "big1:1") and complete(store, "big2:1"), 60)


def gc_runs(d: object) -> int:
    return int(d.status()["daemon"]["gc"]["runs"])  # type: ignore[attr-defined]


def test_first_gc_is_soon_after_start_and_a_reload_applies_new_intervals_at_once(
    tmp_path: Path,
) -> None:
    """gc.interval and interval of an hour: the first GC still comes within seconds; a
    SIGHUP to a second-long interval makes both loops, asleep for the hour, run again."""
    origin = TinyStore(tmp_path / "origin")
    origin.gguf_model("m:1", b"first")
    store = tmp_path / "store"
    keys = {
        "store": str(store),
        "replicate": ["*"],
        "interval": "1h",
        "gc": {"interval": "1h", "grace": "0s", "grace_below_floor": True},
    }
    with fakepeer(origin.root) as url, daemon(tmp_path, "g", peers=[url], **keys) as d:
        t0 = time.monotonic()
        wait_until(lambda: gc_runs(d) >= 1, 20, "the first GC")
        assert time.monotonic() - t0 < 15
        wait_until(lambda: complete(store, "m:1"), 20, "m:1 from the first listing")
        origin.gguf_model("m:2", b"published after the first listing")
        time.sleep(2)
        assert gc_runs(d) == 1 and not complete(store, "m:2")  # both asleep for the hour
        d.reload(interval="1s", gc={"interval": "1s", "grace": "0s", "grace_below_floor": True})
        wait_until(lambda: gc_runs(d) >= 3, 15, "GC by the new interval")
        wait_until(lambda: complete(store, "m:2"), 15, "m:2 by the new listing interval")


@pytest.mark.slow
def test_back_off_lines_give_the_real_next_try(tmp_path: Path) -> None:
    """A peer that accepts and hangs up: each failure's line says when the next listing
    is, and the next connection comes then (interval 1 s, doubling)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepts: list[float] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepts.append(time.monotonic())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with daemon(
            tmp_path, "b", store=str(tmp_path / "s"), peers=[url], replicate=["*"], interval="1s"
        ) as d:
            wait_until(lambda: len(accepts) >= 5, 40, "five listings")
            said = [
                float(m)
                for m in re.findall(rf"peer {re.escape(url)}: .*next try in ([\d.]+)s", d.text())
            ]
    finally:
        server.close()
    assert said[:4] == [1.0, 2.0, 4.0, 8.0], d.text()
    gaps = [b - a for a, b in itertools.pairwise(accepts)]
    for gap, promised in zip(gaps[:4], said[:4], strict=True):
        assert promised - 0.3 <= gap <= promised + 1.0, (gaps, said)
