"""Peers proven by a pinned TLS certificate (sync.pins): daemons and `modelfs serve`
impostors are separate processes on loopback, with self-signed certificates."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import trio

from modelfs.store.digest import Digest
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.sync.client.peer import peer_session
from modelfs.sync.errors import PeerCertificateError
from modelfs.sync.wire.pins import UNPINNED, pin_of_cert_file
from tests.builders import TinyStore
from tests.test_daemon import (
    MODELFS,
    big_model,
    complete,
    daemon,
    free_port,
    names,
    wait_until,
)
from tests.test_daemon_trust import status_cli
from tests.test_pull_hosts import _env
from tests.test_serve_process import OPENSSL, self_signed, served

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs openssl for the certificates")

TOKEN = "cGlubmVkLXBlZXJzLXNoYXJlLXRoaXMtdG9rZW4=\n"


def certificate(where: Path) -> tuple[Path, Path]:
    where.mkdir(parents=True, exist_ok=True)
    return self_signed(where)


def digests(store: Path) -> dict[str, str]:
    return {e.name.shortest: e.digest.hex for e in scan_store(store)}


def test_print_pin_is_the_sha256_of_the_public_key_as_openssl_computes_it(
    tmp_path: Path,
) -> None:
    """docs/sync.md's openssl pipeline and `modelfs serve --print-pin` agree; a bad file is
    one line."""
    assert OPENSSL is not None
    cert, _ = certificate(tmp_path)
    spki = subprocess.run(
        f"{OPENSSL} x509 -in {cert} -pubkey -noout | {OPENSSL} pkey -pubin -outform der"
        " | sha256sum",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    r = subprocess.run(
        [MODELFS, "serve", "--tls-cert", str(cert), "--print-pin"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"sha256:{spki}\n" == f"{pin_of_cert_file(cert)}\n"
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for args, message in [
        (["--tls-cert", str(junk)], f"{junk}: not a PEM certificate"),
        (["--tls-cert", str(tmp_path / "no.pem")], f"{tmp_path / 'no.pem'}: no such file"),
        ([], "--print-pin needs --tls-cert FILE"),
    ]:
        r = subprocess.run(
            [MODELFS, "serve", *args, "--print-pin"],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(),
        )
        assert r.returncode == 1 and r.stderr.splitlines() == [f"modelfs: error: {message}"], (
            args,
            r.stderr,
        )


def test_both_paths_to_a_peer_refuse_a_certificate_that_is_not_pinned(tmp_path: Path) -> None:
    """The httpx client (listings, manifests, small blobs) and the raw receiver (large
    blobs) take their TLS from the same place: pinned to the server's key, both work;
    pinned to another key, both refuse in the handshake, naming the URL and the reason."""
    store = TinyStore(tmp_path / "store")
    payload = b"blob bytes " * 1000
    store.gguf_model("qwen3:0.6b", payload)
    cert, key = certificate(tmp_path / "server")
    other, _ = certificate(tmp_path / "other")
    digest = Digest.of_bytes(payload)
    name = parse_name("qwen3:0.6b")

    async def fetch(url: str, pin: str) -> tuple[list[str], bytes]:
        async with peer_session(None, pins={url: pin}) as session:
            peer = session.peer(url)
            listed = [n.shortest for n in await peer.models()]

            def raw() -> bytes:
                body = peer.open_range(
                    name, digest, 0, len(payload), len(payload), stop=threading.Event()
                )
                out = bytearray(len(payload))
                view, got = memoryview(out), 0
                while n := body.readinto(view[got:]):
                    got += n
                body.conn.close()
                return bytes(out[:got])

            return listed, await trio.to_thread.run_sync(raw)

    async def refused(url: str, pin: str) -> list[str]:
        errors = []
        async with peer_session(None, pins={url: pin}) as session:
            peer = session.peer(url)
            with pytest.raises(PeerCertificateError) as listing:
                await peer.models()
            errors.append(str(listing.value))

            def raw() -> None:
                peer.open_range(name, digest, 0, 10, len(payload), stop=threading.Event())

            with pytest.raises(PeerCertificateError) as ranged:
                await trio.to_thread.run_sync(raw)
            errors.append(str(ranged.value))
        return errors

    with served(store.root, "--tls-cert", str(cert), "--tls-key", str(key)) as (url, _):
        assert url.startswith("https://")
        listed, body = trio.run(fetch, url, pin_of_cert_file(cert))
        assert listed == ["qwen3:0.6b"] and body == payload
        for error in trio.run(refused, url, pin_of_cert_file(other)):
            assert error.startswith(f"{url}: {UNPINNED} (it presents {pin_of_cert_file(cert)}")
            assert f"the config pins {pin_of_cert_file(other)}" in error


def test_a_pinned_peer_replicates_and_an_impostor_on_its_port_is_refused(tmp_path: Path) -> None:
    """b pins a's certificate. a (HTTPS, a self-signed certificate) replicates to b, a large
    blob (the raw path) included. Then a stops and an impostor takes its port: it holds
    the shared token, so it passes the token proof, but its certificate is another. b
    takes nothing from it (its gemma4 would win otherwise), and says why by name: log,
    status, /metrics, `modelfs status`."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    real, fake = TinyStore(tmp_path / "real"), TinyStore(tmp_path / "fake")
    real.gguf_model("gemma4:26b", b"the real gemma")
    big_model(real, "big:1", 12 << 20)  # above pull's small_max: the fast path
    fake.gguf_model("gemma4:26b", b"an impostor's gemma")
    fake.gguf_model("evil:1", b"only the impostor has this")
    a_cert, a_key = certificate(tmp_path / "a-tls")
    x_cert, x_key = certificate(tmp_path / "x-tls")
    pin = pin_of_cert_file(a_cert)
    listen = f"127.0.0.1:{free_port()}"
    a_url = f"https://{listen}"
    b = tmp_path / "b"
    with (
        daemon(
            tmp_path,
            "a",
            store=str(real.root),
            token_file=str(token),
            listen=listen,
            tls_cert=str(a_cert),
            tls_key=str(a_key),
        ) as a,
        daemon(
            tmp_path,
            "b",
            store=str(b),
            token_file=str(token),
            peers=[{"url": a_url, "pin": pin}],
            replicate=["*"],
            interval="1s",
        ) as d,
    ):
        assert a.url == a_url
        wait_until(lambda: complete(b, "gemma4:26b") and complete(b, "big:1"), what="a's models")
        assert digests(b) == digests(real.root)
        auth = {"Authorization": f"Bearer {TOKEN.strip()}"}
        peers = httpx.get(f"{d.url}/modelfs/v1/status", headers=auth, timeout=10).json()["peers"]
        assert [(p["url"], p["pin"], p["proof"], p["untrusted"]) for p in peers] == [
            (a_url, pin, "pin and token", None)
        ]
        # `modelfs status` of a finds it through its config and trusts it by its own pin.
        r = status_cli("--config", str(a.config))
        assert r.returncode == 0, r.stderr
        assert f"TLS pin: {pin} " in r.stdout, r.stdout

        a.proc.kill()
        a.proc.wait()
        impostor = ("--listen", listen, "--token-file", str(token))
        tls = ("--tls-cert", str(x_cert), "--tls-key", str(x_key))
        with served(fake.root, *impostor, *tls) as (url, _):
            assert url == a_url

            def refused() -> dict[str, object] | None:
                status = httpx.get(f"{d.url}/modelfs/v1/status", headers=auth, timeout=10)
                peer: dict[str, object] = status.json()["peers"][0]
                return peer if peer["untrusted"] else None

            peer = wait_until(refused, what="the impostor refused")
            assert peer["untrusted"] == UNPINNED and not peer["models"] and not peer["ok"]
            presents = f"{UNPINNED} (it presents {pin_of_cert_file(x_cert)}, the config pins {pin})"
            assert str(peer["error"]).startswith(presents), peer
            assert f"peer {a_url}: {UNPINNED}" in d.text()
            metrics = httpx.get(f"{d.url}/metrics", headers=auth, timeout=10).text
            assert f'modelfs_peer_untrusted{{peer="{a_url}",reason="{UNPINNED}"}} 1' in metrics
            assert f'modelfs_peer_up{{peer="{a_url}"}} 0' in metrics
            r = status_cli("--config", str(d.config))
            assert r.returncode == 0, r.stderr
            row = next(line for line in r.stdout.splitlines() if line.strip().startswith(a_url))
            assert row.split()[1:5] == ["UNTRUSTED:", *UNPINNED.split()[:3]], r.stdout
            assert names(b) == {"gemma4:26b", "big:1"}
            assert digests(b) == digests(real.root)


def test_an_unusable_certificate_or_key_is_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    """`modelfs sync` (naming its config's keys) and `modelfs serve` alike: a key that is a
    directory, a key that is not the certificate's, a certificate that is not one."""
    cert, key = certificate(tmp_path / "tls")
    _, other_key = certificate(tmp_path / "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    keydir = tmp_path / "keydir"
    keydir.mkdir()
    cases = [
        (cert, keydir, f"{keydir}: cannot read: Is a directory"),
        (cert, other_key, f"{other_key}: not a usable key for {cert} (KEY_VALUES_MISMATCH)"),
        (junk, key, f"{junk}: not a PEM certificate"),
    ]
    for i, (c, k, message) in enumerate(cases):
        config = tmp_path / f"{i}.toml"
        config.write_text(
            f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\n'
            f'tls_cert = "{c}"\ntls_key = "{k}"\n'
        )
        runs = [
            (["sync", "--config", str(config)], f"{config}: tls_cert, tls_key: {message}"),
            (
                ["serve", "--store", str(tmp_path), "--tls-cert", str(c), "--tls-key", str(k)],
                message,
            ),
        ]
        for args, line in runs:
            r = subprocess.run(
                [MODELFS, *args], capture_output=True, text=True, timeout=30, env=_env()
            )
            errors = [ln for ln in r.stderr.splitlines() if ln.startswith("modelfs: ")]
            assert r.returncode == 1 and errors[-1] == f"modelfs: error: {line}", (args, r.stderr)
            assert "Traceback" not in r.stderr and "listening" not in r.stderr


def test_a_wrong_pin_is_untrusted_until_a_reload_fixes_it(tmp_path: Path) -> None:
    """A pin is reloadable like the peers: b starts with a's address pinned to another key
    (UNTRUSTED, nothing taken), SIGHUP with a's pin, and a's model arrives."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    real = TinyStore(tmp_path / "real")
    real.gguf_model("qwen3:0.6b", b"qwen weights")
    cert, key = certificate(tmp_path / "a-tls")
    other, _ = certificate(tmp_path / "other")
    b = tmp_path / "b"
    tls = {"tls_cert": str(cert), "tls_key": str(key)}
    with daemon(tmp_path, "a", store=str(real.root), token_file=str(token), **tls) as a:
        wrong = [{"url": a.url, "pin": pin_of_cert_file(other)}]
        with daemon(
            tmp_path,
            "b",
            store=str(b),
            token_file=str(token),
            peers=wrong,
            replicate=["*"],
            interval="1s",
        ) as d:
            auth = {"Authorization": f"Bearer {TOKEN.strip()}"}

            def peer() -> dict[str, object]:
                status = httpx.get(f"{d.url}/modelfs/v1/status", headers=auth, timeout=10)
                found: dict[str, object] = status.json()["peers"][0]
                return found

            wait_until(lambda: peer()["untrusted"] == UNPINNED, what="the wrong pin refused")
            assert names(b) == set()
            d.reload(peers=[{"url": a.url, "pin": pin_of_cert_file(cert)}])
            wait_until(lambda: complete(b, "qwen3:0.6b"), what="qwen3 after the reload")
            wait_until(lambda: peer()["ok"], what="a trusted")
            assert peer()["untrusted"] is None
