"""sync.signin's proofs between sync daemons that share a token: a request's proof is good
for its method, path and query, within the time window, once; a response's proof covers its body.
Pure functions and the server's Access object: the daemons themselves are in
tests/test_daemon_trust.py."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from modelfs.sync.registry.server import RegistryApp
from modelfs.sync.wire import signin
from modelfs.sync.wire.signin import (
    PEER_SCHEME,
    TS_WINDOW,
    Access,
    new_nonce,
    peer_authorization,
    proof_ok,
)
from tests.builders import TinyStore

TOKEN = "c2hhcmVkLWJ5LWV2ZXJ5LWhvc3Q="


def credential(header: str) -> str:
    scheme, _, value = header.partition(" ")
    assert scheme == PEER_SCHEME
    return value


def test_a_request_proof_is_good_for_its_method_and_path_once() -> None:
    access = Access(token=TOKEN)
    header = peer_authorization(TOKEN, "GET", "/v2/library/gemma4/manifests/26b")
    assert TOKEN not in header
    value = credential(header)
    assert not access.peer_request_ok(value, "GET", "/v2/library/gemma4/manifests/other")
    assert not access.peer_request_ok(value, "HEAD", "/v2/library/gemma4/manifests/26b")
    assert access.peer_request_ok(value, "GET", "/v2/library/gemma4/manifests/26b")
    # Once: the same proof again is a replay.
    assert not access.peer_request_ok(value, "GET", "/v2/library/gemma4/manifests/26b")
    # A prefix before /v2/ (a reverse proxy's) is not part of what is proved.
    again = credential(peer_authorization(TOKEN, "GET", "/models/v2/_catalog"))
    assert access.peer_request_ok(again, "GET", "/v2/_catalog")


def test_a_request_proof_covers_the_query() -> None:
    """A listing's `n` and `last` choose what it answers: a proof made for one page is no
    proof for another, nor for the path alone; the query is proved as sent, encoded."""
    target = "/v2/_catalog?n=100&last=library%2Fgemma4"
    value = credential(peer_authorization(TOKEN, "GET", target))
    for other in (
        "/v2/_catalog",
        "/v2/_catalog?n=100",
        "/v2/_catalog?n=1000&last=library%2Fgemma4",
        "/v2/_catalog?n=100&last=library/gemma4",
        "/v2/_catalog?last=library%2Fgemma4&n=100",
    ):
        assert not Access(token=TOKEN).peer_request_ok(value, "GET", other), other
    assert Access(token=TOKEN).peer_request_ok(value, "GET", target)
    # Behind a prefix the query stays what it was.
    again = credential(peer_authorization(TOKEN, "GET", "/models" + target))
    assert Access(token=TOKEN).peer_request_ok(again, "GET", target)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "no-dots",
        "1.2.3.4",
        "x.nonce.mac",
        f"{int(time.time())}.{'n' * 200}.mac",
    ],
)
def test_malformed_request_proofs_are_refused(value: str) -> None:
    assert not Access(token=TOKEN).peer_request_ok(value, "GET", "/v2/_catalog")


def test_another_token_or_an_old_time_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    access = Access(token=TOKEN)
    other = credential(peer_authorization("another-token", "GET", "/v2/_catalog"))
    assert not access.peer_request_ok(other, "GET", "/v2/_catalog")
    assert not Access(token=None, keys_path=None).peer_request_ok(
        credential(peer_authorization(TOKEN, "GET", "/v2/_catalog")), "GET", "/v2/_catalog"
    )
    real_time = time.time
    monkeypatch.setattr(signin.time, "time", lambda: real_time() - TS_WINDOW - 5)
    old = credential(peer_authorization(TOKEN, "GET", "/v2/_catalog"))
    monkeypatch.setattr(signin.time, "time", real_time)
    assert not access.peer_request_ok(old, "GET", "/v2/_catalog")
    # A peer holding the token with a clock this far off is told why, in the server's log.
    assert "set both hosts' clocks" in caplog.text


def test_a_response_proof_covers_the_body() -> None:
    access = Access(token=TOKEN)
    nonce = new_nonce()
    path = "/v2/library/gemma4/manifests/26b"
    proof = access.prove(nonce, path, b'{"the":"manifest"}')
    assert proof_ok(TOKEN, nonce, path, proof, b'{"the":"manifest"}')
    assert not proof_ok(TOKEN, nonce, path, proof, b'{"another":"manifest"}')
    assert not proof_ok(TOKEN, new_nonce(), path, proof, b'{"the":"manifest"}')
    assert not proof_ok("another-token", nonce, path, proof, b'{"the":"manifest"}')
    assert Access(token=None, keys_path=None).prove(nonce, path, b"") is None


async def test_the_server_proves_the_query_it_was_sent(tmp_path: Path) -> None:
    """Through RegistryApp: a proof made for one page of the catalog does not let in a
    request for another."""
    app = RegistryApp(TinyStore(tmp_path / "models").layout, token=TOKEN)
    transport = httpx.ASGITransport(app, client=("10.0.0.9", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as c:
        proof = peer_authorization(TOKEN, "GET", "/v2/_catalog?n=1")
        r = await c.get("/v2/_catalog?n=1000", headers={"Authorization": proof})
        assert r.status_code == 401
        proof = peer_authorization(TOKEN, "GET", "/v2/_catalog?n=1")
        r = await c.get("/v2/_catalog?n=1", headers={"Authorization": proof})
        assert r.status_code == 200
