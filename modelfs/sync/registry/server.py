"""The read-only OCI distribution server over one store, as a plain ASGI app.

    RegistryApp(layout, token=None, prefer=DEFAULT_PREFER)    an ASGI 3 callable

Endpoints (every one behind the same access rule, see `RegistryApp.check_access`):

    GET       /v2/                                  {} and Docker-Distribution-API-Version
    GET|HEAD  /v2/<repo>/manifests/<tag|digest>     manifest bytes, byte for byte
    GET|HEAD  /v2/<repo>/blobs/<digest>             blob bytes, one Range, optional zstd
    GET       /v2/_catalog?n=&last=                 {"repositories": [...]}
    GET       /v2/<repo>/tags/list?n=&last=         {"name": repo, "tags": [...],
                                                     "modelfs.names": [...]}
    GET       /modelfs/v1/status                    JSON: host, store, counts, uptime, traffic
    GET       /modelfs/v1/token                     a short-lived bearer token (sync.signin)
    GET       /metrics                              Prometheus text format

`<repo>` is `<ns>/<model>` on the default host and `<host>/<ns>/<model>` otherwise. Every
name and digest in a URL is validated before it is used, and only a validated digest is ever
turned into a path (`blobs/sha256-<64 hex>`), so no URL can reach a file outside `blobs/`.

The app serves from a `StoreIndex` snapshot that it rebuilds in a worker thread when
`store_signature` changes, looked at no more than once per `refresh_interval` and only when a
request comes in: a pull, `ollama rm` or re-tag shows within about a second, without restart.

Choices a client can see:
- A tag naming a manifest list is answered with the list only when `Accept` names the list
  type; otherwise with the preferred present child (by `prefer`), as Ollama's registry gives
  old clients something runnable. By digest, any manifest the store holds is served as is.
- Blobs are content-addressed, so any valid `<repo>` reaches any blob that is present: a
  regular file (never a symlink) under its canonical name, not the file `modelfs verify` put
  in quarantine (it moves corrupt blobs out of blobs/), and exactly as
  long as the manifests that name it say. Scoping blobs by repository would protect nothing
  the single access rule does not already protect.
- One `Range` (`a-b`, `a-`, `-n`) gets a 206; an unsatisfiable or malformed `bytes=` range a
  416; several ranges or another unit are ignored (the whole blob, 200), as RFC 9110 allows.
- `Accept-Encoding: zstd` compresses text-like layers (template, license, params, json, …,
  configs and manifests) on a whole GET only; never weights, ranges or HEAD answers, whose
  Content-Length a client takes as the blob's size.
- Every 200/206 blob answer carries a `Location` that reads the same blob: the path itself
  when only loopback is served, else a signed, expiring URL of it. Ollama's downloader reads
  it and sends its ranged parts there without Authorization (ollama/ollama fb30760
  server/download.go:267-270, 340-345); other clients ignore a Location on a 200.
- Ollama can only name `<ns>/<model>` on a host (server/images.go:1273). A manifest request
  from Ollama (User-Agent `ollama/`, images.go:1392) for such a name that the default host
  does not hold gets the same `<ns>/<model>:<tag>` of the one other host that holds it
  (`hf.co/bartowski/x:Q4` as `HOST:PORT/bartowski/x:Q4`); none or several: a 404.
- Read-only: any other method is a 405 `UNSUPPORTED`.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote_to_bytes, urlencode

import trio
import zstandard

from modelfs.runtime.groups import unwrapped
from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_fd
from modelfs.store.errors import (
    BlobError,
    CorruptBlobError,
    InvalidDigestError,
    InvalidNameError,
    ManifestError,
    MissingBlobError,
    ModelNotFoundError,
    StoreError,
)
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    LAYER_PREFIX,
    MAX_MANIFEST_BYTES,
    MEDIA_CONFIG,
    MEDIA_LIST,
    Manifest,
    ManifestList,
    parse_manifest,
)
from modelfs.store.names import Name
from modelfs.store.scan import DEFAULT_PREFER, ScanCache, StoreIndex, scan_store
from modelfs.store.watch import store_signature
from modelfs.sync.errors import SyncError
from modelfs.sync.registry.zerocopy import ZEROCOPY
from modelfs.sync.wire.protocol import (
    API_VERSION_HEADER,
    DIGEST_HEADER,
    HOST_HEADER,
    MAX_HOST_ID,
    NAMES_FIELD,
    name_from_repository,
)
from modelfs.sync.wire.realm import Realm
from modelfs.sync.wire.registry_names import RegistryNameError, repository_for
from modelfs.sync.wire.signin import (
    MAX_NONCE,
    PEER_SCHEME,
    PROOF_HEADER,
    PROOF_NONCE_HEADER,
    STATIC_GRANT,
    TOKEN_PATH,
    Access,
    Refused,
    SignInRequest,
    proof_path,
)

if TYPE_CHECKING:
    from modelfs.sync.mirror.mirror import BlobFetch, Mirror

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# One Prometheus metric: name (after `modelfs_`), type, help, and (labels, value) samples.
MetricFamily = tuple[str, str, str, list[tuple[str, float]]]

VERSION = "0.1"
# One read and one ASGI message per chunk: big enough that per-message costs vanish against
# the copy, small enough that a page-cache miss does not stall the send for long.
CHUNK = 4 << 20
SMALL_BLOB = 256 << 10  # read whole while opening: one thread hop for a small layer
MAX_PATH = 2048  # bytes of raw path; the longest valid manifest URL is ~630
MAX_TOKEN = 4096
MAX_PAGE = 10_000
REFRESH_INTERVAL = 1.0
# zstd: only for text-like layers a client asks it for, small enough to compress in one go,
# and only when it saves a tenth; results are kept for the next client.
ZSTD_LEVEL = 3
ZSTD_MIN = 1024
ZSTD_MAX = 64 << 20
ZSTD_CACHE = 64 << 20
COMPRESSIBLE_KINDS = frozenset(
    {"template", "prompt", "system", "params", "messages", "license", "json"}
)
JSON = "application/json"
OCTETS = "application/octet-stream"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ_ONLY_METHODS = ("GET", "HEAD")
KNOWN_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "PATCH", "DELETE", "OPTIONS"})
_DIGITS = re.compile(r"[0-9]{1,19}")
_HOST_HEADER = re.compile(r"[A-Za-z0-9._:\[\]%-]{1,300}")
_SCOPE_REPO = re.compile(r"[A-Za-z0-9._:/-]{1,500}")
OLLAMA_AGENT = "ollama/"  # images.go:1392 sets `ollama/<version> (<arch> <os>) Go/<go>`
_MEDIA_TYPE = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
)


# -- errors ----------------------------------------------------------------------------------
class HTTPError(Exception):
    """An answer that is not a success: status, OCI error code and a one-line message."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = list(headers)


def error_status(exc: BaseException) -> HTTPError:
    """The one mapping from what handlers raise to an HTTP status and OCI error code."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidNameError):
        return HTTPError(400, "NAME_INVALID", str(exc))
    if isinstance(exc, InvalidDigestError):
        return HTTPError(400, "DIGEST_INVALID", str(exc))
    if isinstance(exc, ModelNotFoundError | ManifestError):
        return HTTPError(404, "MANIFEST_UNKNOWN", str(exc))
    if isinstance(exc, BlobError):
        # Missing, quarantined or the wrong size: to a client all mean "not here, try a peer".
        return HTTPError(404, "BLOB_UNKNOWN", str(exc))
    if isinstance(exc, StoreError):
        return HTTPError(500, "UNKNOWN", str(exc))
    if isinstance(exc, SyncError):
        # A mirror's upstream failed (sync.mirror) and the store has no copy.
        return HTTPError(502, "UNKNOWN", str(exc))
    if isinstance(exc, OSError):
        return HTTPError(500, "UNKNOWN", f"cannot read the store: {exc.strerror or exc}")
    return HTTPError(500, "UNKNOWN", "internal error")


# -- requests and responses ------------------------------------------------------------------
@dataclass(slots=True)
class Request:
    method: str
    raw_path: bytes
    query: dict[str, str]
    headers: dict[str, str]
    client: str | None
    scheme: str = "http"
    host: str = "localhost"  # the Host header when it is a plain host[:port]; else our address
    raw_query: str = ""
    zerocopy: bool = False  # the server takes `http.response.zerocopysend` (sync.zerocopy)
    local: tuple[str, int] | None = None  # the address and port the connection reached
    # Set by check_access: the grant the request came with (signin.STATIC_GRANT or a key
    # id; None when only loopback is served), and the signed URL it used, if it used one.
    grant: str | None = None
    signed_url: str | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> Request:
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope.get("headers", ()):
            name = raw_name.decode("latin-1").lower()
            value = raw_value.decode("latin-1")
            if name in headers:
                # Lists may be split over several lines; for the rest the first one counts.
                if name in ("accept", "accept-encoding"):
                    headers[name] += ", " + value
                continue
            headers[name] = value
        raw_path = scope.get("raw_path") or scope.get("path", "/").encode("utf-8")
        raw_path = raw_path.partition(b"?")[0]
        query: dict[str, str] = {}
        qs = scope.get("query_string", b"").decode("latin-1")
        try:
            for key, value in parse_qsl(qs, keep_blank_values=True, max_num_fields=16):
                query.setdefault(key, value)
        except ValueError:
            query = {"\0": ""}  # too many fields: no handler accepts this key
        client = scope.get("client")
        server = scope.get("server")
        local = (str(server[0]), int(server[1])) if server and server[1] is not None else None
        host = headers.get("host", "")
        if _HOST_HEADER.fullmatch(host) is None:
            addr, port = server or ("localhost", None)
            addr = f"[{addr}]" if ":" in addr else addr
            host = addr if port is None else f"{addr}:{port}"
        return cls(
            method=scope.get("method", "GET").upper(),
            raw_path=raw_path,
            query=query,
            headers=headers,
            client=client[0] if client else None,
            scheme=scope.get("scheme", "http"),
            host=host,
            raw_query=qs,
            zerocopy=ZEROCOPY in (scope.get("extensions") or {}),
            local=local,
        )

    @property
    def target(self) -> str:
        """The path and query as sent."""
        path = self.raw_path.decode("latin-1")
        return f"{path}?{self.raw_query}" if self.raw_query else path


def split_path(raw_path: bytes) -> list[str]:
    """Path segments, each percent-decoded on its own; HTTPError for anything suspicious.

    Decoding per segment keeps an encoded slash (`%2F`) inside its segment, where it fails
    name validation, instead of turning into a separator; `.`/`..`, NUL, backslashes, empty
    segments and non-UTF-8 bytes are refused outright.
    """
    if len(raw_path) > MAX_PATH:
        raise HTTPError(414, "NAME_INVALID", f"path longer than {MAX_PATH} bytes")
    if not raw_path.startswith(b"/"):
        raise HTTPError(400, "NAME_INVALID", "path must start with /")
    segments = []
    parts = raw_path[1:].split(b"/")
    for i, part in enumerate(parts):
        try:
            text = unquote_to_bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise HTTPError(400, "NAME_INVALID", "path is not UTF-8") from None
        if text in (".", "..") or any(c in text for c in "/\\\0") or not text.isprintable():
            raise HTTPError(400, "NAME_INVALID", f"invalid path segment {text[:80]!r}")
        if not text and i != len(parts) - 1:
            raise HTTPError(400, "NAME_INVALID", "empty path segment")
        segments.append(text)
    return segments


def _same_file(st: os.stat_result, path: os.PathLike[str]) -> bool:
    try:
        other = os.lstat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def _etag(digest: Digest, suffix: str = "") -> str:
    return f'"{digest}{suffix}"'


def _etag_matches(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    candidates = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in candidates or etag in candidates


def accepts(header: str | None, token: str) -> bool:
    """True when an Accept or Accept-Encoding header names `token` explicitly (no wildcard)
    with a non-zero q."""
    if not header:
        return False
    for item in header.split(","):
        value, *params = (p.strip() for p in item.split(";"))
        if value.lower() != token:
            continue
        q = 1.0
        for param in params:
            key, _, number = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(number)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The one byte range a `Range` header asks for, as (first, last) inclusive.

    None means "send it all": another unit, or several ranges (RFC 9110 lets a server ignore
    either). A malformed `bytes=` spec or an unsatisfiable one is a 416.
    """
    unit, sep, spec = header.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    spec = spec.strip()
    if "," in spec:
        return None

    def refuse(why: str) -> HTTPError:
        return HTTPError(
            416,
            "RANGE_INVALID",
            f"range {spec[:40]!r} {why}",
            [("Content-Range", f"bytes */{size}")],
        )

    first_text, dash, last_text = (p.strip() for p in spec.partition("-"))
    if (
        not dash
        or not (first_text or last_text)
        or (first_text and not _DIGITS.fullmatch(first_text))
        or (last_text and not _DIGITS.fullmatch(last_text))
    ):
        raise refuse("is malformed")
    if not first_text:
        suffix = int(last_text)
        if suffix == 0 or size == 0:
            raise refuse(f"is not satisfiable for {size} bytes")
        return max(0, size - suffix), size - 1
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last < first:
        raise refuse("is malformed")
    if first >= size:
        raise refuse(f"is not satisfiable for {size} bytes")
    return first, min(last, size - 1)


def _page(items: Sequence[str], query: Mapping[str, str]) -> tuple[list[str], bool]:
    """OCI pagination: names after `last` (case-insensitive order), at most `n` of them."""
    n_text = query.get("n")
    limit = MAX_PAGE
    if n_text is not None:
        if not _DIGITS.fullmatch(n_text):
            raise HTTPError(400, "PAGINATION_NUMBER_INVALID", f"invalid n {n_text[:20]!r}")
        limit = min(int(n_text), MAX_PAGE)
    last = query.get("last")
    start = bisect.bisect_right(items, _sort_key(last), key=_sort_key) if last else 0
    chunk = list(items[start : start + limit])
    more = start + limit < len(items)
    return chunk, more and bool(chunk)


def _sort_key(text: str) -> tuple[str, str]:
    return (text.lower(), text)


# -- the store, as served --------------------------------------------------------------------
def listed_repository(name: Name) -> str:
    """The repository `_catalog` and `tags/list` give for a model: the lowercase OCI name
    `modelfs push` would use (the distribution spec allows no uppercase, and OCI clients refuse
    a catalog or a `tags/list` answer holding it). Lookups fold case either way, so the store's
    spelling still finds the model. A name with no OCI form (a leading `_`) is listed
    lowercased, so modelfs peers still see it."""
    try:
        return repository_for(name)
    except RegistryNameError:
        return name.repository.lower()


@dataclass(slots=True)
class Repo:
    name: str  # as listed: lowercase, as OCI clients want it
    tags: list[str]
    # tag -> the model's name as the store spells it (`hf.co/bartowski/SmolLM2-…:Q4_K_M`), for
    # modelfs peers: a replica keeps the spelling (NAMES_FIELD of a `tags/list` answer).
    spelled: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class View:
    """Everything a request needs from one store snapshot, computed once per rebuild."""

    index: StoreIndex
    manifests: dict[Digest, Manifest | ManifestList] = field(default_factory=dict)
    blob_sizes: dict[Digest, set[int]] = field(default_factory=dict)
    compressible: set[Digest] = field(default_factory=set)
    repos: dict[tuple[str, str, str], Repo] = field(default_factory=dict)
    catalog: list[str] = field(default_factory=list)
    # (ns, model, tag), lowercased -> the names other hosts than the default hold under it.
    elsewhere: dict[tuple[str, str, str], list[Name]] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: Layout, cache: ScanCache | None = None) -> View:
        view = cls(scan_store(layout, cache))
        for entry in view.index:
            # A plain manifest is its own one variant; a list adds its present children.
            view.manifests[entry.top.digest] = entry.top
            view.compressible.add(entry.top.digest)
            for variant in entry.variants:
                view._add_manifest(variant.manifest)
            key = entry.name.key[:3]
            repo = view.repos.setdefault(key, Repo(listed_repository(entry.name), []))
            repo.tags.append(entry.name.tag)
            repo.spelled[entry.name.tag] = entry.name.shortest
            if not entry.name.is_default_host:
                view.elsewhere.setdefault(entry.name.key[1:], []).append(entry.name)
        for repo in view.repos.values():
            repo.tags.sort(key=_sort_key)
        view.catalog = sorted((r.name for r in view.repos.values()), key=_sort_key)
        return view

    def _add_manifest(self, manifest: Manifest) -> None:
        self.manifests[manifest.digest] = manifest
        self.compressible.add(manifest.digest)
        layers = list(manifest.layers)
        if manifest.config is not None:
            layers.append(manifest.config)
        for layer in layers:
            self.blob_sizes.setdefault(layer.digest, set()).add(layer.size)
            if layer.media_type == MEDIA_CONFIG or (
                layer.media_type.startswith(LAYER_PREFIX) and layer.kind in COMPRESSIBLE_KINDS
            ):
                self.compressible.add(layer.digest)

    def for_ollama(self, name: Name) -> Name:
        """The model an Ollama client means by a default-host name: that one when the store
        holds it, else the one model of another host with the same `<ns>/<model>:<tag>`."""
        if name.key in self.index.entries:
            return name
        _, ns, model, tag = name.key
        others = self.elsewhere.get((ns, model, tag), [])
        if len(others) > 1:
            raise ModelNotFoundError(
                f"{name.namespace}/{name.model}:{name.tag} is on several hosts here "
                f"({', '.join(o.host for o in others)}); pull it with modelfs, which names the host"
            )
        return others[0] if others else name

    def repo(self, repository: str) -> Repo:
        key = name_from_repository(repository, "latest").key[:3]
        repo = self.repos.get(key)
        if repo is None:
            raise HTTPError(404, "NAME_UNKNOWN", f"repository {repository!r} not known")
        return repo


@dataclass(slots=True)
class Stats:
    started: float = field(default_factory=time.monotonic)
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    bytes_served: int = 0
    blobs_served: int = 0
    manifests_served: int = 0


@dataclass(slots=True)
class OpenBlob:
    fd: int
    size: int
    data: bytes | None = None  # the whole blob, when small: read in the same thread hop
    growing: BlobFetch | None = None  # a mirror's fetch still writing it (sync.mirror)


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


# -- the app ---------------------------------------------------------------------------------
class RegistryApp:
    """A read-only OCI distribution registry over one store root."""

    def __init__(
        self,
        layout: Layout,
        *,
        token: str | None,
        authorized_keys: str | os.PathLike[str] | None = None,
        prefer: Sequence[str] = DEFAULT_PREFER,
        host_id: str | None = None,
        refresh_interval: float = REFRESH_INTERVAL,
        zstd: bool = True,
        names: Sequence[str] = (),
        public_urls: Sequence[str] = (),
    ) -> None:
        """`names` and `public_urls` are what, besides its hostname and the address a client
        reached, this server answers to: a signature made for anything else buys no token."""
        self.layout = layout
        self._root = os.path.abspath(layout.root)
        self.host_id = host_id or socket.gethostname()
        self.access = Access(
            token=token,
            keys_path=authorized_keys,
            realm=Realm(self.host_id, names=names, public_urls=public_urls),
        )
        self.prefer = tuple(prefer)
        self.refresh_interval = refresh_interval
        self.zstd = zstd
        self.stats = Stats()
        self._view: View | None = None
        self._signature: tuple[object, ...] | None = None
        self._checked = -float("inf")
        self._refresh_lock = trio.Lock()
        self._scan_cache = ScanCache()  # a rebuild re-reads only the tag files that changed
        self._zstd_cache: OrderedDict[Digest, bytes | None] = OrderedDict()
        self._zstd_cache_bytes = 0
        # `--mirror`: what the store lacks is fetched from upstream (sync.mirror).
        self.mirror: Mirror | None = None
        # The sync daemon adds its own state to /modelfs/v1/status and /metrics.
        self.extra_status: Callable[[], dict[str, Any]] | None = None
        self.extra_metrics: Callable[[], list[MetricFamily]] | None = None
        # And hears of each request another daemon sends (its host id, protocol.HOST_HEADER).
        self.on_contact: Callable[[str], None] | None = None

    # -- the snapshot --------------------------------------------------------------------
    def changed(self) -> None:
        """The store changed (a pull wrote to it): the next look checks it again at once."""
        self._checked = -float("inf")

    async def view(self) -> View:
        """The current snapshot; rebuilt first when the store changed since the last look."""
        if self._view is not None and time.monotonic() - self._checked < self.refresh_interval:
            return self._view
        async with self._refresh_lock:
            # Whoever waited on the lock finds the work done.
            if self._view is not None and time.monotonic() - self._checked < self.refresh_interval:
                return self._view
            # Signature before scan: a change during the scan is caught by the next look.
            signature = await trio.to_thread.run_sync(store_signature, self.layout)
            if self._view is None or signature != self._signature:
                started = time.monotonic()
                view = await trio.to_thread.run_sync(View.build, self.layout, self._scan_cache)
                log.info(
                    "store %s: %d model(s), %d blob(s), %d problem(s) (%.2f s)",
                    self.layout.root,
                    len(view.index),
                    len(view.index.blob_names),
                    len(view.index.problems),
                    time.monotonic() - started,
                )
                self._view, self._signature = view, signature
                self._zstd_cache.clear()
                self._zstd_cache_bytes = 0
            self._checked = time.monotonic()
            assert self._view is not None
            return self._view

    # -- ASGI ----------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        request = Request.from_scope(scope)
        started = time.monotonic()
        status = 0
        sent = 0
        answered = False

        async def counted(message: Message) -> None:
            nonlocal status, sent, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                n = len(message.get("body", b""))
                sent += n
                self.stats.bytes_served += n
            elif message["type"] == ZEROCOPY:
                sent += message["count"]
                self.stats.bytes_served += message["count"]
            if message["type"] == ZEROCOPY and not message.get("more_body", False):
                # The file, cancellable (a client that hangs up stops it), then the end.
                await send({**message, "more_body": True})
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            if message["type"] == "http.response.body":
                # Before the send: hypercorn closes or recycles the connection inside the last
                # one, and puts a disconnect then, which must not cancel that halfway (the
                # socket would stay open).
                answered = answered or not message.get("more_body", False)
            await send(message)

        try:
            with unwrapped():
                async with trio.open_nursery() as nursery:
                    # Whatever a request waits on (a blob's bytes, a mirror's upstream), a
                    # client that hangs up cancels it, and a body sent with it is read and
                    # dropped: left unread, it fills hypercorn's queue for the app, where the
                    # disconnect can then never be put, and the connection stays open for ever.
                    nursery.start_soon(
                        _cancel_on_disconnect, receive, nursery.cancel_scope, lambda: answered
                    )
                    await self._handle(request, counted)
                    nursery.cancel_scope.cancel()
        except Exception as exc:
            if status:
                # The response has begun (a read failed mid-blob, a mirror's upstream sent
                # wrong bytes): all we can do is cut the connection, which tells the client
                # the body is short. Returning does that (hypercorn closes a connection whose
                # answer is unfinished); raising would also log a traceback, one per client
                # of a hostile upstream, so only what we do not expect is raised.
                log.warning(
                    "%s %s: aborted after %d bytes: %s", request.method, _show(request), sent, exc
                )
                if isinstance(exc, SyncError | StoreError | OSError):
                    return
                raise
            err = error_status(exc)
            if err.status >= 500:
                # An upstream's failure (a mirror's 502) is one line; ours comes with a traceback.
                trace = exc if err.status == 500 else None
                log.error("%s %s: %s", request.method, _show(request), exc, exc_info=trace)
            await self._send_error(request, counted, err)
        finally:
            method = request.method if request.method in KNOWN_METHODS else "OTHER"
            self.stats.requests[(method, status or 500)] += 1
            log.debug(
                "%s %s %s %d %d bytes %.3f s",
                request.client,
                request.method,
                _show(request),
                status,
                sent,
                time.monotonic() - started,
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- access --------------------------------------------------------------------------
    def check_access(self, request: Request) -> None:
        """With a token or keys, every request must carry a credential, loopback too;
        without either, only loopback is served.

        Credentials: `Authorization: Bearer <token>` with the static token or one this
        server issued (Basic with the token as password is taken too, for clients that only
        know `--creds user:password`), a sync daemon's proof that it holds the static token
        (`Modelfs-Peer`, signin.peer_authorization), or a signed URL this server gave out in a
        Location.
        """
        if not self.access.enabled:
            if not _is_loopback(request.client):
                raise HTTPError(
                    403,
                    "DENIED",
                    "this server has no token and serves loopback clients only",
                )
            return
        header = request.headers.get("authorization", "")
        scheme, _, value = header.strip().partition(" ")
        if scheme == PEER_SCHEME and self.access.peer_request_ok(
            value, request.method, request.target
        ):
            request.grant = STATIC_GRANT
            return
        given = _credential(header)
        if given is not None and (grant := self.access.bearer_grant(given)) is not None:
            request.grant = grant
            return
        if "signature" in request.query and request.method in READ_ONLY_METHODS:
            try:
                request.signed_url = self.access.url_grant(
                    request.raw_path.decode("latin-1"),
                    request.query.get("expires", ""),
                    request.query.get("grant", ""),
                    request.query["signature"],
                )
            except Refused as exc:
                log.warning("signed URL from %s refused: %s", request.client, exc)
                raise self._unauthorized(request, f"signed URL refused: {exc.reason}") from None
            request.grant = request.query["grant"]
            return
        if header:
            log.info("%s %s: credential not accepted", request.client, _show(request))
        raise self._unauthorized(request, "authentication required")

    def _unauthorized(self, request: Request, message: str) -> HTTPError:
        """A 401 whose challenge Ollama and Docker clients can follow: an absolute realm on
        the request's own scheme, host and port (Ollama requires the host, auth.go:59-62),
        and this server's own service, which a signature must name to count."""
        realm = f"{self.access.realm.origin(request.scheme, request.host)}{TOKEN_PATH}"
        challenge = f'Bearer realm="{realm}",service="{self.access.realm.service}"'
        parts = request.raw_path.decode("latin-1").split("/")
        if len(parts) >= 6 and parts[1] == "v2" and parts[-2] in ("manifests", "blobs"):
            repository = "/".join(parts[2:-2])
            if _SCOPE_REPO.fullmatch(repository):
                challenge += f',scope="repository:{repository}:pull"'
        return HTTPError(401, "UNAUTHORIZED", message, [("WWW-Authenticate", challenge)])

    async def _token(self, request: Request, send: Send) -> None:
        """The realm: a signed Ollama request, or (Docker's token flow) the static token as
        Bearer or Basic password, gets a short-lived token for this server."""
        header = request.headers.get("authorization", "")
        try:
            if not header.strip():
                raise Refused("no credential sent")
            if header.split(" ", 1)[0].lower() in ("bearer", "basic"):
                given = _credential(header)
                if given is None or not self.access.static_ok(given):
                    raise Refused("credential not accepted")
                key_id = STATIC_GRANT
            else:
                key_id = self.access.sign_in(
                    SignInRequest(
                        scheme=request.scheme,
                        host=request.headers.get("host", ""),
                        raw_path=request.raw_path.decode("latin-1"),
                        raw_query=request.raw_query,
                        authorization=header,
                        client=request.client,
                        local=request.local,
                    )
                )
        except Refused as exc:
            log.warning("sign-in from %s refused: %s", request.client, exc)
            raise HTTPError(401, "UNAUTHORIZED", f"sign-in refused: {exc.reason}") from None
        await self._respond_json(request, send, self.access.issue(key_id))

    # -- routing -------------------------------------------------------------------------
    async def _handle(self, request: Request, send: Send) -> None:
        if request.raw_path == TOKEN_PATH.encode() and self.access.enabled:
            if request.method != "GET":
                raise HTTPError(
                    405, "UNSUPPORTED", "the token endpoint takes GET", [("Allow", "GET")]
                )
            await self._token(request, send)
            return
        self.check_access(request)
        if self.on_contact is not None and (caller := request.headers.get(HOST_HEADER.lower())):
            # Allowed in, so one of our own: a sync daemon of that host id is up.
            self.on_contact(caller[:MAX_HOST_ID])
        if request.method not in READ_ONLY_METHODS:
            raise HTTPError(
                405,
                "UNSUPPORTED",
                f"{request.method[:16]} is not supported: this registry is read-only",
                [("Allow", "GET, HEAD")],
            )
        segments = split_path(request.raw_path)
        if segments[:1] == ["v2"]:
            await self._v2(request, segments[1:], send)
        elif segments == ["modelfs", "v1", "status"]:
            await self._respond_json(request, send, await self._status())
        elif segments == ["metrics"]:
            body = (await self._metrics()).encode()
            await self._respond(request, send, 200, [("Content-Type", METRICS_TYPE)], body)
        else:
            raise HTTPError(404, "NOT_FOUND", "no such endpoint")

    async def _v2(self, request: Request, rest: list[str], send: Send) -> None:
        if rest in ([], [""]):
            await self._respond_json(request, send, {})
            return
        if rest == ["_catalog"]:
            view = await self.view()
            repos, more = _page(view.catalog, request.query)
            headers = self._next_link("/v2/_catalog", request.query, repos, more)
            await self._respond_json(request, send, {"repositories": repos}, headers)
            return
        if len(rest) >= 4 and rest[-2:] == ["tags", "list"]:
            repository = "/".join(rest[:-2])
            _check_repository(repository)
            repo = (await self.view()).repo(repository)
            tags, more = _page(repo.tags, request.query)
            headers = self._next_link(f"/v2/{repository}/tags/list", request.query, tags, more)
            body = {"name": repo.name, "tags": tags, NAMES_FIELD: [repo.spelled[t] for t in tags]}
            await self._respond_json(request, send, body, headers)
            return
        if len(rest) >= 4 and rest[-2] in ("manifests", "blobs"):
            repository = "/".join(rest[:-2])
            _check_repository(repository)
            if rest[-2] == "manifests":
                await self._manifest(request, repository, rest[-1], send)
            else:
                await self._blob(request, repository, Digest.parse(rest[-1]), send)
            return
        raise HTTPError(404, "NOT_FOUND", "no such endpoint")

    @staticmethod
    def _next_link(
        path: str, query: Mapping[str, str], items: list[str], more: bool
    ) -> list[tuple[str, str]]:
        if not more:
            return []
        params = {"last": items[-1]}
        if "n" in query:
            params["n"] = query["n"]
        return [("Link", f'<{path}?{urlencode(params)}>; rel="next"')]

    # -- manifests -----------------------------------------------------------------------
    async def _manifest(
        self, request: Request, repository: str, reference: str, send: Send
    ) -> None:
        view = await self.view()
        vary = False
        mirrored = None
        if self.mirror is not None and ":" not in reference:
            mirrored = await self.mirror.manifest(
                partial(_stored, view),
                repository,
                reference,
                lists=accepts(request.headers.get("accept"), MEDIA_LIST),
                get=request.method == "GET",
            )
            view = await self.view()  # it may have been written just now
        if mirrored is not None:
            manifest = mirrored
            vary = True
        elif ":" in reference:  # a tag never holds ':'; `sha256-…` is a valid tag name
            digest = Digest.parse(reference)
            held = view.manifests.get(digest)
            if held is not None:
                manifest = held
            else:
                try:
                    manifest = await trio.to_thread.run_sync(self._manifest_blob, view, digest)
                except ModelNotFoundError:
                    if self.mirror is None:
                        raise
                    mirrored = await self.mirror.manifest(
                        partial(_stored, view), repository, reference, lists=True, get=False
                    )
                    if mirrored is None:  # written meanwhile
                        mirrored = await trio.to_thread.run_sync(self._manifest_blob, view, digest)
                    manifest = mirrored
        else:
            name = name_from_repository(repository, reference)
            if name.is_default_host and request.headers.get("user-agent", "").startswith(
                OLLAMA_AGENT
            ):
                name = view.for_ollama(name)
            manifest = _resolve_tag(view, name, request.headers.get("accept"), self.prefer)
            vary = True
        digest = manifest.digest
        etag = _etag(digest)
        media_type = manifest.media_type
        if _MEDIA_TYPE.fullmatch(media_type) is None:
            # Store bytes never reach a header unchecked (a CR/LF here would split it).
            media_type = JSON
        headers = [
            ("Content-Type", media_type),
            (DIGEST_HEADER, str(digest)),
            ("ETag", etag),
        ]
        if vary:
            headers.append(("Vary", "Accept"))
        if _etag_matches(request.headers.get("if-none-match"), etag):
            await self._respond(request, send, 304, headers, b"", length=False)
            return
        self.stats.manifests_served += request.method == "GET"
        await self._respond(request, send, 200, headers, manifest.raw)

    def _manifest_blob(self, view: View, digest: Digest) -> Manifest | ManifestList:
        """A manifest held only as a blob (no tag names it): read, verified, parsed."""
        missing = ModelNotFoundError(f"manifest {digest} not found")
        try:
            fd = open_fd(self.layout.blob(digest), follow=False)
        except OSError:
            raise missing from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                raise missing
            raw = os.pread(fd, st.st_size, 0)
        finally:
            os.close(fd)
        if Digest.of_bytes(raw) != digest:
            raise ModelNotFoundError(f"manifest {digest}: stored bytes do not match the digest")
        try:
            return parse_manifest(raw, f"blobs/{digest.blob_name}")
        except StoreError:
            raise missing from None

    # -- blobs ---------------------------------------------------------------------------
    def _open_blob(self, view: View, digest: Digest, *, read_small: bool) -> OpenBlob:
        """Open a blob that may be served: a regular file under its canonical name, not
        quarantined, and as long as every manifest that names it says."""
        path = self.layout.blob(digest)
        try:
            fd = open_fd(path, follow=False)
        except OSError as exc:
            # ELOOP: a symlink where a blob should be could point anywhere; never follow it.
            raise MissingBlobError(f"blob {digest} not found") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MissingBlobError(f"blob {digest} not found")
            # `modelfs verify` moves a corrupt blob out of blobs/ by rename, so what is here
            # now is another file: a good copy from `--repair-from` or `ollama pull`, to be
            # served. Only the same file in both places (a hardlink left by an interrupted or
            # hand-made quarantine) is the quarantined bytes.
            if _same_file(st, self.layout.quarantine / digest.blob_name):
                raise CorruptBlobError(f"blob {digest} is quarantined")
            sizes = view.blob_sizes.get(digest)
            if sizes and st.st_size not in sizes:
                log.warning(
                    "blob %s is %d bytes, its manifests say %s: not served",
                    digest,
                    st.st_size,
                    sorted(sizes),
                )
                raise CorruptBlobError(f"blob {digest} has the wrong size")
            data = None
            if read_small and st.st_size <= SMALL_BLOB:
                data = os.pread(fd, st.st_size, 0)
                if len(data) != st.st_size:
                    raise CorruptBlobError(f"blob {digest} changed size while read")
        except BaseException:
            os.close(fd)
            raise
        return OpenBlob(fd, st.st_size, data)

    async def _blob(self, request: Request, repository: str, digest: Digest, send: Send) -> None:
        view = await self.view()
        open_it = partial(self._open_blob, view, digest, read_small=request.method == "GET")
        try:
            blob = await trio.to_thread.run_sync(open_it)
        except BlobError:
            if self.mirror is None:
                raise
            fetch = await self.mirror.blob(repository, digest)
            blob = await trio.to_thread.run_sync(_open_growing, fetch, open_it)
        try:
            await self._send_blob(request, view, digest, blob, send)
        finally:
            os.close(blob.fd)

    def _location(self, request: Request, path: str) -> str:
        """Where Ollama sends a blob's parts: the path itself when only loopback is served;
        the signed URL the request came by (never a fresh one, or a URL fetched again now
        and then would live for ever); else a new one for the request's grant."""
        if request.grant is None:
            return path
        if request.signed_url is not None:
            return request.signed_url
        return self.access.sign_path(path, request.grant)

    async def _send_blob(
        self,
        request: Request,
        view: View,
        digest: Digest,
        blob: OpenBlob,
        send: Send,
    ) -> None:
        size = blob.size
        etag, zstd_etag = _etag(digest), _etag(digest, "+zstd")
        compressible = (
            self.zstd
            and blob.growing is None
            and digest in view.compressible
            and ZSTD_MIN <= size <= ZSTD_MAX
        )
        path = request.raw_path.decode("latin-1")
        headers = [
            ("Content-Type", OCTETS),
            (DIGEST_HEADER, str(digest)),
            ("Accept-Ranges", "bytes"),
            # Where Ollama's parts go, without Authorization (download.go:270, 345).
            ("Location", self._location(request, path)),
        ]
        if compressible:
            headers.append(("Vary", "Accept-Encoding"))
        if_none_match = request.headers.get("if-none-match")
        for tag in (etag, zstd_etag):
            if _etag_matches(if_none_match, tag):
                await self._respond(
                    request, send, 304, [*headers, ("ETag", tag)], b"", length=False
                )
                return
        range_header = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if range_header is not None and if_range is not None and if_range.strip() != etag:
            range_header = None  # If-Range names another representation: send it whole
        span = parse_range(range_header, size) if range_header is not None else None

        # zstd only for a whole GET (a HEAD reports the identity length, which is what a
        # client probing a blob's size wants) and only for layers that are text.
        if (
            compressible
            and range_header is None
            and request.method == "GET"
            and accepts(request.headers.get("accept-encoding"), "zstd")
        ):
            packed = await self._zstd(blob, digest)
            if packed is not None:
                headers += [("ETag", zstd_etag), ("Content-Encoding", "zstd")]
                self.stats.blobs_served += 1
                await self._respond(request, send, 200, headers, packed)
                return

        headers.append(("ETag", etag))
        if span is None:
            status, first, length = 200, 0, size
        else:
            status, first, length = 206, span[0], span[1] - span[0] + 1
            headers.append(("Content-Range", f"bytes {span[0]}-{span[1]}/{size}"))
        headers.append(("Content-Length", str(length)))
        await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
        if request.method == "HEAD" or length == 0:
            await send({"type": "http.response.body", "body": b""})
            return
        # Counted as it starts: the disconnect that follows a complete answer may cancel
        # what comes after its last send (`__call__`).
        self.stats.blobs_served += 1
        if blob.data is not None:
            await send({"type": "http.response.body", "body": blob.data[first : first + length]})
            return
        # A client that hangs up cancels this (`__call__`): we do not read the rest of a
        # 40 GB blob for no one.
        if request.zerocopy and blob.growing is None:
            # Kernel to socket: the bytes never pass through Python (sync.zerocopy).
            message = {"type": ZEROCOPY, "file": blob.fd, "offset": first, "count": length}
            await send(message)
        else:
            await _stream(blob.fd, first, length, send, blob.growing)

    async def _zstd(self, blob: OpenBlob, digest: Digest) -> bytes | None:
        """The blob compressed, or None when that does not save a tenth."""
        if digest in self._zstd_cache:
            self._zstd_cache.move_to_end(digest)
            return self._zstd_cache[digest]

        def compress() -> bytes | None:
            raw = blob.data if blob.data is not None else os.pread(blob.fd, blob.size, 0)
            if len(raw) != blob.size:
                raise CorruptBlobError(f"blob {digest} changed size while read")
            packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
            return packed if len(packed) <= blob.size * 0.9 else None

        packed = await trio.to_thread.run_sync(compress)
        self._zstd_cache[digest] = packed
        self._zstd_cache_bytes += len(packed or b"")
        while self._zstd_cache_bytes > ZSTD_CACHE and self._zstd_cache:
            _, old = self._zstd_cache.popitem(last=False)
            self._zstd_cache_bytes -= len(old or b"")
        return packed

    # -- status and metrics --------------------------------------------------------------
    async def _status(self) -> dict[str, Any]:
        view = await self.view()
        s = self.stats
        return {
            "version": VERSION,
            "host_id": self.host_id,
            "store": self._root,
            "models": len(view.index),
            "blobs": len(view.index.blob_names),
            "problems": len(view.index.problems),
            "uptime_seconds": round(time.monotonic() - s.started, 3),
            "requests": sum(s.requests.values()),
            "bytes_served": s.bytes_served,
            "blobs_served": s.blobs_served,
            "manifests_served": s.manifests_served,
            "auth": self.access.kind,
            **({"mirror": self.mirror.status()} if self.mirror is not None else {}),
            **(self.extra_status() if self.extra_status else {}),
        }

    async def _metrics(self) -> str:
        view = await self.view()
        s = self.stats
        out: list[str] = []

        def metric(
            name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]
        ) -> None:
            out.append(f"# HELP modelfs_{name} {help_text}")
            out.append(f"# TYPE modelfs_{name} {kind}")
            for labels, value in samples:
                out.append(
                    f"modelfs_{name}{labels} {value:g}"
                    if isinstance(value, float)
                    else f"modelfs_{name}{labels} {value}"
                )

        metric(
            "http_requests_total",
            "counter",
            "HTTP requests answered, by method and status code.",
            ((f'{{method="{m}",code="{c}"}}', n) for (m, c), n in sorted(s.requests.items())),
        )
        metric("bytes_served_total", "counter", "Response body bytes sent.", [("", s.bytes_served)])
        metric(
            "blobs_served_total",
            "counter",
            "Blob GETs answered with the blob.",
            [("", s.blobs_served)],
        )
        metric(
            "manifests_served_total", "counter", "Manifest GETs served.", [("", s.manifests_served)]
        )
        metric("models", "gauge", "Tags in the store.", [("", len(view.index))])
        metric("blobs", "gauge", "Blobs in the store.", [("", len(view.index.blob_names))])
        metric(
            "store_problems",
            "gauge",
            "Problems found by the last scan.",
            [("", len(view.index.problems))],
        )
        metric(
            "uptime_seconds",
            "gauge",
            "Seconds since the server started.",
            [("", round(time.monotonic() - s.started, 3))],
        )
        for family in self.extra_metrics() if self.extra_metrics else []:
            metric(*family)
        return "\n".join(out) + "\n"

    # -- sending -------------------------------------------------------------------------
    async def _respond(
        self,
        request: Request,
        send: Send,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        length: bool = True,
    ) -> None:
        if length:
            headers = [*headers, ("Content-Length", str(len(body)))]
        headers = [*headers, (HOST_HEADER, self.host_id)]
        if request.method == "HEAD":
            body = b""
        nonce = request.headers.get(PROOF_NONCE_HEADER.lower(), "")
        if 0 < len(nonce) <= MAX_NONCE and status < 400:
            # A sync daemon asks us to prove we hold the shared token, and sent this body,
            # before it uses a listing or manifest (signin.proof_ok); without a token there is
            # nothing to prove, and a refusal (to anyone who asks) proves nothing.
            path = proof_path(request.raw_path.decode("latin-1"))
            proof = self.access.prove(nonce, path, body)
            if proof is not None:
                headers = [*headers, (PROOF_HEADER, proof)]
        await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
        await send({"type": "http.response.body", "body": body})

    async def _respond_json(
        self,
        request: Request,
        send: Send,
        obj: Any,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        await self._respond(request, send, 200, [("Content-Type", JSON), *headers], body)

    async def _send_error(self, request: Request, send: Send, err: HTTPError) -> None:
        body = json.dumps(
            {"errors": [{"code": err.code, "message": err.message, "detail": None}]},
            separators=(",", ":"),
        ).encode()
        await self._respond(request, send, err.status, [("Content-Type", JSON), *err.headers], body)


# -- helpers ---------------------------------------------------------------------------------
def _check_repository(repository: str) -> None:
    name_from_repository(repository, "latest")


def _resolve_tag(
    view: View, name: Name, accept: str | None, prefer: Sequence[str]
) -> Manifest | ManifestList:
    """What a tag serves: its own bytes, or for a list and a client that does not take
    lists, the preferred present child (as Ollama's registry serves old clients)."""
    entry = view.index.lookup(name)
    if isinstance(entry.top, Manifest) or accepts(accept, MEDIA_LIST):
        return entry.top
    variant = entry.preferred(prefer)
    if variant is None:
        raise ModelNotFoundError(
            f"{name.shortest} is a manifest list with no child here; ask for {MEDIA_LIST}"
        )
    return variant.manifest


def _stored(view: View, name: Name) -> Digest | None:
    """The digest of the store's manifest for a tag, or None."""
    try:
        return view.index.lookup(name).top.digest
    except ModelNotFoundError:
        return None


def _open_growing(fetch: BlobFetch | None, open_stored: Callable[[], OpenBlob]) -> OpenBlob:
    """A blob a mirror fetches: its temp file, read behind the writer; the stored blob once
    it landed."""
    if fetch is None or fetch.landed or fetch.path is None:
        return open_stored()
    try:
        fd = open_fd(fetch.path, follow=False)
    except FileNotFoundError:
        # Renamed into blobs/ between the look and the open: the rename comes before the
        # fetch is marked landed, so the store is asked whatever `landed` says yet (a fetch
        # that failed discarded its file, and the store then answers missing).
        return open_stored()
    return OpenBlob(fd, fetch.size, growing=fetch)


def _credential(header: str) -> str | None:
    if not header or len(header) > MAX_TOKEN:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep else None
    return None


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    out.append((API_VERSION_HEADER[0].lower().encode(), API_VERSION_HEADER[1].encode()))
    return out


def _show(request: Request) -> str:
    return request.raw_path[:200].decode("latin-1")


async def _cancel_on_disconnect(
    receive: Receive, scope: trio.CancelScope, answered: Callable[[], bool]
) -> None:
    """Read the request's messages (dropping any body) until the client is gone; then cancel
    `scope`, unless the answer was complete (hypercorn says "disconnect" after every answer)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not answered():
                scope.cancel()
            return


async def _stream(
    fd: int, offset: int, length: int, send: Send, growing: BlobFetch | None = None
) -> None:
    """Send `length` bytes of `fd` from `offset` as ASGI body messages, where the server
    offers no zero-copy send (TLS, h2, another ASGI server) or the blob is one a mirror is
    still `growing`: then each byte once it is there (and the last once it is verified).

    A reader task preads the next chunk in a worker thread while the current one is being
    sent: the copy out of the page cache (or a disk read) overlaps the socket write, and the
    event loop never blocks on the disk.
    """
    end = offset + length
    chunks_in, chunks_out = trio.open_memory_channel[bytes](1)

    def read(at: int, limit: int) -> bytes:
        return os.pread(fd, min(CHUNK, limit - at), at)

    async def reader() -> None:
        async with chunks_in:
            at = offset
            while at < end:
                if growing is None:
                    chunk = await trio.to_thread.run_sync(read, at, end)
                else:
                    limit = await growing.ready(at, end)
                    recent = growing.cached(at, min(limit, at + CHUNK))
                    if recent is not None:
                        chunk = recent
                    else:
                        chunk = await trio.to_thread.run_sync(read, at, limit)
                if not chunk:
                    raise CorruptBlobError(f"blob ended early at byte {at}")
                at += len(chunk)
                await chunks_in.send(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        sent = 0
        async with chunks_out:
            async for chunk in chunks_out:
                sent += len(chunk)
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": sent < length}
                )
