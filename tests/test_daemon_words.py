"""What the sync daemon tells its user, and when: a tokenless daemon is told of `token_file`,
a server's log says what a client sent, a lying peer is avoided "in this try", bytes of an
unfinished blob count as received, and a peer that comes back is listed again within 5 s.
Daemons and peers are real processes on loopback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests import test_daemon as td
from tests.builders import TinyStore
from tests.test_pull_hosts import fakepeer


def test_a_tokenless_daemon_is_told_to_set_token_file_and_the_server_says_none_was_sent(
    tmp_path: Path,
) -> None:
    """b serves with a `token_file`; a has none. a's status says the peer refused it and
    names `token_file` (no `docker login`: b is no registry); b's log says a sent no
    credential, not that it "takes no key sign-in"."""
    token = tmp_path / "token"
    token.write_text("d29yZHMtZm9yLXRoZS1kYWVtb24tdG9rZW4=\n")
    s = TinyStore(tmp_path / "bs")
    s.gguf_model("qwen3:0.6b")
    with (
        td.daemon(tmp_path, "b", store=str(s.root), token_file=str(token)) as b,
        td.daemon(tmp_path, "a", store=str(tmp_path / "as"), peers=[b.url], interval="1s") as a,
    ):
        error = td.wait_until(lambda: a.status()["peers"][0]["error"], what="a's peer error")
        assert "`token_file`" in error and "docker login" not in error, error
        assert "`token_file`" in a.status_cli()
        td.wait_until(lambda: "sign-in from" in b.text(), what="b's log of the refusal")
        assert "refused: no credential sent" in b.text(), b.text()
        assert "takes no key sign-in" not in b.text()


def test_a_lying_peer_is_avoided_in_this_try_and_said_so(tmp_path: Path) -> None:
    origin = TinyStore(tmp_path / "origin")
    raw = td.big_model(origin, "m:1", 12 * td.MiB)
    blob = json.loads(raw)["layers"][0]["digest"]
    store = tmp_path / "store"
    with (
        fakepeer(origin.root, f"flip@{blob[7:19]}#1") as peer,
        td.daemon(
            tmp_path, "v", store=str(store), peers=[peer], replicate=["m:*"], interval="1s"
        ) as d,
    ):
        td.wait_until(lambda: td.complete(store, "m:1"), 60, "m:1 after the lie")
        log = d.text()
        assert f"; not asking {peer} for {blob} again in this try" in log, log
        assert "not using" not in log


def test_bytes_of_an_unfinished_blob_count_as_received(tmp_path: Path) -> None:
    """A peer sends a 32 MiB blob at 6 MB/s: while it is under way, status (JSON and text)
    and /metrics count what has come, not 0 B until the blob is whole."""
    origin = TinyStore(tmp_path / "origin")
    raw = td.big_model(origin, "big:1", 32 * td.MiB)
    digest = json.loads(raw)["layers"][0]["digest"].split(":")[1]
    store = tmp_path / "store"
    keys = {"store": str(store), "interval": "1s", "replicate": ["big:*"]}
    with (
        fakepeer(origin.root, "throttle=6M") as url,
        td.daemon(tmp_path, "r", peers=[url], **keys) as d,
    ):
        td.wait_until(lambda: td.partial_bytes(store, digest) > 8 * td.MiB, 60, "a quarter")
        here = td.partial_bytes(store, digest)
        received = d.status()["peers"][0]["bytes_in"]
        assert here <= received < 32 * td.MiB, (here, received)
        line = next(ln for ln in d.status_cli().splitlines() if url in ln)
        assert " MB received" in line and "0 B received" not in line, line
        metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
        counted = next(
            ln for ln in metrics.splitlines() if ln.startswith("modelfs_peer_bytes_received_total{")
        )
        assert float(counted.split()[-1]) >= here, counted


def test_a_peer_that_comes_back_is_listed_within_5_s_whatever_its_back_off(
    tmp_path: Path,
) -> None:
    """a and b list each other every second. b is killed; a backs off (1, 2, 4, 8, 16 s). b
    starts again on its address and lists a at once: a lists b within 5 s of that, not at
    the end of its 16 s back-off."""
    a_port, b_port = td.free_port(), td.free_port()
    a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
    b_keys = {"store": str(tmp_path / "bs"), "peers": [a_url], "interval": "1s"}
    b_keys["listen"] = f"127.0.0.1:{b_port}"

    def b_ok(a_status: dict[str, object]) -> bool:
        peer = a_status["peers"][0]  # type: ignore[index]
        return bool(peer["ok"] and peer["host_id"] == "b")  # type: ignore[index]

    with td.daemon(
        tmp_path,
        "a",
        store=str(tmp_path / "as"),
        peers=[b_url],
        interval="1s",
        listen=f"127.0.0.1:{a_port}",
    ) as a:
        with td.daemon(tmp_path, "b", **b_keys):
            td.wait_until(lambda: b_ok(a.status()), what="a to list b")
        td.wait_until(lambda: "5 failures in a row" in a.text(), 40, what="a's back-off to 16 s")
        with td.daemon(tmp_path, "b", **b_keys):
            back = time.monotonic()
            td.wait_until(lambda: b_ok(a.status()), 30, what="a to list b again")
            waited = time.monotonic() - back
    assert waited < 5, f"b was listed {waited:.1f} s after it came back"
