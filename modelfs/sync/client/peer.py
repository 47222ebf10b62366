"""One peer spoken to over the OCI distribution API: manifests, blob sizes, blob bytes.

    async with peer_session(credentials, read_timeout=30.0) as session:
        client = session.peer(url) -> PeerClient    the only way one is made
        await .manifest(name, ref, expect=None) -> FetchedManifest    verified bytes
        await .blob(name, digest, size) -> bytes                       a small blob, verified
        .open_range(name, digest, start, end, size, stop, conn) -> RangeBody   (blocking)

A `PeerSession` holds one host's credentials (sync.credentials) and the one
`httpx.AsyncClient` made with them; every `PeerClient` comes from a session, so every request
to a peer (listings, manifests, small blobs through httpx, large ones on the raw socket below,
resumes) carries the same credentials. Manifests and small blobs go through that httpx client:
connection pooling, redirects, TLS and every HTTP oddity are httpx's. The bytes of large
blobs do not: `open_range` speaks just enough HTTP/1.1 on a blocking socket to send one
ranged GET (following redirects, keeping the connection alive for the next range) and hands
back a `RangeBody` whose `readinto` receives straight into the caller's buffer, in a worker
thread. Measured on this project's 2-vCPU machine (with tests/fakepeer.py on
loopback): httpx streaming a 1 GiB body plus hashing and writing runs
at 0.1-0.4 GB/s on 3-7 s of CPU, nearly all of it Python-level rechunking in the one
event-loop thread; `recv_into` in a thread runs at the wire's speed on ~0.2 s of CPU per
GiB, which leaves a core for sha256 (sync.fastpath). A response the small client does not
understand (chunked, compressed, no Content-Length) raises `NeedsHttpx`, and the caller
fetches that range with httpx instead.

Every failure is a `sync.errors` class with a one-line message that names the peer's URL:
PeerAuthError (401/403), PeerNotFoundError (404), PeerCertificateError (a pinned peer whose
certificate is another: sync.pins), PeerLiedError (bytes that do not match
the digest, a wrong Content-Length or Content-Range, a body cut short — `TruncatedBodyError`),
PeerUnreachableError (refused, DNS, TLS, timeout, a stall of `read_timeout` seconds),
PeerError (any other status, a broken response).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urljoin

import httpx
import trio

from modelfs.store.digest import Digest
from modelfs.store.errors import InvalidDigestError, InvalidNameError
from modelfs.store.manifest import MAX_MANIFEST_BYTES, MEDIA_LIST
from modelfs.store.names import Name, parse_name
from modelfs.sync.client.credentials import Credentials, Logins
from modelfs.sync.client.http import (
    READ_TIMEOUT,
    USER_AGENT,
    certificate_error,
    make_client,
    mapped_errors,
    raise_for_status,
    read_capped,
    registry_auth,
)
from modelfs.sync.client.partial import Stopped
from modelfs.sync.client.proxies import ProxyRules
from modelfs.sync.client.rawhttp import (
    Conn,
    NeedsHttpx,
    RangeBody,
    StaleConnection,
    TruncatedBodyError,
    parse_head,
    proxy_authorization,
    range_request,
    split_url,
)
from modelfs.sync.client.tokenauth import origin as host_of
from modelfs.sync.client.tokenauth import parse_challenges, retry_delay
from modelfs.sync.errors import (
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    PeerUnprovenError,
    PeerUnreachableError,
)
from modelfs.sync.wire.pins import PeerTls, PinMismatch
from modelfs.sync.wire.protocol import (
    DIGEST_HEADER,
    HOST_HEADER,
    MANIFEST_ACCEPT,
    MAX_HOST_ID,
    NAMES_FIELD,
)
from modelfs.sync.wire.registry_names import repositories
from modelfs.sync.wire.signin import PROOF_HEADER, PROOF_NONCE_HEADER, new_nonce, proof_ok

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT = 10.0
POLL = 0.25  # how often a blocked receive looks at its stop flag
MAX_HEADER = 64 << 10
MAX_REDIRECTS = 10
MAX_PAGES = 10_000
MAX_LISTING_BYTES = 16 << 20  # one page of a catalog or tags list, decoded


@dataclass(frozen=True, slots=True)
class FetchedManifest:
    raw: bytes
    media_type: str
    digest: Digest
    url: str  # the peer it came from

    @property
    def is_list(self) -> bool:
        return self.media_type == MEDIA_LIST


def _next_link(header: str | None, base: str) -> str | None:
    """The `rel="next"` target of a Link header, resolved against the request URL."""
    if not header:
        return None
    for part in header.split(","):
        target, _, params = part.partition(";")
        if 'rel="next"' in params.replace(" ", "") and target.strip().startswith("<"):
            return urljoin(base, target.strip()[1:-1])
    return None


# -- the peer ---------------------------------------------------------------------------------
class PeerSession:
    """One host's credentials, its httpx client and its proxies; made by `peer_session`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        proxies: ProxyRules | None = None,
        proof_token: str | None = None,
        unproved: frozenset[str] = frozenset(),
        tls: PeerTls | None = None,
        daemon_host: str | None = None,
    ) -> None:
        self.http = http
        self.auth = registry_auth(http)
        # A sync daemon's session: its peers are told who asks, and refusals name `token_file`.
        self.auth.daemon = daemon_host is not None
        self.auth.host_id = daemon_host
        self.read_timeout = read_timeout
        self.ssl_context = ssl_context
        self.proxies = proxies if proxies is not None else ProxyRules.from_environment()
        # Peers must prove they hold this token before their listings and manifests are
        # used (signin.proof_ok); `unproved` are registries, which hold no modelfs token.
        self.proof_token = proof_token
        self.unproved = unproved
        # Pinned peers' TLS, shared with the httpx client's transport; `tls.update` on reload.
        self.tls = tls if tls is not None else PeerTls()
        # Blob bytes received from each peer (by URL): of attempts that ended, and live
        # counters of those under way, so a blob half sent counts as far as it came.
        self._received: dict[str, int] = {}
        self._receiving: dict[object, tuple[str, Callable[[], int]]] = {}

    @property
    def unproved(self) -> frozenset[str]:
        return self._unproved

    @unproved.setter
    def unproved(self, urls: Iterable[str]) -> None:
        self._unproved = frozenset(u.rstrip("/") for u in urls)
        # Sent none of the token's proofs either (RegistryAuth keys hosts by origin); set
        # again when a reload changes the registries.
        self.auth.registries = frozenset(host_of(u) for u in self._unproved)

    def peer(self, url: str) -> PeerClient:
        return PeerClient(url, self)

    def received(self, url: str) -> int:
        """Blob bytes received from the peer at `url` so far, blobs finished or not."""
        live = sum(count() for u, count in list(self._receiving.values()) if u == url)
        return self._received.get(url, 0) + live

    def got(self, url: str, n: int) -> None:
        self._received[url] = self._received.get(url, 0) + n

    @contextlib.contextmanager
    def receiving(self, url: str, count: Callable[[], int]) -> Iterator[None]:
        """While in it, `count()` is what has come from `url` of a blob under way."""
        key = object()
        self._receiving[key] = (url, count)
        try:
            yield
        finally:
            del self._receiving[key]
            self.got(url, count())


@contextlib.asynccontextmanager
async def peer_session(
    credentials: Credentials | Logins | None,
    *,
    read_timeout: float = READ_TIMEOUT,
    ssl_context: ssl.SSLContext | None = None,
    push: bool = False,
    proof_token: str | None = None,
    unproved: frozenset[str] = frozenset(),
    pins: Mapping[str, str] | None = None,
    daemon_host: str | None = None,
) -> AsyncIterator[PeerSession]:
    """Where every client of a peer is made: the httpx client signing in with `credentials`
    (a token file, `--username`, or else docker's; sync.tokenauth), and the same sign-in and
    proxies for the raw large-blob receiver. `push` asks registries for `pull,push`. With a
    `proof_token`, every peer but those in `unproved` must prove it holds that token, and
    is sent a proof that we do (never the token); `unproved` (registries) are sent none. A
    peer URL in `pins` must present the certificate its pin names (sync.pins), on both paths.
    `daemon_host`: the session of the sync daemon of that host id."""
    verify: bool | ssl.SSLContext = ssl_context if ssl_context is not None else True
    proxies = ProxyRules.from_environment()
    tls = PeerTls(pins)
    async with make_client(
        credentials,
        read_timeout=read_timeout,
        verify=verify,
        push=push,
        proxies=proxies,
        tls=tls,
        peer_token=proof_token,
    ) as http:
        yield PeerSession(
            http, read_timeout, ssl_context, proxies, proof_token, unproved, tls, daemon_host
        )


def _as_spelled(name: Name, spelled: str | None) -> Name:
    """`name` as the peer's store spells it (NAMES_FIELD), when that is the same model (Ollama
    folds case: the same `key`); else as listed."""
    if spelled:
        try:
            parsed = parse_name(spelled)
        except InvalidNameError:
            return name
        if parsed.key == name.key:
            return parsed
    return name


class PeerClient:
    """A peer at `url` (scheme, host, port and an optional path prefix before `/v2/`), spoken
    to with its session's credentials (`PeerSession.peer` makes it)."""

    def __init__(self, url: str, session: PeerSession) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.http = session.http
        self.read_timeout = session.read_timeout
        self._ssl = session.ssl_context
        self.proof_token = None if self.url in session.unproved else session.proof_token
        self.host_id: str | None = None  # what its last listing named its host (HOST_HEADER)
        self._served: dict[Name, str] = {}  # the repository each name's manifest came from
        split_url(self.url)  # reject a bad URL now

    def repositories(self, name: Name) -> list[str]:
        """`repositories(name, self.url)`, the one that served the name's manifest first."""
        out = repositories(name, self.url)
        served = self._served.get(name)
        return [served, *(r for r in out if r != served)] if served else out

    def _challenge(self, headers: dict[str, str]) -> str | None:
        """Ask the peer for a proof: a fresh nonce in `headers`, returned (None: no proof
        is asked of this peer)."""
        if self.proof_token is None:
            return None
        nonce = new_nonce()
        headers[PROOF_NONCE_HEADER] = nonce
        return nonce

    def _check_proof(
        self, response: httpx.Response, nonce: str | None, what: str, body: bytes
    ) -> None:
        """Before anything in `response` is used: did the peer prove it holds the token, and
        that `body` is what it sent?"""
        if nonce is None or self.proof_token is None:
            return
        path = response.url.raw_path.partition(b"?")[0].decode("latin-1")
        given = response.headers.get(PROOF_HEADER)
        if proof_ok(self.proof_token, nonce, path, given, body):
            return
        why = f"no {PROOF_HEADER}" if not given else f"a wrong {PROOF_HEADER}"
        raise PeerUnprovenError(
            f"{self.url}: not a peer holding the shared token ({why} with {what}); "
            "nothing is taken from it"
        )

    def __repr__(self) -> str:
        return f"PeerClient({self.url!r})"

    def manifest_url(self, repo: str, ref: str) -> str:
        return f"{self.url}/v2/{repo}/manifests/{ref}"

    def blob_url(self, repo: str, digest: Digest) -> str:
        return f"{self.url}/v2/{repo}/blobs/{digest}"

    # -- manifests ----------------------------------------------------------------------------
    async def manifest(
        self, name: Name, ref: str | Digest, *, expect: Digest | None = None
    ) -> FetchedManifest:
        """The manifest (or list) a tag or digest names, its bytes checked against the
        `Docker-Content-Digest` header when there is one and against `expect` when given."""
        ref_text = str(ref)
        what = f"manifest {name.shortest}" if expect is None else f"manifest {ref_text}"
        last: PeerNotFoundError | None = None
        for repo in self.repositories(name):
            try:
                fetched = await self._manifest(repo, ref_text, what, expect)
                self._served[name] = repo
                return fetched
            except PeerNotFoundError as exc:
                last = exc
        assert last is not None
        raise last

    async def _manifest(
        self, repo: str, ref: str, what: str, expect: Digest | None
    ) -> FetchedManifest:
        url = self.manifest_url(repo, ref)
        headers = {"Accept": MANIFEST_ACCEPT}
        nonce = self._challenge(headers)
        with mapped_errors(self.url, what):
            async with self.http.stream("GET", url, headers=headers) as response:
                raise_for_status(response, what)
                declared = response.headers.get("content-length")
                too_big = declared is not None and declared.isdigit()
                if too_big and int(declared or 0) > MAX_MANIFEST_BYTES:
                    raise PeerLiedError(
                        f"{url}: {what} is {declared} bytes, more than a manifest can be"
                    )
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_MANIFEST_BYTES:
                        raise PeerLiedError(f"{url}: {what} is larger than a manifest can be")
                media_type = response.headers.get("content-type", "").split(";")[0].strip()
                header_digest = response.headers.get(DIGEST_HEADER)
        raw = bytes(body)
        self._check_proof(response, nonce, what, raw)
        digest = Digest.of_bytes(raw)
        if header_digest:
            try:
                claimed: Digest | None = Digest.parse(header_digest.strip())
            except InvalidDigestError:
                claimed = None
            if claimed is None or claimed != digest:
                raise PeerLiedError(
                    f"{url}: {what} hashes to {digest}, but {DIGEST_HEADER} says "
                    f"{header_digest.strip()[:80]}"
                )
        if expect is not None and digest != expect:
            raise PeerLiedError(f"{url}: {what} hashes to {digest}, not {expect}")
        return FetchedManifest(raw, media_type, digest, self.url)

    # -- listings ------------------------------------------------------------------------------
    async def _pages(
        self, path: str, key: str, what: str, spelled: list[str | None] | None = None
    ) -> list[str]:
        """Every item of a paginated listing (`Link: <…>; rel="next"`), in the peer's order;
        into `spelled`, in step, what a modelfs peer's NAMES_FIELD gives for each (else None)."""
        url: str | None = f"{self.url}{path}"
        items: list[str] = []
        for _ in range(MAX_PAGES):
            if url is None:
                break
            headers: dict[str, str] = {}
            nonce = self._challenge(headers)
            with mapped_errors(self.url, what):
                async with self.http.stream("GET", url, headers=headers) as response:
                    raise_for_status(response, what)
                    raw = await read_capped(response, MAX_LISTING_BYTES, f"{url}: {what}")
            self._check_proof(response, nonce, what, raw)
            named = response.headers.get(HOST_HEADER, "")
            if named and len(named) <= MAX_HOST_ID and named.isprintable():
                self.host_id = named
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # nested deeper than Python reads, too
                raise PeerError(f"{url}: {what}: not JSON") from None
            page = body.get(key) if isinstance(body, dict) else None
            if page is None:
                page = []  # a registry answers `"tags": null` for a repository without tags
            if not isinstance(page, list) or not all(isinstance(x, str) for x in page):
                raise PeerError(f"{url}: {what}: not a list of strings")
            items += page
            if spelled is not None:
                names = body.get(NAMES_FIELD) if isinstance(body, dict) else None
                ok = isinstance(names, list) and len(names) == len(page)
                spelled += [n if ok and isinstance(n, str) else None for n in names or page]
            url = _next_link(response.headers.get("link"), str(response.url))
        return items

    async def catalog(self) -> list[str]:
        return await self._pages("/v2/_catalog?n=1000", "repositories", "the catalog")

    async def tags(self, repo: str, spelled: list[str | None] | None = None) -> list[str]:
        return await self._pages(f"/v2/{repo}/tags/list?n=1000", "tags", f"tags of {repo}", spelled)

    async def models(self) -> list[Name]:
        """Every model the peer lists (catalog, then tags); repositories that are no Ollama
        name are skipped, with a debug line."""
        from modelfs.sync.wire.protocol import name_from_repository
        from modelfs.sync.wire.registry_names import name_for

        names: list[Name] = []
        for repo in await self.catalog():
            spelled: list[str | None] = []
            tags = await self.tags(repo, spelled)
            for tag, as_spelled in zip(tags, spelled, strict=True):
                try:
                    name = name_for(repo, tag)
                except InvalidNameError:
                    try:
                        # A name with no OCI form (a leading `_`): a modelfs peer lists it
                        # lowercased.
                        name = name_from_repository(repo, tag)
                    except InvalidNameError as exc:
                        log.debug("%s: skipping %s:%s (%s)", self.url, repo, tag, exc)
                        continue
                names.append(_as_spelled(name, as_spelled))
        return names

    # -- small blobs ----------------------------------------------------------------------------
    async def blob(self, name: Name, digest: Digest, size: int) -> bytes:
        """A whole blob in memory (meant for small ones), checked for length and sha256."""
        last: PeerNotFoundError | None = None
        for repo in self.repositories(name):
            try:
                return await self._blob(repo, digest, size)
            except PeerNotFoundError as exc:
                last = exc
        assert last is not None
        raise last

    async def _blob(self, repo: str, digest: Digest, size: int) -> bytes:
        url = self.blob_url(repo, digest)
        what = f"blob {digest}"
        h = hashlib.sha256()
        body = bytearray()
        try:
            with mapped_errors(self.url, what):
                async with self.http.stream("GET", url) as response:
                    raise_for_status(response, what)
                    encoded = response.headers.get("content-encoding", "identity")
                    declared = response.headers.get("content-length")
                    plain = encoded in ("", "identity")
                    if plain and declared is not None and declared.strip() != str(size):
                        raise PeerLiedError(
                            f"{url}: Content-Length {declared.strip()[:20]} for {what}, "
                            f"which is {size} bytes"
                        )
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > size:
                            raise PeerLiedError(f"{url}: more than {size} bytes for {what}")
        except PeerError as exc:
            # httpx reports a body cut short as a protocol error; for a blob that is a peer
            # sending less than it promised.
            if "incomplete" in str(exc).lower() or "peer closed" in str(exc).lower():
                raise TruncatedBodyError(
                    f"{url}: truncated body ({len(body)} of {size} bytes) while fetching {what}"
                ) from None
            raise
        if len(body) != size:
            raise TruncatedBodyError(
                f"{url}: truncated body ({len(body)} of {size} bytes) while fetching {what}"
            )
        h.update(body)
        if h.hexdigest() != digest.hex:
            raise PeerLiedError(f"{url}: {what} arrived with sha256 {h.hexdigest()}")
        return bytes(body)

    # -- large blobs: one ranged GET on a blocking socket ---------------------------------------
    def open_range(
        self,
        name: Name,
        digest: Digest,
        start: int,
        end: int,
        size: int,
        *,
        stop: threading.Event,
        conn: Conn | None = None,
    ) -> RangeBody:
        """Send `GET …/blobs/<digest>` for bytes [start, end) and return the open body: a
        206 of that range, or a 200 of the whole blob (`RangeBody.whole`, at offset 0) from a
        peer that ignores Range.

        Blocking; call it in a worker thread. `conn` is a kept-alive connection from the
        previous range, used when it goes to the same host.
        """
        last: PeerNotFoundError | None = None
        for repo in self.repositories(name):
            try:
                return self._open_range(repo, digest, start, end, size, stop, conn)
            except PeerNotFoundError as exc:
                last, conn = exc, None
        assert last is not None
        raise last

    def _open_range(
        self,
        repo: str,
        digest: Digest,
        start: int,
        end: int,
        size: int,
        stop: threading.Event,
        conn: Conn | None,
    ) -> RangeBody:
        url = self.blob_url(repo, digest)
        what = f"blob {digest}"
        auth = True
        origin = split_url(url)[1:3]
        signin = self.session.auth
        authorization = _from_trio(signin.header, url, "GET")
        answered = False
        waited = 0.0
        redirects = 0
        while redirects <= MAX_REDIRECTS:
            scheme, host, port, _ = split_url(url)
            key = (scheme, host, port)
            if conn is not None and conn.key != key:
                conn.close()
                conn = None
            if conn is None:
                conn = self._connect(key, what)
            try:
                try:
                    request = range_request(conn, url, start, end, authorization if auth else None)
                    status, headers = self._exchange(conn, request, url, what, stop)
                except StaleConnection:
                    # A kept-alive connection the server had closed: once more, on a new one,
                    # signed anew (a peer takes each proof of the token once).
                    conn.close()
                    conn = self._connect(key, what)
                    if auth:
                        authorization = _from_trio(signin.header, url, "GET")
                    request = range_request(conn, url, start, end, authorization if auth else None)
                    status, headers = self._exchange(conn, request, url, what, stop)
            except BaseException:
                conn.close()
                raise
            if status == 401 and auth:
                # The token ran out, or this host has not challenged us yet: sign in and ask
                # again, once (the small body of the 401 is not worth reading).
                conn.close()
                conn = None
                if answered:
                    raise signin.refused(url, "GET", status)
                challenges = parse_challenges([headers.get("www-authenticate", "")])
                authorization = _from_trio(signin.answer, url, "GET", challenges, authorization)
                if authorization is None:
                    refused = httpx.Response(status, request=httpx.Request("GET", url))
                    raise_for_status(refused, what)
                answered = True
                continue
            delay = retry_delay(None, headers) if status in (429, 503) else None
            if delay is not None and waited + delay <= signin.max_wait:
                conn.close()
                conn = None
                log.info("%s: %d, waiting %.1f s as it asks", self.url, status, delay)
                if stop.wait(delay):
                    raise Stopped()
                waited += delay
                if auth:  # the token may have run out meanwhile (as in RegistryAuth's flow)
                    authorization = _from_trio(signin.header, url, "GET")
                    answered = False
                continue
            keep = headers.get("connection", "").lower() != "close"
            if status in (301, 302, 303, 307, 308) and "location" in headers:
                # The small body of a redirect is not worth reading; a new connection follows.
                conn.close()
                conn = None
                url = urljoin(url, headers["location"])
                # Never send our token to another host (a registry's storage redirect); on
                # the same host, what is sent is made for the new path (a peer's proof is).
                auth = auth and split_url(url)[1:3] == origin
                if auth:
                    authorization = _from_trio(signin.header, url, "GET")
                redirects += 1
                continue
            if status not in (200, 206):
                conn.close()
                raise_for_status(httpx.Response(status, request=httpx.Request("GET", url)), what)
            te = headers.get("transfer-encoding", "").lower()
            ce = headers.get("content-encoding", "identity").lower()
            length = headers.get("content-length")
            if te not in ("", "identity") or ce not in ("", "identity") or length is None:
                conn.close()
                raise NeedsHttpx(f"{url}: transfer-encoding {te!r}, content-encoding {ce!r}")
            try:
                declared = int(length)
            except ValueError:
                conn.close()
                raise PeerLiedError(f"{url}: bad Content-Length {length[:20]!r}") from None
            want = end - start
            if status == 206:
                expect_range = f"bytes {start}-{end - 1}/{size}"
                got_range = headers.get("content-range", "")
                if got_range.replace(" ", "") != expect_range.replace(" ", "") and not (
                    got_range.endswith("/*")
                    and got_range.rsplit("/", 1)[0].replace(" ", "")
                    == expect_range.rsplit("/", 1)[0].replace(" ", "")
                ):
                    conn.close()
                    raise PeerLiedError(
                        f"{url}: asked for {expect_range} of {what}, got "
                        f"Content-Range {got_range[:60]!r}"
                    )
                if declared != want:
                    conn.close()
                    raise PeerLiedError(
                        f"{url}: Content-Length {declared} for a {want}-byte range of {what}"
                    )
            elif declared != size:
                conn.close()
                raise PeerLiedError(
                    f"{url}: Content-Length {declared} for {what}, which is {size} bytes"
                )
            # A 200 is the whole blob whatever was asked for: the caller skips to `start`.
            return RangeBody(
                conn,
                want if status == 206 else size,
                url=url,
                what=what,
                stop=stop,
                read_timeout=self.read_timeout,
                keep_alive=keep,
                pos=start if status == 206 else 0,
                whole=status == 200,
            )
        raise PeerError(f"{self.url}: more than {MAX_REDIRECTS} redirects for {what}")

    def _connect(self, key: tuple[str, str, int], what: str) -> Conn:
        """A connection to `key`'s host, or through the proxy the environment names for it
        (sync.proxies: the same rule the httpx client follows)."""
        scheme, host, port = key
        where = f"{scheme}://{host}:{port}"
        proxy = self.session.proxies.proxy_for(where)
        if proxy is not None and proxy.scheme != "http":
            # A TLS connection to the proxy itself: httpx does that, at its own pace.
            raise NeedsHttpx(f"{proxy.scheme} proxy for {where}")
        dial = (host, port) if proxy is None else (proxy.host, proxy.port or 80)
        dialled = where if proxy is None else f"proxy {proxy.host}:{proxy.port or 80}"
        try:
            sock = socket.create_connection(dial, timeout=CONNECT_TIMEOUT)
        except socket.gaierror as exc:
            raise PeerUnreachableError(
                f"{self.url}: cannot resolve {dial[0]} ({exc.strerror})"
            ) from None
        except TimeoutError:
            raise PeerUnreachableError(
                f"{self.url}: timed out connecting to {dialled} while fetching {what}"
            ) from None
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            via = "" if proxy is None else f" to {dialled}"
            raise PeerUnreachableError(f"{self.url}: cannot connect{via} ({reason})") from None
        proxy_auth = proxy_authorization(proxy)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            if proxy is not None and scheme == "https":
                self._tunnel(sock, host, port, proxy_auth, dialled)
            if scheme == "https":
                context = (
                    self.session.tls.context_for(scheme, host, port)
                    or self._ssl
                    or ssl.create_default_context()
                )
                sock = context.wrap_socket(sock, server_hostname=host)
            sock.settimeout(POLL)
        except PinMismatch as exc:
            sock.close()
            raise certificate_error(self.url, exc) from None
        except ssl.SSLError as exc:
            sock.close()
            raise PeerUnreachableError(f"{self.url}: TLS failed ({exc.reason or exc})") from None
        except OSError as exc:
            sock.close()
            raise PeerUnreachableError(f"{self.url}: cannot connect ({exc.strerror})") from None
        except BaseException:
            sock.close()
            raise
        forward = proxy is not None and scheme == "http"
        return Conn(sock, key, forward=forward, proxy_authorization=proxy_auth if forward else None)

    def _tunnel(
        self, sock: socket.socket, host: str, port: int, proxy_auth: str | None, proxy: str
    ) -> None:
        """`CONNECT host:port` through an http proxy (the socket is still blocking)."""
        target = f"{f'[{host}]' if ':' in host else host}:{port}"
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}", f"User-Agent: {USER_AGENT}"]
        if proxy_auth:
            lines.append(f"Proxy-Authorization: {proxy_auth}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            if len(buf) > MAX_HEADER:
                raise PeerError(f"{self.url}: {proxy}: CONNECT answer over {MAX_HEADER} bytes")
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                raise PeerUnreachableError(f"{self.url}: {proxy}: no answer to CONNECT") from None
            if not chunk:
                raise PeerUnreachableError(f"{self.url}: {proxy} closed the CONNECT")
            buf += chunk
        try:
            status, _ = parse_head(buf[: buf.index(b"\r\n\r\n")])
        except ValueError as exc:
            raise PeerError(f"{self.url}: {proxy}: broken CONNECT answer ({exc})") from None
        if status == 407:
            raise PeerAuthError(f"{self.url}: {proxy} refused CONNECT to {target} (407)")
        if status != 200:
            raise PeerUnreachableError(
                f"{self.url}: {proxy} refused CONNECT to {target} (HTTP {status})"
            )

    def _exchange(
        self, conn: Conn, request: bytes, url: str, what: str, stop: threading.Event
    ) -> tuple[int, dict[str, str]]:
        reused, conn.used = conn.used, True
        try:
            conn.sock.sendall(request)
        except OSError as exc:
            if reused:
                raise StaleConnection() from None
            raise PeerUnreachableError(
                f"{self.url}: connection lost while asking for {what} ({exc.strerror})"
            ) from None
        buf = conn.buffered
        idle_since = time.monotonic()
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEADER:
                raise PeerError(f"{url}: response headers over {MAX_HEADER} bytes")
            if stop.is_set():
                raise Stopped()
            try:
                chunk = conn.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                if time.monotonic() - idle_since > self.read_timeout:
                    raise PeerUnreachableError(
                        f"{self.url}: timed out waiting for an answer while fetching {what}"
                    ) from None
                continue
            except OSError as exc:
                if reused and not buf:
                    raise StaleConnection() from None
                raise PeerError(
                    f"{self.url}: broken response while fetching {what} ({exc.strerror})"
                ) from None
            if not chunk:
                if reused and not buf:
                    raise StaleConnection()
                raise PeerError(f"{self.url}: connection closed without an answer for {what}")
            buf += chunk
        head = bytes(buf[:end])
        del buf[: end + 4]
        try:
            return parse_head(head)
        except ValueError as exc:
            raise PeerError(f"{self.url}: broken response while fetching {what} ({exc})") from None


def _from_trio(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """Run the async `fn` in the trio loop from the worker thread the raw receiver runs in
    (the sign-in's token cache and token client live there)."""
    return trio.from_thread.run(fn, *args)
