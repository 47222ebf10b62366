"""A sign-in counts only for this server, and a signed blob URL keeps its expiry and its grant.

Ollama signs `GET,<realm URL>,<body hash>`, the realm URL being the challenge's realm with its
`service`, `scope`, `ts` and `nonce` added (ollama/ollama fb30760 server/auth.go:28-66); the
client here (tests/ollama.py) is that code transcribed. An authorized Ollama host hands such
signatures to every registry it signs in to, so a server that took any of them would let each
of those registries (or anyone on their path) in here. Servers are real `modelfs serve`
processes on loopback.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from modelfs.demo import LLAMA, QWEN, DemoStore
from modelfs.sync.wire.realm import Realm, service_of, split_host
from modelfs.sync.wire.signin import EMPTY_BODY, Access, Refused, SignInRequest
from tests.ollama import OllamaClient
from tests.test_ollama_serve import SERVICE, Server, demo, http, keys_file, ollama, serving

__all__ = ["demo", "ollama"]  # fixtures


def signed_for(client: OllamaClient, origin: str, service: str) -> tuple[str, str]:
    """The token URL and Authorization an Ollama host sends a registry at `origin` whose
    challenge named `service` (auth.go:28-66)."""
    url = client.challenge_url(f"{origin}/modelfs/v1/token", service, "repository:x/y:pull")
    return url, client.sign(f"GET,{url},{EMPTY_BODY}".encode())


def send_as(server: Server, url: str, authorization: str) -> httpx.Response:
    """`url` sent to `server`, Host and all, as an attacker replays what it was given."""
    parts = urlsplit(url)
    return http.get(
        f"{server.url}{parts.path}?{parts.query}",
        headers={"Host": parts.netloc, "Authorization": authorization},
    )


def test_a_signature_for_another_registry_buys_no_token(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    keys = keys_file(tmp_path, ollama)
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as server:
        port = server.hostport.rsplit(":", 1)[1]
        for origin, service, why in (
            # What the key's holder signed for a registry it pulls from.
            ("http://other-registry:8080", "registry.docker.io", "signed for"),
            ("http://other-registry:8080", SERVICE, "signed for"),
            # Our own port on another host: another modelfs host of the fleet.
            (f"http://gpu-02.example:{port}", SERVICE, "signed for"),
            # Our host and port, but another host's service (what a host of the fleet hands
            # out; the address it is reached by may be the same, behind one name).
            (server.url, service_of("gpu-02"), "service"),
            (server.url, "modelfs", "service"),
        ):
            url, auth = signed_for(ollama, origin, service)
            before = len(server.lines("refused"))
            r = send_as(server, url, auth)
            assert r.status_code == 401, (origin, service, r.text)
            assert why in r.json()["errors"][0]["message"], r.text
            refusals = server.lines("refused")
            assert len(refusals) == before + 1, server.log.read_text()
            if why == "signed for":
                assert urlsplit(origin).netloc in refusals[-1], refusals[-1]
        # What it signed for this server, by each name it answers to, still counts.
        for origin in (
            server.url,
            f"http://localhost:{port}",
            f"http://{socket.gethostname()}:{port}",
        ):
            url, auth = signed_for(ollama, origin, SERVICE)
            r = send_as(server, url, auth)
            assert r.status_code == 200, (origin, r.text)
            assert r.json()["token"]


def test_the_challenge_names_this_servers_own_service(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Two hosts of a fleet hand out two services, so what one was signed for fails at the
    other even where their names agree; Ollama's own pull signs what the challenge says."""
    keys = keys_file(tmp_path, ollama)
    with (
        serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as a,
        serving(demo.root, tmp_path, "--authorized-keys", str(keys), "-v") as b,
    ):
        r = http.get(f"{a.url}/v2/library/llama3.2/manifests/3b")
        assert f'service="{SERVICE}"' in r.headers["www-authenticate"]
        ollama.pull(f"{b.hostport}/library/llama3.2:3b", insecure=True)
        sign_in = next(e for e in ollama.log if "/modelfs/v1/token" in e.url)
        assert sign_in.status == 200
        assert parse_qs(urlsplit(sign_in.url).query)["service"] == [SERVICE]
        # B's sign-in, replayed at A by B's name: A is not B.
        r = send_as(a, sign_in.url, sign_in.headers["Authorization"])
        assert r.status_code == 401, r.text
        assert len(a.lines("refused")) == 1


def test_a_public_url_is_a_name_of_this_server(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    """Behind a proxy that ends TLS, Ollama asked `https://models.example` and the request
    comes as plain http with that Host: the signature is over the https URL."""
    keys = keys_file(tmp_path, ollama)
    args = ("--authorized-keys", str(keys), "--public-url", "https://Models.Example/")
    with serving(demo.root, tmp_path, *args) as server:
        r = http.get(
            f"{server.url}/v2/library/llama3.2/manifests/3b", headers={"Host": "models.example"}
        )
        assert 'realm="https://models.example/modelfs/v1/token"' in r.headers["www-authenticate"]
        url, auth = signed_for(ollama, "https://models.example", SERVICE)
        assert send_as(server, url, auth).status_code == 200
        url, auth = signed_for(ollama, "https://models.example:8443", SERVICE)
        assert send_as(server, url, auth).status_code == 401
        url, auth = signed_for(ollama, "http://models.example", SERVICE)
        assert send_as(server, url, auth).status_code == 401


def test_a_bad_public_url_is_one_line(demo: DemoStore, tmp_path: Path) -> None:
    from tests.test_cli import modelfs

    r = modelfs("serve", "--store", str(demo.root), "--public-url", "ftp://x/y")
    assert r.returncode == 1
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        "modelfs: error: --public-url 'ftp://x/y': not an http:// or https:// URL with a host"
    ]
    assert "Traceback" not in r.stderr


def _blob_url(server: Server, demo: DemoStore, model: str = LLAMA) -> str:
    layer = demo.manifest(model).layer("model.gguf")
    return f"{server.url}/v2/library/{model.split(':')[0]}/blobs/{layer.digest}"


def _bearer(client: OllamaClient) -> str:
    entry = next(
        e for e in reversed(client.log) if e.headers.get("Authorization", "").startswith("Bearer ")
    )
    return entry.headers["Authorization"]


def test_a_signed_url_keeps_its_expiry_and_dies_with_its_key(
    demo: DemoStore, tmp_path: Path, ollama: OllamaClient
) -> None:
    keys = keys_file(tmp_path, ollama)
    with serving(demo.root, tmp_path, "--authorized-keys", str(keys)) as server:
        ollama.pull(f"{server.hostport}/library/qwen3:0.6b", insecure=True)
        bearer = _bearer(ollama)
        r = http.get(
            _blob_url(server, demo), headers={"Authorization": bearer, "Range": "bytes=0-0"}
        )
        assert r.status_code == 206
        signed = r.headers["location"]
        query = parse_qs(urlsplit(signed).query)
        assert set(query) == {"expires", "grant", "signature"}
        issued = int(query["expires"][0])
        assert issued <= time.time() + 6 * 3600 + 5
        time.sleep(1.1)  # a fresh URL would now carry a later expiry
        # Every answer to the signed URL gives that same URL back, never a renewed one.
        for method, headers in (("HEAD", {}), ("GET", {"Range": "bytes=0-9"}), ("GET", {})):
            r = http.request(method, server.url + signed, headers=headers)
            assert r.status_code in (200, 206), (method, r.text)
            assert r.headers["location"] == signed, method
        # Its grant is the key: another key's grant, or none, does not match the signature.
        forged = re.sub(r"grant=[^&]+", "grant=static", signed)
        assert http.get(server.url + forged).status_code == 401
        # The key leaves the file: its token and the URL it got both stop working.
        keys.write_text("# nobody\n")
        assert http.get(f"{server.url}/v2/", headers={"Authorization": bearer}).status_code == 401
        before = len(server.lines("refused"))
        r = http.get(server.url + signed, headers={"Range": "bytes=0-9"})
        assert r.status_code == 401
        assert "no longer authorized" in r.json()["errors"][0]["message"]
        assert len(server.lines("refused")) == before + 1
        # Back in the file, the URL is good again, with its old expiry.
        keys_file(tmp_path, ollama)
        r = http.head(server.url + signed)
        assert r.status_code == 200 and r.headers["location"] == signed


def test_a_signed_url_made_for_the_token_file_names_it(demo: DemoStore, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    with serving(demo.root, tmp_path, "--token-file", str(token)) as server:
        r = http.head(_blob_url(server, demo, QWEN), headers={"Authorization": "Bearer t0ken"})
        signed = r.headers["location"]
        assert parse_qs(urlsplit(signed).query)["grant"] == ["static"]
        assert http.head(server.url + signed).headers["location"] == signed
    # Another start, even with the same token, ends what the last one signed.
    with serving(demo.root, tmp_path, "--token-file", str(token)) as server:
        assert http.head(server.url + signed).status_code == 401


# -- the rule itself, in process -------------------------------------------------------------
def test_host_headers_are_read_as_go_writes_url_host() -> None:
    assert split_host("Gpu-01:11500", "http") == ("gpu-01", 11500)
    assert split_host("models.example.", "https") == ("models.example", 443)
    assert split_host("[::1]:8080", "http") == ("::1", 8080)
    assert split_host("models.example", "http") == ("models.example", 80)
    for bad in ("", "user@host", "host:99999", "host/path", "host:port"):
        assert split_host(bad, "http") is None, bad


def test_the_realm_takes_the_reached_address_and_its_own_names_on_the_reached_port() -> None:
    realm = Realm("gpu-01", names=["models.internal"], public_urls=["http://proxy:8080"])
    local = ("10.1.2.3", 11500)
    assert realm.ours("http", "10.1.2.3:11500", local)
    assert realm.ours("http", "[::ffff:10.1.2.3]:11500", local)
    assert realm.ours("http", "MODELS.internal:11500", local)
    assert not realm.ours("http", "localhost:11500", local)  # a remote client's localhost
    assert realm.ours("http", "localhost:11500", ("127.0.0.1", 11500))
    assert realm.ours("http", "localhost:11500", ("::1", 11500))
    assert realm.ours("http", f"{socket.gethostname()}:11500", local)
    assert realm.ours("http", "proxy:8080", local)
    assert not realm.ours("http", "10.1.2.4:11500", local)
    assert not realm.ours("http", "10.1.2.3:11501", local)
    assert not realm.ours("http", "models.internal", local)  # port 80
    assert not realm.ours("http", "other-registry:11500", local)
    assert not realm.ours("http", "localhost:11500", None)
    assert realm.service == "modelfs:gpu-01"
    assert service_of('bad "host"/id') == "modelfs:bad-host-id"


def test_access_refuses_before_the_nonce_is_spent(tmp_path: Path) -> None:
    """A refused signature for another host leaves its nonce unspent: were it spent, an
    attacker could burn a real host's nonces; and one that passes is still taken once."""
    client = OllamaClient(tmp_path / "home")
    keys = keys_file(tmp_path, client)
    access = Access(keys_path=keys, realm=Realm("gpu-01"))
    local = ("127.0.0.1", 11500)
    url, auth = signed_for(client, "http://127.0.0.1:11500", service_of("gpu-01"))
    parts = urlsplit(url)

    def ask(host: str) -> str:
        return access.sign_in(
            SignInRequest("http", host, parts.path, parts.query, auth, "127.0.0.9", local)
        )

    with pytest.raises(Refused, match="bad signature"):
        ask("127.0.0.1:11501")
    assert ask("127.0.0.1:11500")
    with pytest.raises(Refused, match="replayed"):
        ask("127.0.0.1:11500")
    client.close()


def test_the_daemon_config_takes_public_urls(tmp_path: Path) -> None:
    from modelfs.sync.daemon.config import ConfigError, load_config

    path = tmp_path / "config.toml"
    path.write_text('public_urls = ["https://models.example:8443"]\n')
    assert load_config(path).public_urls == ("https://models.example:8443",)
    path.write_text('public_urls = ["https://models.example/v2"]\n')
    with pytest.raises(ConfigError, match=r"public_urls\[0\].*no path"):
        load_config(path)


def test_a_certificates_names_are_names_of_this_server(tmp_path: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from modelfs.sync.registry.serve import server_names

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ignored-when-san")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("models.internal"), x509.IPAddress(ipaddress.ip_address("10.9.8.7"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = tmp_path / "cert.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert server_names("0.0.0.0:11500", pem) == ["models.internal", "10.9.8.7"]
    assert server_names("10.1.1.1:11500", None) == ["10.1.1.1"]
    realm = Realm("gpu-01", names=server_names("[::]:11500", pem))
    assert realm.ours("https", "models.internal:11500", ("10.0.0.1", 11500))
    assert realm.ours("https", "10.9.8.7:11500", ("10.0.0.1", 11500))
    assert not realm.ours("https", "ignored-when-san:11500", ("10.0.0.1", 11500))
