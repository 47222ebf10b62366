"""Signing in to registries: the Docker/OCI token flow, Basic, and waiting out 429/503.

    auth = RegistryAuth(logins, token_client, push=False)   an httpx.Auth for every request
    await auth.header(url, method) -> str | None            what to send now (the raw path)
    await auth.answer(url, method, challenges) -> str|None  after a 401 (the raw path)

How a registry is asked (the distribution project's token spec, as docker does it): a request
answered 401 with `WWW-Authenticate: Bearer realm="…",service="…",scope="…"` is sent again with
a token from `GET realm?service=…&scope=…` (Basic with the registry's credentials when there
are any, else anonymously; an identity token is exchanged by `POST realm` with
`grant_type=refresh_token`). The token is kept per realm, service and scope until its
`expires_in` (60 s when the answer gives none) runs out, and every host whose challenge we have
seen gets one before its first request for a scope, so a push's streamed uploads never meet a
401 they could not be sent again after. A push asks for `pull,push` on its repository. A
`Basic` challenge is answered with the registry's user and password. 429 and 503 with
`Retry-After` are waited out while the waits of one request stay under `max_wait`.

Why an `httpx.Auth`: httpx runs it around its redirect handling, so the `Authorization` we add
is on the request to the registry only; httpx strips it when a blob GET is redirected to
another host (a CDN with a signed URL that rejects it), and the same flow retries any request
whose body can be sent again. Tokens are fetched with a client of their own (`token_client`,
the same proxies and TLS), so the large-blob receiver, which speaks HTTP on a socket of its
own, asks the same cache through `header` and `answer`.

A refusal is one line (PeerAuthError) naming the registry, what it refused and whose
credentials it refused; no secret or token is ever in a message or a log line.
"""

from __future__ import annotations

import email.utils
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import trio

from modelfs.runtime.keyedlocks import KeyedLocks
from modelfs.sync.client.credentials import Credentials, CredentialsError, Logins
from modelfs.sync.errors import PeerAuthError, PeerError
from modelfs.sync.wire.protocol import HOST_HEADER
from modelfs.sync.wire.signin import peer_authorization

log = logging.getLogger(__name__)

DEFAULT_EXPIRY = 60.0  # seconds, when the token service gives no `expires_in` (token spec)
MAX_EXPIRY = 86400.0  # the longest a token is kept, whatever `expires_in` says
MAX_WAIT = 60.0  # the most one request waits in all for 429/503 `Retry-After`
MAX_TOKEN = 64 << 10
_PRUNE_TOKENS_AT = 256  # cached tokens past which those that ran out are dropped

_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')
# An auth-scheme (a token, RFC 9110 5.6.2), and the token68 a scheme may carry instead of params.
_SCHEME = re.compile(
    r"[\s,]*([A-Za-z0-9!#$%&'*+.^_`|~-]+)(?:[ \t]+(?![A-Za-z0-9_-]+\s*=)([A-Za-z0-9._~+/-]+=*))?"
)
_REPO_PATH = re.compile(
    r"/v2/(?P<repo>.+?)/(?:manifests/[^/]+|blobs/uploads/.*|blobs/[^/]+|tags/list)$"
)


@dataclass(frozen=True, slots=True)
class Challenge:
    scheme: str  # "bearer" or "basic"
    params: dict[str, str]

    @property
    def scopes(self) -> list[str]:
        return self.params.get("scope", "").split()


def parse_challenges(values: Sequence[str]) -> list[Challenge]:
    """Every challenge of `WWW-Authenticate` headers, in order (RFC 9110 11.6.1): one header
    may list several (`Bearer realm="…",service="…", Basic realm="…"`), and a client that
    joins repeated headers with ", " (the raw receiver, sync.client) gives the same list. An
    auth-param is `name=value` (quoted or not); a word not followed by `=` starts the next
    challenge. The one parser, for httpx's requests and the raw receiver's."""
    out: list[Challenge] = []
    for value in values:
        pos, end = 0, len(value)
        params: dict[str, str] | None = None
        while pos < end:
            m = _PARAM.match(value, pos) if params is not None else None
            if params is not None and m is not None and m.end() > pos:
                quoted = m.group(2)
                text = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else m.group(3)
                params[m.group(1).lower()] = text
                pos = m.end()
                continue
            s = _SCHEME.match(value, pos)
            if s is None or s.end() == pos:
                break  # not a challenge: what came before stands
            params = {}
            out.append(Challenge(s.group(1).lower(), params))
            pos = s.end()
    return out


def retry_delay(
    response: httpx.Response | None, headers: dict[str, str] | None = None
) -> float | None:
    """Seconds a 429/503 asks us to wait (`Retry-After`: seconds or an HTTP date), else None."""
    if response is not None:
        if response.status_code not in (429, 503):
            return None
        value = response.headers.get("retry-after")
    else:
        value = (headers or {}).get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def origin(url: str | httpx.URL) -> str:
    """`host[:port]` of a URL, the key credentials and challenges are kept under."""
    u = urlsplit(str(url))
    host = (u.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{u.port}" if u.port else host


def scope_for(url: str | httpx.URL, method: str, push: bool) -> str | None:
    """The token scope a request needs: `repository:<repo>:pull` (`pull,push` when pushing),
    `registry:catalog:*` for the catalog, None for `/v2/` itself."""
    path = urlsplit(str(url)).path
    if path.endswith("/v2/_catalog"):
        return "registry:catalog:*"
    m = _REPO_PATH.search(path)
    if m is None:
        return None
    writes = push or method.upper() not in ("GET", "HEAD")
    return f"repository:{m.group('repo')}:{'pull,push' if writes else 'pull'}"


def _replayable(request: httpx.Request) -> bool:
    return isinstance(request.stream, httpx.ByteStream)


class RegistryAuth(httpx.Auth):
    """Credentials for every request of one session; see the module docstring."""

    def __init__(
        self,
        logins: Logins,
        token_client: httpx.AsyncClient,
        *,
        push: bool = False,
        max_wait: float = MAX_WAIT,
        peer_token: str | None = None,
    ) -> None:
        self.logins = logins
        self.token_client = token_client
        self.push = push
        self.max_wait = max_wait
        # A sync daemon's peers: every host but `registries` (origins; its PeerSession sets
        # them) gets a proof, made for each request, that we hold `peer_token`
        # (signin.peer_authorization), never the token, and a peer's challenge is never
        # answered with credentials (the 401 stands).
        self.peer_token = peer_token
        self.registries: frozenset[str] = frozenset()
        # In a sync daemon (its PeerSession sets it): a host not in `registries` is a peer,
        # told of in the daemon's words (`token_file`), and told who is asking (`host_id`, in
        # protocol.HOST_HEADER), so that a peer that had us down lists us again at once.
        self.daemon = False
        self.host_id: str | None = None
        self._challenges: dict[str, Challenge] = {}  # origin -> the last challenge seen
        self._tokens: dict[tuple[str, str, tuple[str, ...]], tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._fetching = KeyedLocks[tuple[str, str, tuple[str, ...]]]()

    def sync_auth_flow(
        self, request: httpx.Request
    ) -> Generator[httpx.Request, httpx.Response, None]:
        raise RuntimeError("RegistryAuth works with httpx.AsyncClient only")
        yield request  # pragma: no cover

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        url, method = str(request.url), request.method
        if self.daemon and self.host_id and origin(url) not in self.registries:
            request.headers[HOST_HEADER] = self.host_id
        sent = await self.header(url, method)
        if sent is not None:
            request.headers["Authorization"] = sent
        answered = False
        waited = 0.0
        while True:
            response = yield request
            if response.status_code == 401 and not answered and _replayable(request):
                challenges = parse_challenges(response.headers.get_list("www-authenticate"))
                await response.aread()
                new = await self.answer(url, method, challenges, sent)
                if new is None:
                    return
                request.headers["Authorization"] = sent = new
                answered = True
                continue
            if response.status_code == 401 and answered:
                await response.aread()
                raise self.refused(url, method, response.status_code)
            delay = retry_delay(response)
            if delay is not None and waited + delay <= self.max_wait and _replayable(request):
                await response.aread()
                log.info(
                    "%s: %d, waiting %.1f s as it asks", origin(url), response.status_code, delay
                )
                await trio.sleep(delay)
                waited += delay
                # The token may have run out meanwhile: take a fresh one, and let a 401 be
                # answered again (the waits are bounded, so this ends).
                fresh = await self.header(url, method)
                if fresh is not None:
                    request.headers["Authorization"] = sent = fresh
                answered = False
                continue
            return

    # -- what to send -----------------------------------------------------------------------
    def _peer_token(self, host: str) -> str | None:
        """The token a sync daemon proves to `host`, one of its peers; None for a registry,
        or outside a daemon."""
        return None if host in self.registries else self.peer_token

    async def credentials(self, host: str) -> Credentials | None:
        try:
            return await trio.to_thread.run_sync(self.logins.for_registry, host)
        except CredentialsError as exc:
            raise PeerAuthError(f"{host}: {exc}") from None

    async def header(self, url: str, method: str) -> str | None:
        """The `Authorization` for a request before any 401: a daemon's proof of its token
        to a peer, a token file's, a token for the scope when this host has challenged us
        before, Basic after a Basic challenge."""
        host = origin(url)
        if (token := self._peer_token(host)) is not None:
            # The target as httpx sends it: path and query, percent-encoded as on the wire.
            return peer_authorization(token, method, httpx.URL(url).raw_path.decode("ascii"))
        explicit = self.logins.explicit
        challenge = self._challenges.get(host)
        if challenge is None:
            # A token file is sent as it is, to every peer (the contract of `--token-file`);
            # docker's credentials only when a registry asks for them.
            return explicit.authorization if explicit is not None else None
        if challenge.scheme == "basic":
            creds = await self.credentials(host)
            return creds.authorization if creds is not None and creds.user else None
        scope = scope_for(url, method, self.push)
        return await self._token(host, challenge, [scope] if scope else [])

    async def answer(
        self,
        url: str,
        method: str,
        challenges: Sequence[Challenge],
        sent: str | None = None,
    ) -> str | None:
        """The `Authorization` to send again with after a 401 carrying `challenges`, or None
        when there is nothing better to send than what was sent (`sent`)."""
        host = origin(url)
        if self._peer_token(host) is not None:
            return None  # a peer takes our proof or nothing; no realm it names gets more
        for challenge in challenges:
            realm = challenge.params.get("realm", "")
            if challenge.scheme == "bearer" and realm.startswith(("http://", "https://")):
                self._challenges[host] = challenge
                scopes = self._scopes(url, method, challenge)
                return await self._token(host, challenge, scopes, stale=sent)
        for challenge in challenges:
            if challenge.scheme == "basic":
                self._challenges[host] = challenge
                creds = await self.credentials(host)
                if creds is None or not creds.user or creds.authorization == sent:
                    return None  # the 401 stands; the caller names what it refused
                return creds.authorization
        return None

    def _scopes(self, url: str, method: str, challenge: Challenge) -> list[str]:
        """The challenge's scopes, with `push` added to our repository's when pushing."""
        ours = scope_for(url, method, self.push)
        scopes = challenge.scopes or ([ours] if ours else [])
        if ours is not None and ours.endswith(":pull,push"):
            base = ours.rsplit(":", 1)[0]
            scopes = [ours if s.rsplit(":", 1)[0] == base else s for s in scopes]
            if ours not in scopes:
                scopes.append(ours)
        return scopes

    # -- tokens ---------------------------------------------------------------------------------
    async def _token(
        self, host: str, challenge: Challenge, scopes: list[str], *, stale: str | None = None
    ) -> str:
        """A token for `scopes`: the cached one unless it ran out or is `stale` (the one a
        401 just refused). One fetch per scope at a time: requests that arrive meanwhile
        (a pull's parallel blobs) wait for it and share it."""
        realm = challenge.params["realm"]
        service = challenge.params.get("service", "")
        key = (realm, service, tuple(scopes))
        async with self._fetching.hold(key):
            now = time.monotonic()
            with self._lock:
                cached = self._tokens.get(key)
            if cached is not None and cached[1] > now and cached[0] != stale:
                return cached[0]
            creds = await self.credentials(host)
            token, expires_in = await self._fetch(host, realm, service, scopes, creds)
            header = f"Bearer {token}"
            # Renewed a little before it runs out, so it never expires on the way.
            with self._lock:
                if len(self._tokens) >= _PRUNE_TOKENS_AT:
                    # A mirror asks a scope per repository its clients name, real or not:
                    # tokens that ran out go, so the cache holds what is alive.
                    self._tokens = {k: v for k, v in self._tokens.items() if v[1] > now}
                self._tokens[key] = (header, now + expires_in * 0.9)
            return header

    async def _fetch(
        self,
        host: str,
        realm: str,
        service: str,
        scopes: list[str],
        creds: Credentials | None,
    ) -> tuple[str, float]:
        if not realm.startswith(("http://", "https://")):
            raise PeerError(f"{host}: token realm {realm[:80]!r} is not an http(s) URL")
        what = " ".join(scopes) or "access"
        params: list[tuple[str, str | int | float | bool | None]] = []
        if service:
            params.append(("service", service))
        params += [("scope", s) for s in scopes]
        waited = 0.0
        while True:
            try:
                if creds is not None and creds.identity_token:
                    form = dict(params)
                    form.update(
                        grant_type="refresh_token",
                        refresh_token=creds.secret,
                        client_id="modelfs",
                        scope=" ".join(scopes),
                    )
                    response = await self.token_client.post(realm, data=form)
                else:
                    headers = {}
                    if creds is not None and creds.user:
                        headers["Authorization"] = creds.authorization
                    response = await self.token_client.get(realm, params=params, headers=headers)
            except httpx.TransportError as exc:
                raise PeerError(
                    f"{host}: token service {realm} unreachable ({type(exc).__name__})"
                ) from None
            delay = retry_delay(response)
            if delay is not None and waited + delay <= self.max_wait:
                await trio.sleep(delay)
                waited += delay
                continue
            break
        if response.status_code in (401, 403):
            whose = creds.who if creds is not None else "no credentials"
            raise PeerAuthError(
                f"{host}: the token service {realm} refused {what} for {whose} "
                f"({response.status_code}){self._hint(host, creds)}"
            )
        if not response.is_success:
            raise PeerError(
                f"{host}: token service {realm}: HTTP {response.status_code} for {what}"
            )
        try:
            body = response.json()
            token = body.get("token") or body.get("access_token")
            expires = body.get("expires_in", DEFAULT_EXPIRY)
        except (ValueError, AttributeError, RecursionError):  # nesting deeper than Python's
            token, expires = None, None
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN:
            raise PeerError(f"{host}: token service {realm} answered with no token")
        if any(not (0x21 <= ord(c) <= 0x7E) for c in token):
            raise PeerError(f"{host}: token service {realm} answered with a malformed token")
        expires_in = (
            float(expires) if isinstance(expires, int | float) and expires > 0 else DEFAULT_EXPIRY
        )
        # Bounded (`Infinity` is JSON to Python's reader): a token kept longer is only fetched
        # again sooner, and the cache drops each one some time.
        return token, min(expires_in, MAX_EXPIRY)

    def _hint(self, host: str, creds: Credentials | None) -> str:
        """How to get past a refusal, in the words of where the credential is set: a sync
        daemon's peer takes the `token_file` every host shares; a registry takes docker's
        credentials or the command's options."""
        if self.daemon and host not in self.registries:
            if self.peer_token is None:
                return (
                    "; this daemon has no `token_file`: give it the one its peers share "
                    "(the same token on every host)"
                )
            return "; it holds another token: give every host the same `token_file`"
        if creds is not None:
            return ""
        return (
            f"; give credentials for {host}: `docker login {host}`, "
            "--username with --password-stdin, or --token-file"
        )

    def refused(self, url: str, method: str, status: int) -> PeerAuthError:
        host = origin(url)
        scope = scope_for(url, method, self.push) or "access"
        try:
            creds = self.logins.for_registry(host)
        except CredentialsError:
            creds = None
        whose = f"for {creds.who}" if creds is not None else "without credentials"
        return PeerAuthError(
            f"{method} {url}: {status}, {host} refused {scope} {whose}{self._hint(host, creds)}"
        )
