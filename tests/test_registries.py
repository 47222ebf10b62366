"""Registries as users have them: the token flow, docker's credentials, proxies.

Every server is a process on loopback: tests/tokenregistry.py (a registry that signs clients in
with the Docker/OCI token flow, a CDN host that rejects `Authorization`, 429s),
tests/forwardproxy.py (an HTTP proxy, absolute-form and CONNECT, counting what it carries),
`modelfs serve` with TLS. `modelfs` itself runs as a process where its environment is the
point (HOME, DOCKER_CONFIG, PATH for a credential helper, the proxy variables, stdin).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from modelfs.sync.client.credentials import Logins
from modelfs.sync.client.http import make_client, registry_auth
from modelfs.sync.client.proxies import ProxyRules
from modelfs.sync.client.tokenauth import MAX_EXPIRY
from tests.builders import TinyStore
from tests.test_serve_process import MODELFS, OPENSSL, SKOPEO, read_line, self_signed, served

HERE = Path(__file__).resolve().parent
USER, PASSWORD = "alice", "correct-horse-battery"
PUBLIC, PRIVATE = "someuser/open:1", "private/secret:1"
BIG = 12 << 20  # over pull's small_max: the large-blob receiver carries it


@dataclass
class Proc:
    url: str
    extra: str
    process: subprocess.Popen[bytes]

    def stats(self) -> Any:
        return httpx.get(f"{self.url}/_stats", timeout=10).json()


@contextmanager
def process(script: str, *args: str) -> Iterator[Proc]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = read_line(proc, 20)
        assert line.startswith("READY "), line
        words = line.split()
        yield Proc(words[1], words[2] if len(words) > 2 else "", proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def token_registry(tmp_path: Path, *args: str) -> Iterator[Proc]:
    with process(
        "tokenregistry.py",
        "--dir",
        str(tmp_path / "tokenreg"),
        "--user",
        f"{USER}:{PASSWORD}",
        *args,
    ) as reg:
        yield reg


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> TinyStore:
    store = TinyStore(tmp_path_factory.mktemp("src") / "models")
    store.gguf_model(PUBLIC, payload=os.urandom(BIG))
    store.gguf_model(PRIVATE, payload=os.urandom(BIG))
    return store


def docker_config(where: Path, config: dict[str, Any]) -> dict[str, str]:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    return {"DOCKER_CONFIG": str(where)}


def auths(url: str, password: str = PASSWORD) -> dict[str, Any]:
    host = url.removeprefix("http://")
    token = base64.b64encode(f"{USER}:{password}".encode()).decode()
    return {"auths": {host: {"auth": token}}}


def modelfs(
    *args: str, env: dict[str, str] | None = None, stdin: bytes = b"", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    full.update(env or {})
    r = subprocess.run(
        [MODELFS, *args], input=stdin, capture_output=True, timeout=timeout, env=full, check=False
    )
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())


def push(source: TinyStore, url: str, name: str, env: dict[str, str]) -> None:
    r = modelfs("push", "--store", str(source.layout.root), name, "--to", url, env=env)
    assert r.returncode == 0, r.stderr


def pull(
    store: Path,
    url: str,
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
) -> subprocess.CompletedProcess[str]:
    store.mkdir(parents=True, exist_ok=True)
    return modelfs("pull", "--store", str(store), name, "--from", url, *args, env=env, stdin=stdin)


def same_model(source: TinyStore, store: Path, name: str) -> None:
    """The pulled manifest and every blob it names are the source's bytes."""
    n = parse_name(name)
    src, dst = source.layout, Layout(store)
    raw = src.legacy_manifest(n).read_bytes()
    assert dst.legacy_manifest(n).read_bytes() == raw
    doc = json.loads(raw)
    for layer in [doc["config"], *doc["layers"]]:
        d = layer["digest"].replace(":", "-")
        got = (store / "blobs" / d).read_bytes()
        assert hashlib.sha256(got).hexdigest() == layer["digest"].split(":")[1]


def error_line(stderr: str) -> str:
    [line] = [x for x in stderr.splitlines() if x.startswith("modelfs: error:")]
    return line


# -- the token flow ----------------------------------------------------------------------------
def test_push_and_pull_through_the_token_flow(source: TinyStore, tmp_path: Path) -> None:
    """Push with docker's `auths` (asking `pull,push`), pull the public repository
    anonymously and the private one with credentials; blob GETs go to the CDN host without the
    registry's Authorization; one token per scope serves a whole pull."""
    with token_registry(tmp_path, "--cdn") as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        for name in (PUBLIC, PRIVATE):
            push(source, reg.url, name, creds)
        tokens = reg.stats()["tokens"]
        assert {"repository:someuser/open:pull,push"} <= {s for t in tokens for s in t["scopes"]}
        assert all(t["user"] == USER for t in tokens)

        nobody = docker_config(tmp_path / "empty", {})
        before = len(reg.stats()["tokens"])
        r = pull(tmp_path / "anon", reg.url, PUBLIC, env=nobody)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "anon", PUBLIC)
        stats = reg.stats()
        fetched = stats["tokens"][before:]
        assert len(fetched) == 1 and fetched[0]["user"] is None, fetched
        assert fetched[0]["scopes"] == ["repository:someuser/open:pull"]
        assert stats["cdn"] and not any(c["authorization"] for c in stats["cdn"])

        r = pull(tmp_path / "denied", reg.url, PRIVATE, env=nobody)
        assert r.returncode == 1
        line = error_line(r.stderr)
        host = reg.url.removeprefix("http://")
        assert f"{host} refused repository:private/secret:pull without credentials" in line
        assert f"docker login {host}" in line

        r = pull(tmp_path / "private", reg.url, PRIVATE, "-v", env=creds)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "private", PRIVATE)
        basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        assert "HTTP Request" in r.stderr  # -v: httpx's debug lines are there
        for secret in (PASSWORD, basic):
            assert secret not in r.stderr + r.stdout


def test_wrong_password_is_one_line_without_the_secret(source: TinyStore, tmp_path: Path) -> None:
    with token_registry(tmp_path) as reg:
        env = docker_config(tmp_path / "docker", auths(reg.url, "wrong-password-xyz"))
        r = pull(tmp_path / "dst", reg.url, PRIVATE, "-v", env=env)
        assert r.returncode == 1
        line = error_line(r.stderr)
        assert f"the token service {reg.url}/token refused" in line
        assert f"user '{USER}'" in line and "config.json" in line
        assert "wrong-password-xyz" not in r.stderr + r.stdout
        assert reg.stats()["tokens"][-1] == {"user": USER, "refused": True}


def test_credential_helper_on_path(source: TinyStore, tmp_path: Path) -> None:
    """`credHelpers` names `docker-credential-<name>`, run with `get` and the registry on
    stdin (docker's credential-helper protocol); `credsStore` serves hosts it does not name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    helper = bin_dir / "docker-credential-fake"
    helper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = get ] || exit 3\nread server\necho "$server" >> {calls}\n'
        f'echo \'{{"ServerURL": "\'$server\'", "Username": "{USER}", "Secret": "{PASSWORD}"}}\'\n'
    )
    helper.chmod(0o755)
    with token_registry(tmp_path) as reg:
        host = reg.url.removeprefix("http://")
        push(source, reg.url, PRIVATE, docker_config(tmp_path / "push", auths(reg.url)))
        path = f"{bin_dir}:{os.environ['PATH']}"
        for key, config in (
            ("helpers", {"credHelpers": {host: "fake"}}),
            ("store", {"credsStore": "fake"}),
        ):
            env = {**docker_config(tmp_path / key, config), "PATH": path}
            r = pull(tmp_path / f"dst-{key}", reg.url, PRIVATE, env=env)
            assert r.returncode == 0, r.stderr
            same_model(source, tmp_path / f"dst-{key}", PRIVATE)
        assert calls.read_text().split() == [host, host]  # once per pull, not per request

        env = {**docker_config(tmp_path / "gone", {"credHelpers": {host: "absent"}}), "PATH": path}
        r = pull(tmp_path / "dst-gone", reg.url, PRIVATE, env=env)
        assert r.returncode == 1
        assert "docker-credential-absent" in error_line(r.stderr)
        assert "not found on PATH" in error_line(r.stderr)


def test_identity_token(source: TinyStore, tmp_path: Path) -> None:
    """An `identitytoken` (what `docker login` keeps for OAuth registries) is traded with
    `POST realm` and `grant_type=refresh_token`."""
    with token_registry(tmp_path, "--identity", f"refresh-xyz:{USER}") as reg:
        push(source, reg.url, PRIVATE, docker_config(tmp_path / "push", auths(reg.url)))
        host = reg.url.removeprefix("http://")
        env = docker_config(tmp_path / "id", {"auths": {host: {"identitytoken": "refresh-xyz"}}})
        r = pull(tmp_path / "dst", reg.url, PRIVATE, "-v", env=env)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PRIVATE)
        assert "refresh-xyz" not in r.stderr + r.stdout
        assert reg.stats()["tokens"][-1]["grant"] == "refresh_token"


def test_username_and_password_stdin(source: TinyStore, tmp_path: Path) -> None:
    with token_registry(tmp_path) as reg:
        push(source, reg.url, PRIVATE, docker_config(tmp_path / "push", auths(reg.url)))
        env = docker_config(tmp_path / "empty", {})
        r = pull(
            tmp_path / "dst",
            reg.url,
            PRIVATE,
            "--username",
            USER,
            "--password-stdin",
            env=env,
            stdin=f"{PASSWORD}\n".encode(),
        )
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PRIVATE)
        r = pull(tmp_path / "dst2", reg.url, PRIVATE, "--username", USER, env=env)
        assert r.returncode == 1
        assert "--username and --password-stdin go together" in error_line(r.stderr)


def test_retry_after_and_expired_tokens(source: TinyStore, tmp_path: Path) -> None:
    """Three 429s with `Retry-After: 1` (to GETs: the pull's) are waited out; tokens that
    last 1 s are fetched again as they run out, and the pull goes on."""
    with token_registry(tmp_path, "--throttle", "3", "--expires", "1", "--cdn") as reg:
        push(source, reg.url, PUBLIC, docker_config(tmp_path / "push", auths(reg.url)))
        t0 = time.monotonic()
        r = pull(tmp_path / "dst", reg.url, PUBLIC, env=docker_config(tmp_path / "e", {}))
        elapsed = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PUBLIC)
        stats = reg.stats()
        assert stats["throttled"] == 3
        assert elapsed >= 1  # the three waits overlap: blobs are fetched in parallel
        anonymous = [t for t in stats["tokens"] if t.get("user") is None]
        assert len(anonymous) >= 2  # the first ran out while 429s were waited out


def test_a_token_refused_early_is_renewed_on_every_path(source: TinyStore, tmp_path: Path) -> None:
    """The pull's first token is refused after its one use (the manifest), long before its
    expiry: the blob requests (through httpx and the large-blob receiver) that meet the 401
    share one new token and go on."""
    with token_registry(tmp_path, "--token-uses", "1") as reg:
        push(source, reg.url, PUBLIC, docker_config(tmp_path / "push", auths(reg.url)))
        before = len(reg.stats()["tokens"])
        r = pull(tmp_path / "dst", reg.url, PUBLIC, env=docker_config(tmp_path / "e", {}))
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PUBLIC)
        stats = reg.stats()
        assert len(stats["tokens"]) - before == 2  # the first, and the one shared renewal
        gets = [q for q in stats["requests"] if q[0] == "GET" and "/blobs/" in q[1]]
        # config, model, template, license; each refused once unless it was sent after
        # another request had renewed the token
        assert 4 < len(gets) <= 8


async def test_tokens_for_names_clients_chose_do_not_pile_up(tmp_path: Path) -> None:
    """A mirror asks its upstream a token for each repository a client names, real or not.
    Tokens that ran out are dropped as new ones come (here they last 1 s), and no per-scope
    lock outlives its fetch, so a client naming ever new repositories cannot grow it."""
    with token_registry(tmp_path, "--expires", "1") as reg:
        logins = Logins(docker_config=tmp_path / "no-docker-config")
        async with make_client(logins, proxies=ProxyRules()) as http:
            auth = registry_auth(http)

            async def ask(count: int, prefix: str) -> None:
                for i in range(count):
                    r = await http.get(f"{reg.url}/v2/{prefix}{i}/model/manifests/latest")
                    assert r.status_code == 404, r.text

            await ask(200, "gone")
            assert len(auth._tokens) == 200  # each scope got its own token
            await trio.sleep(1.1)  # they all ran out
            await ask(100, "new")
            assert len(auth._tokens) <= 100
            assert len(auth._fetching) == 0
        assert len(reg.stats()["tokens"]) == 300


async def test_a_token_said_to_last_for_ever_is_kept_a_day_at_most(tmp_path: Path) -> None:
    """`expires_in: Infinity` (JSON to Python's reader) would keep a token, and its cache
    entry, for ever."""
    with token_registry(tmp_path, "--expires", "inf") as reg:
        logins = Logins(docker_config=tmp_path / "no-docker-config")
        async with make_client(logins, proxies=ProxyRules()) as http:
            r = await http.get(f"{reg.url}/v2/someone/model/manifests/latest")
            assert r.status_code == 404, r.text
            ((_, until),) = registry_auth(http)._tokens.values()
            assert until - time.monotonic() <= MAX_EXPIRY


def test_a_retry_after_beyond_the_bound_is_not_waited_for(tmp_path: Path) -> None:
    with token_registry(tmp_path, "--throttle", "100", "--retry-after", "3600") as reg:
        t0 = time.monotonic()
        r = pull(tmp_path / "dst", reg.url, PUBLIC, env=docker_config(tmp_path / "e", {}))
        assert r.returncode == 1
        assert time.monotonic() - t0 < 30
        assert "HTTP 429" in error_line(r.stderr)
        assert "it asks to wait 3600 s; modelfs waits at most 60 s" in error_line(r.stderr)


def test_logins_read_docker_config_as_docker_does(tmp_path: Path) -> None:
    from modelfs.sync.client.credentials import Logins

    config = tmp_path / "config.json"
    basic = base64.b64encode(b"hubuser:hubpass").decode()
    config.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": basic},
                    "ghcr.io": {"username": "me", "password": "pat"},
                    "https://acr.example:5000": {"identitytoken": "refresh-me"},
                    "broken.example": {"auth": "not base64!"},
                }
            }
        )
    )
    logins = Logins(docker_config=config)
    hub = logins.for_registry("registry-1.docker.io")
    assert hub is not None and (hub.user, hub.secret) == ("hubuser", "hubpass")
    ghcr = logins.for_registry("GHCR.io")
    assert ghcr is not None and (ghcr.user, ghcr.secret) == ("me", "pat")
    acr = logins.for_registry("acr.example:5000")
    assert acr is not None and acr.identity_token and "refresh-me" not in acr.who
    assert logins.for_registry("quay.io") is None
    from modelfs.sync.client.credentials import CredentialsError

    with pytest.raises(CredentialsError, match="not base64"):
        logins.for_registry("broken.example")
    assert "hubpass" not in repr(hub) and "hubpass" not in hub.who


def test_challenges_and_scopes() -> None:
    from modelfs.sync.client.tokenauth import parse_challenges, scope_for

    [c] = parse_challenges(
        [
            'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
            'scope="repository:library/x:pull repository:a/b:pull,push",error="invalid_token"'
        ]
    )
    assert c.scheme == "bearer" and c.params["realm"] == "https://auth.docker.io/token"
    assert c.scopes == ["repository:library/x:pull", "repository:a/b:pull,push"]
    [b] = parse_challenges(['Basic realm="Registry Realm"'])
    assert b.scheme == "basic" and b.params == {"realm": "Registry Realm"}
    # Several challenges in one header, or headers joined with ", " (the raw receiver).
    both = 'Bearer realm="https://a.io/token",service="a.io", Basic realm="a, b"'
    for values in (
        [both],
        ['Bearer realm="https://a.io/token",service="a.io"', 'Basic realm="a, b"'],
    ):
        got = [(x.scheme, x.params) for x in parse_challenges(values)]
        assert got == [
            ("bearer", {"realm": "https://a.io/token", "service": "a.io"}),
            ("basic", {"realm": "a, b"}),
        ]
    [n, b2] = parse_challenges(["Negotiate YIIB, Basic realm=plain"])
    assert (n.scheme, n.params, b2.scheme, b2.params) == (
        "negotiate",
        {},
        "basic",
        {"realm": "plain"},
    )
    u = "https://r.io/v2/hf.co/a/b/blobs/sha256:00"
    assert scope_for(u, "GET", False) == "repository:hf.co/a/b:pull"
    assert scope_for(u, "HEAD", True) == "repository:hf.co/a/b:pull,push"
    assert scope_for("https://r.io/v2/a/b/blobs/uploads/xyz?digest=1", "PUT", False) == (
        "repository:a/b:pull,push"
    )
    assert scope_for("https://r.io/v2/_catalog?n=10", "GET", False) == "registry:catalog:*"
    assert scope_for("https://r.io/v2/", "GET", False) is None


@pytest.mark.parametrize("how", ["combined", "split"])
def test_several_challenges_on_every_path(source: TinyStore, tmp_path: Path, how: str) -> None:
    """A registry whose 401 offers Basic first and the token flow after it, in one
    `WWW-Authenticate` or in two: the manifest (httpx) and the large blob (the raw receiver,
    sync.client `_open_range`, which joins repeated headers) both find the Bearer challenge
    and sign in anonymously for the public repository. The first token is refused after one
    use, so the blob requests meet a 401 of their own."""
    with token_registry(tmp_path, "--challenges", how, "--token-uses", "1") as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PUBLIC, creds)
        r = pull(tmp_path / "anon", reg.url, PUBLIC, env=docker_config(tmp_path / "e", {}))
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "anon", PUBLIC)
        blobs = [q for q in reg.stats()["requests"] if "/blobs/sha256:" in q[1]]
        assert blobs and all(kind == "Bearer" for _, _, kind in blobs[-3:]), blobs


@pytest.mark.skipif(SKOPEO is None, reason="needs skopeo")
def test_skopeo_agrees_with_the_token_registry(source: TinyStore, tmp_path: Path) -> None:
    """The test registry speaks the token flow as real clients expect it: skopeo signs in to
    it with the same credentials and reads what modelfs pushed."""
    assert SKOPEO is not None
    with token_registry(tmp_path) as reg:
        push(source, reg.url, PRIVATE, docker_config(tmp_path / "push", auths(reg.url)))
        host = reg.url.removeprefix("http://")
        base = [SKOPEO, "inspect", "--raw", "--tls-verify=false"]
        ref = f"docker://{host}/private/secret:1"
        r = subprocess.run(
            [*base, "--creds", f"{USER}:{PASSWORD}", ref], capture_output=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == source.layout.legacy_manifest(parse_name(PRIVATE)).read_bytes()
        r = subprocess.run([*base, "--no-creds", ref], capture_output=True, timeout=60)
        assert r.returncode != 0


# -- proxies -----------------------------------------------------------------------------------
def test_http_proxy_carries_every_request(source: TinyStore, tmp_path: Path) -> None:
    """With HTTP_PROXY set, the registry's requests, the token service's and the CDN's large
    blob all go through the proxy; with the registry in NO_PROXY, none does."""
    with token_registry(tmp_path, "--cdn") as reg, process("forwardproxy.py") as proxy:
        push(source, reg.url, PUBLIC, docker_config(tmp_path / "push", auths(reg.url)))
        env = {**docker_config(tmp_path / "e", {}), "HTTP_PROXY": proxy.url}
        r = pull(tmp_path / "dst", reg.url, PUBLIC, env=env)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PUBLIC)
        carried = proxy.stats()
        registry, cdn = reg.url.removeprefix("http://"), reg.extra.removeprefix("http://")
        assert carried[registry]["requests"] >= 3  # a 401, the token, manifests
        assert carried[cdn]["bytes"] >= BIG  # the large blob, through the proxy

        env["NO_PROXY"] = "example.com,127.0.0.0/8"
        r = pull(tmp_path / "dst2", reg.url, PUBLIC, env=env)
        assert r.returncode == 0, r.stderr
        assert proxy.stats() == carried


@pytest.mark.skipif(OPENSSL is None, reason="needs openssl")
def test_https_proxy_connect_carries_the_large_blob(source: TinyStore, tmp_path: Path) -> None:
    """An https peer through HTTPS_PROXY: CONNECT tunnels, the large blob inside one."""
    cert, key = self_signed(tmp_path)
    with (
        served(source.layout.root, "--tls-cert", str(cert), "--tls-key", str(key)) as (url, _),
        process("forwardproxy.py") as proxy,
    ):
        env = {"HTTPS_PROXY": proxy.url, "SSL_CERT_FILE": str(cert)}
        r = pull(tmp_path / "dst", url, PUBLIC, env=env)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "dst", PUBLIC)
        carried = proxy.stats()[url.removeprefix("https://")]
        assert carried["connects"] >= 1
        assert carried["bytes"] >= BIG


def test_proxy_rules() -> None:
    from modelfs.sync.client.proxies import ProxyRules

    rules = ProxyRules.from_environment(
        {
            "HTTP_PROXY": "proxy:3128",
            "https_proxy": "http://tls-proxy:8080",
            "NO_PROXY": "internal.example, .corp, 10.0.0.0/8, 127.0.0.1:5000, [::1]",
        }
    )
    assert str(rules.proxy_for("http://registry.io/v2/")) == "http://proxy:3128"
    assert str(rules.proxy_for("https://registry.io/v2/")) == "http://tls-proxy:8080"
    for direct in (
        "http://internal.example/v2/",
        "http://a.internal.example/",
        "https://x.corp/",
        "http://10.1.2.3:5000/",
        "http://127.0.0.1:5000/",
        "http://[::1]:80/",
    ):
        assert rules.proxy_for(direct) is None, direct
    for proxied in ("http://notinternal.example/", "http://127.0.0.1:5001/", "http://11.0.0.1/"):
        assert rules.proxy_for(proxied) is not None, proxied
    assert (
        ProxyRules.from_environment({"HTTP_PROXY": "p:1", "NO_PROXY": "*"}).proxy_for("http://x/")
        is None
    )


def test_serve_names_are_what_skopeo_accepts(tmp_path: Path) -> None:
    """`tags/list` of a mixed-case model answers a lowercase name skopeo takes."""
    if SKOPEO is None:
        pytest.skip("needs skopeo")
    store = TinyStore(tmp_path / "models")
    store.gguf_model("hf.co/Someone/MixedCase-GGUF:Q4_K_M")
    with served(store.layout.root) as (url, _):
        host = url.removeprefix("http://")
        repos = httpx.get(f"{url}/v2/_catalog", timeout=10).json()["repositories"]
        assert repos == ["hf.co/someone/mixedcase-gguf"]
        r = subprocess.run(
            [SKOPEO, "list-tags", "--tls-verify=false", f"docker://{host}/{repos[0]}"],
            capture_output=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["Tags"] == ["Q4_K_M"]


# -- the daemon and verify --repair-from ---------------------------------------------------------
def test_daemon_replicates_a_private_model_with_docker_credentials(
    source: TinyStore, tmp_path: Path
) -> None:
    """The sync daemon lists a token registry's catalog and pulls from it with docker's
    credentials; its status, metrics and log never hold the password."""
    from tests.test_daemon import complete, daemon, wait_until

    with token_registry(tmp_path, "--cdn") as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PRIVATE, creds)
        with daemon(
            tmp_path,
            "b",
            env=creds,
            store=str(tmp_path / "b"),
            peers=[reg.url],
            replicate=["private/*"],
            interval="1s",
        ) as d:
            wait_until(lambda: complete(tmp_path / "b", PRIVATE), what="the private model")
            same_model(source, tmp_path / "b", PRIVATE)
            seen = json.dumps(d.status()) + httpx.get(f"{d.url}/metrics", timeout=10).text
            assert PASSWORD not in seen + d.text()
        assert {"registry:catalog:*"} <= {s for t in reg.stats()["tokens"] for s in t["scopes"]}


def test_verify_repairs_from_a_token_registry(source: TinyStore, tmp_path: Path) -> None:
    with token_registry(tmp_path, "--cdn") as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PRIVATE, creds)
        dst = tmp_path / "dst"
        assert pull(dst, reg.url, PRIVATE, env=creds).returncode == 0
        big = max((dst / "blobs").iterdir(), key=lambda p: p.stat().st_size)
        data = bytearray(big.read_bytes())
        data[100] ^= 0xFF
        big.write_bytes(bytes(data))
        args = ("verify", "--store", str(dst), "--repair-from", reg.url)
        r = modelfs(*args, env=docker_config(tmp_path / "empty", {}))
        assert r.returncode == 1
        assert "refused repository:private/secret:pull without credentials" in r.stdout + r.stderr
        r = modelfs(*args, env=creds)
        assert r.returncode == 0, r.stdout + r.stderr
        same_model(source, dst, PRIVATE)
