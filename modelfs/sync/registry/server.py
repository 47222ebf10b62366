"""The read-only OCI distribution server over one store, as a plain ASGI app.

    RegistryApp(layout, token=None, prefer=DEFAULT_PREFER)    an ASGI 3 callable

Endpoints (every one behind the same access rule, see `auth.check_access`):

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

import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from modelfs.runtime.groups import unwrapped
from modelfs.store.digest import Digest
from modelfs.store.errors import BlobError, ModelNotFoundError, StoreError
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_LIST
from modelfs.store.scan import DEFAULT_PREFER, ScanCache
from modelfs.store.units import counted
from modelfs.store.watch import store_signature
from modelfs.sync.errors import SyncError
from modelfs.sync.registry.auth import check_access, location, signed_in
from modelfs.sync.registry.blobs import (
    ZSTD_MAX,
    ZSTD_MIN,
    OpenBlob,
    ZstdCache,
    cancel_on_disconnect,
    open_blob,
    open_growing,
    stream_blob,
)
from modelfs.sync.registry.http import (
    JSON,
    KNOWN_METHODS,
    OCTETS,
    READ_ONLY_METHODS,
    HTTPError,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    accepts,
    encoded,
    entity_tag,
    error_status,
    etag_matches,
    parse_range,
    shown,
    split_path,
)
from modelfs.sync.registry.metrics import METRICS_TYPE, MetricFamily, Stats, metrics_text
from modelfs.sync.registry.view import (
    View,
    check_repository,
    manifest_blob,
    next_link,
    page,
    resolve_tag,
    stored_digest,
)
from modelfs.sync.registry.zerocopy import ZEROCOPY
from modelfs.sync.wire.protocol import (
    DIGEST_HEADER,
    HOST_HEADER,
    MAX_HOST_ID,
    NAMES_FIELD,
    name_from_repository,
)
from modelfs.sync.wire.realm import Realm
from modelfs.sync.wire.signin import (
    MAX_NONCE,
    PROOF_HEADER,
    PROOF_NONCE_HEADER,
    TOKEN_PATH,
    Access,
    proof_path,
)

if TYPE_CHECKING:
    from modelfs.sync.mirror.mirror import Mirror

log = logging.getLogger(__name__)

VERSION = "0.1"
REFRESH_INTERVAL = 1.0
OLLAMA_AGENT = "ollama/"  # images.go:1392 sets `ollama/<version> (<arch> <os>) Go/<go>`
_MEDIA_TYPE = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
)


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
        # The store's scan index: a start and each rebuild re-read only the tag files that changed.
        self._scan_cache = ScanCache.open(self.layout)
        self._zstd = ZstdCache()
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
                    "store %s: %s, %s, %s (%.2f s)",
                    self.layout.root,
                    counted(len(view.index), "model"),
                    counted(len(view.index.blob_names), "blob"),
                    counted(len(view.index.problems), "problem"),
                    time.monotonic() - started,
                )
                self._view, self._signature = view, signature
                self._zstd.clear()
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
                        cancel_on_disconnect, receive, nursery.cancel_scope, lambda: answered
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
                    "%s %s: aborted after %d bytes: %s", request.method, shown(request), sent, exc
                )
                if isinstance(exc, SyncError | StoreError | OSError):
                    return
                raise
            err = error_status(exc)
            if err.status >= 500:
                # An upstream's failure (a mirror's 502) is one line; ours comes with a traceback.
                trace = exc if err.status == 500 else None
                log.error("%s %s: %s", request.method, shown(request), exc, exc_info=trace)
            await self._send_error(request, counted, err)
        finally:
            method = request.method if request.method in KNOWN_METHODS else "OTHER"
            self.stats.requests[(method, status or 500)] += 1
            log.debug(
                "%s %s %s %d %d bytes %.3f s",
                request.client,
                request.method,
                shown(request),
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

    # -- routing -------------------------------------------------------------------------
    async def _handle(self, request: Request, send: Send) -> None:
        if request.raw_path == TOKEN_PATH.encode() and self.access.enabled:
            if request.method != "GET":
                raise HTTPError(
                    405, "UNSUPPORTED", "the token endpoint takes GET", [("Allow", "GET")]
                )
            key_id = signed_in(self.access, request)
            await self._respond_json(request, send, self.access.issue(key_id))
            return
        check_access(self.access, request)
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
            extra = self.extra_metrics() if self.extra_metrics else []
            body = metrics_text(await self.view(), self.stats, extra).encode()
            await self._respond(request, send, 200, [("Content-Type", METRICS_TYPE)], body)
        else:
            raise HTTPError(404, "NOT_FOUND", "no such endpoint")

    async def _v2(self, request: Request, rest: list[str], send: Send) -> None:
        if rest in ([], [""]):
            await self._respond_json(request, send, {})
            return
        if rest == ["_catalog"]:
            view = await self.view()
            repos, more = page(view.catalog, request.query)
            headers = next_link("/v2/_catalog", request.query, repos, more)
            await self._respond_json(request, send, {"repositories": repos}, headers)
            return
        if len(rest) >= 4 and rest[-2:] == ["tags", "list"]:
            repository = "/".join(rest[:-2])
            check_repository(repository)
            repo = (await self.view()).repo(repository)
            tags, more = page(repo.tags, request.query)
            headers = next_link(f"/v2/{repository}/tags/list", request.query, tags, more)
            body = {"name": repo.name, "tags": tags, NAMES_FIELD: [repo.spelled[t] for t in tags]}
            await self._respond_json(request, send, body, headers)
            return
        if len(rest) >= 4 and rest[-2] in ("manifests", "blobs"):
            repository = "/".join(rest[:-2])
            check_repository(repository)
            if rest[-2] == "manifests":
                await self._manifest(request, repository, rest[-1], send)
            else:
                await self._blob(request, repository, Digest.parse(rest[-1]), send)
            return
        raise HTTPError(404, "NOT_FOUND", "no such endpoint")

    # -- manifests -----------------------------------------------------------------------
    async def _manifest(
        self, request: Request, repository: str, reference: str, send: Send
    ) -> None:
        view = await self.view()
        vary = False
        mirrored = None
        if self.mirror is not None and ":" not in reference:
            mirrored = await self.mirror.manifest(
                partial(stored_digest, view),
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
                    manifest = await trio.to_thread.run_sync(manifest_blob, self.layout, digest)
                except ModelNotFoundError:
                    if self.mirror is None:
                        raise
                    mirrored = await self.mirror.manifest(
                        partial(stored_digest, view), repository, reference, lists=True, get=False
                    )
                    if mirrored is None:  # written meanwhile
                        mirrored = await trio.to_thread.run_sync(manifest_blob, self.layout, digest)
                    manifest = mirrored
        else:
            name = name_from_repository(repository, reference)
            if name.is_default_host and request.headers.get("user-agent", "").startswith(
                OLLAMA_AGENT
            ):
                name = view.for_ollama(name)
            manifest = resolve_tag(view, name, request.headers.get("accept"), self.prefer)
            vary = True
        digest = manifest.digest
        etag = entity_tag(digest)
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
        if etag_matches(request.headers.get("if-none-match"), etag):
            await self._respond(request, send, 304, headers, b"", length=False)
            return
        self.stats.manifests_served += request.method == "GET"
        await self._respond(request, send, 200, headers, manifest.raw)

    # -- blobs ---------------------------------------------------------------------------
    async def _blob(self, request: Request, repository: str, digest: Digest, send: Send) -> None:
        view = await self.view()
        open_it = partial(open_blob, self.layout, view, digest, read_small=request.method == "GET")
        try:
            blob = await trio.to_thread.run_sync(open_it)
        except BlobError:
            if self.mirror is None:
                raise
            fetch = await self.mirror.blob(repository, digest)
            blob = await trio.to_thread.run_sync(open_growing, fetch, open_it)
        try:
            await self._send_blob(request, view, digest, blob, send)
        finally:
            os.close(blob.fd)

    async def _send_blob(
        self,
        request: Request,
        view: View,
        digest: Digest,
        blob: OpenBlob,
        send: Send,
    ) -> None:
        size = blob.size
        etag, zstd_etag = entity_tag(digest), entity_tag(digest, "+zstd")
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
            ("Location", location(self.access, request, path)),
        ]
        if compressible:
            headers.append(("Vary", "Accept-Encoding"))
        if_none_match = request.headers.get("if-none-match")
        for tag in (etag, zstd_etag):
            if etag_matches(if_none_match, tag):
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
            packed = await self._zstd.packed(blob, digest)
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
        await send({"type": "http.response.start", "status": status, "headers": encoded(headers)})
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
            await stream_blob(blob.fd, first, length, send, blob.growing)

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
        await send({"type": "http.response.start", "status": status, "headers": encoded(headers)})
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
