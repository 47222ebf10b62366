"""`modelfs push`: models from the store to an OCI registry.

Everything local is checked before the first request: every name resolves, maps to an OCI
repository (sync/wire/registry_names.py), and has all its blobs in the store at the sizes its
manifest says. A missing blob stops the whole push, naming the blob; nothing is sent.

Then, one model after another, against `<URL>/v2/`:

    blobs      HEAD /v2/<repo>/blobs/<d>: there already, skip. Else, when another repository on
               the registry is known to hold it (this push saw it there), a cross-repository
               mount POST …/blobs/uploads/?mount=<d>&from=<repo> (201: done; 202: the registry
               declined and opened an ordinary upload instead). Else POST …/blobs/uploads/, then
               one PUT ?digest= with the bytes (blobs up to `small`), or PATCH parts of `part`
               bytes with Content-Range and an empty PUT ?digest=. Blobs are read from the store
               in 1 MiB pieces and hashed as they go; an upload whose bytes do not hash to the
               blob's name is cancelled before the final PUT, so a corrupt local blob is never
               committed. Several blobs go at once (`parallel`).
    manifest   HEAD /v2/<repo>/manifests/<tag>: the same digest there, skip. Else PUT the bytes
               exactly as stored, with their own media type; the registry's Docker-Content-Digest
               must be the sha256 of what we sent.
    a list     each locally present child manifest is uploaded as a blob and PUT by digest, the
               list bytes are uploaded as a blob, and the tag gets the carrier manifest of
               sync.ocirepr. A child the store lacks is kept in the carrier when the registry
               already has it, and is otherwise left out (the list still names it).

A second push of the same models sends only HEADs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import httpx
import trio

from modelfs.store.digest import CHUNK, Digest
from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import CorruptBlobError, InvalidDigestError, MissingBlobError, StoreError
from modelfs.store.formats.artifacts import (
    OLLAMA,
    UnsupportedArtifactError,
    pack,
    source_artifact,
)
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    MEDIA_MANIFEST,
    MEDIA_OCI_MANIFEST,
    ListChild,
    Manifest,
    ManifestList,
    parse_manifest,
)
from modelfs.store.names import Name, parse_name
from modelfs.store.scan import StoreIndex
from modelfs.sync.client.http import mapped_errors, raise_for_status
from modelfs.sync.errors import (
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    SyncError,
)
from modelfs.sync.wire.ocirepr import MEDIA_CARRIER, encode_list
from modelfs.sync.wire.protocol import DIGEST_HEADER
from modelfs.sync.wire.registry_names import own_repository, reference_for

log = logging.getLogger(__name__)

SMALL = 8 << 20
"""Blobs up to this size go in one PUT, read into memory whole (configs, templates, tensors)."""
PART = 64 << 20
"""PATCH part size for larger blobs; each part is streamed, never held in memory."""
PARALLEL = 4
"""Blobs uploaded at once."""
PROGRESS_INTERVAL = 0.5
"""Seconds between two progress lines of one blob (its first and last are always sent)."""


class PushError(SyncError):
    """A push that cannot go on for a reason on neither side's wire: a bad URL or token file."""


# -- progress ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    """One progress event; `--json` prints each as a line `{"status","digest","total","completed"}`.

    status: `pushing <name>` (a model starts; digest = the model ID, total = its bytes),
    `exists` / `mounted` / `uploading` / `uploaded` (a blob), `pushing manifest` /
    `manifest exists` (a manifest: a child by digest, or the tag), `success` (a model is done),
    `absent` (a list child neither here nor on the registry, left out).
    """

    status: str
    digest: str
    total: int
    completed: int

    def as_json(self) -> str:
        return json.dumps(
            {
                "status": self.status,
                "digest": self.digest,
                "total": self.total,
                "completed": self.completed,
            }
        )


ProgressSink = Callable[[Progress], None]


def _ignore(_: Progress) -> None:
    pass


# -- what a push sends: planned from the store alone ----------------------------------------------


@dataclass(frozen=True, slots=True)
class BlobSource:
    """A blob to make present in the repository: from a store file, or from bytes in hand."""

    digest: Digest
    size: int
    what: str
    path: Path | None = None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class ChildManifest:
    """A list child that is pushed as a manifest by digest (it is in the store)."""

    digest: Digest
    raw: bytes
    media_type: str
    runner: str | None


@dataclass(frozen=True, slots=True)
class ModelPlan:
    name: Name
    repository: str
    tag: str
    top: Manifest | ManifestList
    blobs: tuple[BlobSource, ...]
    """Configs and layers of every pushed manifest, each digest once; for a list also the
    child manifests and the list itself (the carrier references them as blobs)."""
    children: tuple[ChildManifest, ...] = ()
    absent: tuple[ListChild, ...] = ()

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blobs)


def _kind(media_type: str) -> str:
    """`model`, `license`, … for Ollama's layer types; the media type itself otherwise."""
    prefix = "application/vnd.ollama.image."
    return media_type.removeprefix(prefix) if media_type.startswith(prefix) else media_type


def _manifest_blobs(
    index: StoreIndex, name: Name, manifest: Manifest, label: str, out: dict[Digest, BlobSource]
) -> None:
    refs = ([manifest.config] if manifest.config is not None else []) + list(manifest.layers)
    for ref in refs:
        if ref.digest in out:
            continue
        info = index.blob_info(ref.digest)
        what = f"{_kind(ref.media_type)} of {label}"
        if info is None:
            raise MissingBlobError(
                f"cannot push {name.shortest}: blob {ref.digest} ({what}) is missing from the "
                "store; nothing was pushed"
            )
        if info.size != ref.size:
            raise MissingBlobError(
                f"cannot push {name.shortest}: blob {ref.digest} ({what}) has {info.size} "
                f"bytes, the manifest says {ref.size}; nothing was pushed"
            )
        out[ref.digest] = BlobSource(ref.digest, ref.size, what, path=index.layout.blob(ref.digest))


def plan_model(
    index: StoreIndex, text: str, fmt: str = OLLAMA, url: str | None = None
) -> ModelPlan:
    """What pushing one model (to the registry at `url`) sends, as an Ollama model or another
    tool's artifact (store.formats.artifacts); raises (StoreError, RegistryNameError) before
    any I/O. A name on that registry's own host goes where other clients put it
    (`own_repository`)."""
    entry = index.lookup(parse_name(text))
    name = entry.name  # the spelling on disk: the tag keeps its case on the registry
    repository, tag = reference_for(name)
    repository = (own_repository(name, url) if url else None) or repository
    blobs: dict[Digest, BlobSource] = {}
    top = entry.top
    if isinstance(top, Manifest):
        source = source_artifact(index.layout, top, fmt) if fmt != OLLAMA else None
        if source is not None:
            # Landed from this format: the artifact goes back as it came, the same digest.
            _manifest_blobs(index, name, source, name.shortest, blobs)
            return ModelPlan(name, repository, tag, source, tuple(blobs.values()))
        _manifest_blobs(index, name, top, name.shortest, blobs)
        if fmt != OLLAMA:
            packed = pack(top, index.config(top), fmt)
            for digest, data in packed.blobs.items():
                blobs.setdefault(digest, BlobSource(digest, len(data), fmt, data=data))
            top = parse_manifest(packed.raw, f"{fmt} artifact of {name.shortest}")
        return ModelPlan(name, repository, tag, top, tuple(blobs.values()))
    if fmt != OLLAMA:
        raise UnsupportedArtifactError(
            f"cannot push {name.shortest} as {fmt}: it is a manifest list; push one variant"
        )

    children: list[ChildManifest] = []
    inline = {c.digest for c in top.children if c.inline is not None}
    for variant in entry.variants:
        manifest = variant.manifest
        label = f"{name.shortest}@{variant.runner or manifest.digest.short}"
        _manifest_blobs(index, name, manifest, label, blobs)
        if manifest.digest not in inline:
            children.append(
                ChildManifest(manifest.digest, manifest.raw, manifest.media_type, variant.runner)
            )
    if not children and not inline and not entry.absent_children:
        raise MissingBlobError(f"cannot push {name.shortest}: its manifest list names no variant")
    for child in children:
        blobs.setdefault(
            child.digest,
            BlobSource(child.digest, len(child.raw), f"manifest of {child.runner}", data=child.raw),
        )
    blobs[top.digest] = BlobSource(top.digest, len(top.raw), "manifest list", data=top.raw)
    return ModelPlan(
        name, repository, tag, top, tuple(blobs.values()), tuple(children), entry.absent_children
    )


# -- the pusher -------------------------------------------------------------------------------


@dataclass
class PushResult:
    name: Name
    repository: str
    tag: str
    digest: Digest
    """The model ID: the digest of the manifest (or list) bytes in the store."""
    tag_digest: Digest
    """What the tag points to on the registry: the same, or the carrier's digest for a list."""
    size: int = 0
    uploaded: int = 0
    uploaded_bytes: int = 0
    mounted: int = 0
    present: int = 0
    manifests_pushed: int = 0
    variants: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def _registry_errors(response: httpx.Response) -> str:
    """`CODE: message (detail)` from an OCI error body, or the start of the body."""
    try:
        body = response.json()
        errors = body.get("errors") if isinstance(body, dict) else None
    except (ValueError, UnicodeDecodeError):
        errors = None
    if not isinstance(errors, list) or not errors:
        text = response.text.strip().splitlines()
        return text[0][:200] if text else ""
    parts = []
    for err in errors[:3]:
        if not isinstance(err, dict):
            continue
        part = f"{err.get('code', '?')}: {err.get('message', '')}"
        detail = err.get("detail")
        if detail:
            detail_text = detail if isinstance(detail, str) else json.dumps(detail)
            part += f" ({detail_text[:120]})"
        parts.append(part)
    return "; ".join(parts)


def _where(response: httpx.Response) -> str:
    url = response.request.url.copy_with(query=None)  # an upload URL's state is noise
    return f"{response.request.method} {url}"


def _failure(response: httpx.Response, doing: str) -> PeerError:
    status = response.status_code
    errors = _registry_errors(response)
    tail = f": {errors}" if errors else ""
    if status in (401, 403):
        return PeerAuthError(
            f"{_where(response)}: {status} (no or wrong token; see --token-file) "
            f"while {doing}{tail}"
        )
    if status == 404:
        return PeerNotFoundError(f"{_where(response)}: 404 while {doing}{tail}")
    return PeerError(f"{_where(response)}: HTTP {status} while {doing}{tail}")


def _digest_header(response: httpx.Response) -> Digest | None:
    value = response.headers.get(DIGEST_HEADER)
    if value is None:
        return None
    try:
        return Digest.parse(value.strip())
    except InvalidDigestError:
        raise PeerLiedError(
            f"{_where(response)}: {DIGEST_HEADER} {value[:80]!r} is not a sha256 digest"
        ) from None


def _read_hash(f: BinaryIO, n: int, h: hashlib._Hash) -> bytes:
    data = f.read(n)
    h.update(data)
    return data


def _read_small(path: Path, size: int) -> tuple[bytes, Digest]:
    with open_binary(path) as f:
        data = f.read(size + 1)
    return data, Digest.of_bytes(data)


class Pusher:
    """Pushes planned models to one registry through an httpx.AsyncClient (run under trio)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        progress: ProgressSink = _ignore,
        parallel: int = PARALLEL,
        small: int = SMALL,
        part: int = PART,
    ) -> None:
        self.client = client
        self.base = url.rstrip("/")
        self.progress = progress
        self.parallel = max(1, parallel)
        self.small = small
        self.part = max(1, part)
        self._holders: dict[Digest, str] = {}
        """A repository known to hold each blob: the source of cross-repository mounts."""

    # -- requests ---------------------------------------------------------------------------
    def _url(self, repository: str, *rest: str) -> str:
        return "/".join((self.base, "v2", repository, *rest))

    async def _request(
        self, method: str, url: str | httpx.URL, doing: str, **kwargs: object
    ) -> httpx.Response:
        with mapped_errors(self.base, doing):
            return await self.client.request(method, url, **kwargs)  # type: ignore[arg-type]

    async def check(self) -> None:
        """GET /v2/: the URL is an OCI registry and takes our credentials."""
        url = f"{self.base}/v2/"
        response = await self._request("GET", url, "the registry's API version")
        if response.status_code == 404:
            raise PeerNotFoundError(f"{self.base}: not an OCI registry (GET /v2/ answered 404)")
        if response.status_code in (401, 403):
            raise _failure(response, "checking the registry")
        raise_for_status(response, "the registry's API version (GET /v2/)")

    # -- blobs ------------------------------------------------------------------------------
    async def _ensure_blob(self, repository: str, blob: BlobSource, result: PushResult) -> None:
        d = blob.digest
        doing = f"checking blob {d}"
        head = await self._request("HEAD", self._url(repository, "blobs", str(d)), doing)
        if head.status_code == 200:
            self._holders.setdefault(d, repository)
            result.present += 1
            self.progress(Progress("exists", str(d), blob.size, blob.size))
            return
        if head.status_code != 404:
            raise _failure(head, doing)

        location: httpx.URL | None = None
        source = self._holders.get(d)
        uploads = self._url(repository, "blobs", "uploads") + "/"
        if source is not None and source != repository:
            doing = f"mounting blob {d} from {source}"
            params = {"mount": str(d), "from": source}
            response = await self._request("POST", uploads, doing, params=params)
            if response.status_code == 201:
                got = _digest_header(response)
                if got is not None and got != d:
                    raise PeerLiedError(f"{_where(response)}: mounted {got} when asked for {d}")
                result.mounted += 1
                self.progress(Progress("mounted", str(d), blob.size, blob.size))
                return
            if response.status_code != 202:
                raise _failure(response, doing)
            location = self._location(response, doing)
            log.debug("mount of %s from %s declined; uploading", d, source)
        if location is None:
            doing = f"starting the upload of blob {d}"
            response = await self._request("POST", uploads, doing)
            if response.status_code != 202:
                raise _failure(response, doing)
            location = self._location(response, doing)

        session = [location]  # the upload's URL, as the registry moves it along
        try:
            if blob.data is not None or blob.size <= self.small:
                response = await self._put_whole(blob, location)
            else:
                response = await self._put_parts(blob, session)
        except BaseException:
            with trio.move_on_after(10, shield=True), contextlib.suppress(SyncError):
                # Cancel the upload session, so no half upload is left behind.
                await self._request("DELETE", session[-1], f"cancelling the upload of {d}")
            raise
        got = _digest_header(response)
        if got is not None and got != d:
            raise PeerLiedError(
                f"{_where(response)}: the registry stored blob {d} as {got}, which is not what "
                "we sent"
            )
        self._holders.setdefault(d, repository)
        result.uploaded += 1
        result.uploaded_bytes += blob.size
        self.progress(Progress("uploaded", str(d), blob.size, blob.size))

    def _location(self, response: httpx.Response, doing: str) -> httpx.URL:
        value = response.headers.get("Location")
        if not value:
            raise PeerError(f"{_where(response)}: no Location header while {doing}")
        return response.request.url.join(value)

    def _check_bytes(self, blob: BlobSource, size: int, actual: Digest) -> None:
        if size != blob.size or actual != blob.digest:
            where = f" ({blob.path})" if blob.path else ""
            raise CorruptBlobError(
                f"blob {blob.digest}{where} in the store does not match its name (read {size} "
                f"bytes hashing to {actual}); it was not pushed; run `modelfs verify`"
            )

    async def _put_whole(self, blob: BlobSource, location: httpx.URL) -> httpx.Response:
        d = blob.digest
        if blob.data is not None:
            data, actual = blob.data, Digest.of_bytes(blob.data)
        else:
            assert blob.path is not None
            data, actual = await trio.to_thread.run_sync(_read_small, blob.path, blob.size)
        self._check_bytes(blob, len(data), actual)
        self.progress(Progress("uploading", str(d), blob.size, 0))
        doing = f"uploading blob {d}"
        response = await self._request(
            "PUT",
            location.copy_merge_params({"digest": str(d)}),
            doing,
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        if response.status_code != 201:
            raise _failure(response, doing)
        return response

    async def _put_parts(self, blob: BlobSource, session: list[httpx.URL]) -> httpx.Response:
        """PATCH the blob in parts, then PUT ?digest=; `session[-1]` is the current URL."""
        d = blob.digest
        location = session[-1]
        assert blob.path is not None
        h = hashlib.sha256()
        doing = f"uploading blob {d}"
        sent = 0
        last = 0.0

        def advanced(n: int) -> None:
            nonlocal sent, last
            sent += n
            now = time.monotonic()
            if now - last >= PROGRESS_INTERVAL:
                last = now
                self.progress(Progress("uploading", str(d), blob.size, sent))

        self.progress(Progress("uploading", str(d), blob.size, 0))
        f = await trio.to_thread.run_sync(open, blob.path, "rb")
        try:
            offset = 0
            while offset < blob.size:
                n = min(self.part, blob.size - offset)
                response = await self._request(
                    "PATCH",
                    location,
                    doing,
                    content=self._pieces(f, n, h, blob, advanced),
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Length": str(n),
                        "Content-Range": f"{offset}-{offset + n - 1}",
                    },
                )
                if response.status_code != 202:
                    raise _failure(response, doing)
                stored = response.headers.get("Range", "")
                if stored and stored != f"0-{offset + n - 1}":
                    raise PeerError(
                        f"{_where(response)}: the registry holds bytes {stored} of blob {d} "
                        f"after we sent 0-{offset + n - 1}"
                    )
                location = self._location(response, doing)
                session.append(location)
                offset += n
            extra = await trio.to_thread.run_sync(f.read, 1)
        finally:
            f.close()
        self._check_bytes(blob, offset + len(extra), Digest(h.hexdigest()))
        response = await self._request(
            "PUT",
            location.copy_merge_params({"digest": str(d)}),
            doing,
            content=b"",
            headers={"Content-Type": "application/octet-stream"},
        )
        if response.status_code != 201:
            raise _failure(response, doing)
        return response

    async def _pieces(
        self,
        f: BinaryIO,
        n: int,
        h: hashlib._Hash,
        blob: BlobSource,
        advanced: Callable[[int], None],
    ) -> AsyncIterator[bytes]:
        remaining = n
        while remaining:
            data = await trio.to_thread.run_sync(_read_hash, f, min(CHUNK, remaining), h)
            if not data:
                raise CorruptBlobError(
                    f"blob {blob.digest} ({blob.path}) is shorter than the {blob.size} bytes its "
                    "manifest says; it was not pushed"
                )
            remaining -= len(data)
            advanced(len(data))
            yield data

    # -- manifests --------------------------------------------------------------------------
    async def _ensure_manifest(
        self, repository: str, reference: str, raw: bytes, media_type: str, what: str
    ) -> bool:
        """Put `raw` at `reference` unless it is there already; True when it was put."""
        digest = Digest.of_bytes(raw)
        url = self._url(repository, "manifests", reference)
        doing = f"checking the manifest of {what}"
        accept = ", ".join(dict.fromkeys((media_type, MEDIA_MANIFEST, MEDIA_OCI_MANIFEST)))
        head = await self._request("HEAD", url, doing, headers={"Accept": accept})
        if head.status_code == 200 and _digest_header(head) == digest:
            self.progress(Progress("manifest exists", str(digest), len(raw), len(raw)))
            return False
        if head.status_code in (401, 403):
            raise _failure(head, doing)
        # Anything else (404; 400 when distribution cannot convert what the tag holds to a type
        # we accept) means the tag does not hold our bytes: put them.
        self.progress(Progress("pushing manifest", str(digest), len(raw), 0))
        doing = f"pushing the manifest of {what}"
        response = await self._request(
            "PUT", url, doing, content=raw, headers={"Content-Type": media_type}
        )
        if not response.is_success:
            raise _failure(response, doing)
        got = _digest_header(response)
        if got is None:
            # No header: ask for our digest; the registry must have our exact bytes under it.
            check = await self._request(
                "HEAD",
                self._url(repository, "manifests", str(digest)),
                doing,
                headers={"Accept": media_type},
            )
            got = digest if check.status_code == 200 else None
            if got is None:
                raise PeerLiedError(
                    f"{_where(response)}: the registry does not hold manifest {digest} of {what} "
                    "after accepting it"
                )
        if got != digest:
            raise PeerLiedError(
                f"{_where(response)}: the registry answered {DIGEST_HEADER} {got} for the "
                f"manifest of {what}, but the bytes we sent hash to {digest}"
            )
        self.progress(Progress("pushing manifest", str(digest), len(raw), len(raw)))
        return True

    async def _remote_child(self, repository: str, child: ListChild, what: str) -> bytes | None:
        """The bytes of a list child the store lacks, when the registry holds it as a blob."""
        d = child.digest
        url = self._url(repository, "blobs", str(d))
        head = await self._request("HEAD", url, f"checking child manifest {d}")
        if head.status_code == 404:
            return None
        if head.status_code != 200:
            raise _failure(head, f"checking child manifest {d}")
        response = await self._request("GET", url, f"child manifest {d}")
        raise_for_status(response, f"child manifest {d} of {what}")
        raw = response.content
        if len(raw) > MAX_MANIFEST_BYTES or Digest.of_bytes(raw) != d:
            raise PeerLiedError(f"GET {url}: the bytes do not hash to {d}")
        try:
            manifest = parse_manifest(raw, f"child manifest {d} on the registry")
        except StoreError as exc:
            log.warning("%s: %s; left out of the list's carrier", what, exc)
            return None
        if not isinstance(manifest, Manifest):
            log.warning("%s: child %s on the registry is itself a list; left out", what, d)
            return None
        try:
            await self._ensure_manifest(repository, str(d), raw, manifest.media_type, what)
        except PeerError as exc:
            log.warning("%s: child %s cannot be kept: %s", what, d, exc)
            return None
        return raw

    # -- models -----------------------------------------------------------------------------
    async def _each(self, jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
        """Run jobs `parallel` at a time; the first failure cancels the rest and is raised."""
        failures: list[BaseException] = []
        limiter = trio.CapacityLimiter(self.parallel)
        async with trio.open_nursery() as nursery:

            async def run(job: Callable[[], Awaitable[None]]) -> None:
                try:
                    async with limiter:
                        await job()
                except (SyncError, StoreError, OSError) as exc:
                    if not failures:
                        failures.append(exc)
                    nursery.cancel_scope.cancel()

            for job in jobs:
                nursery.start_soon(run, job)
        if failures:
            raise failures[0]

    async def push(self, plan: ModelPlan) -> PushResult:
        repo = plan.repository
        top = plan.top
        result = PushResult(plan.name, repo, plan.tag, top.digest, top.digest, size=plan.size)
        what = plan.name.shortest
        self.progress(Progress(f"pushing {what}", str(top.digest), plan.size, 0))

        def job(blob: BlobSource) -> Callable[[], Awaitable[None]]:
            return lambda: self._ensure_blob(repo, blob, result)

        # The list's own blob last among them: it is what makes the others a model.
        await self._each([job(b) for b in plan.blobs if b.digest != top.digest])

        if isinstance(top, ManifestList):
            available: list[bytes] = []
            for child in plan.children:
                label = f"{what}@{child.runner or child.digest.short}"
                if await self._ensure_manifest(
                    repo, str(child.digest), child.raw, child.media_type, label
                ):
                    result.manifests_pushed += 1
                available.append(child.raw)
                result.variants.append(child.runner or child.digest.short)
            for absent in plan.absent:
                raw = await self._remote_child(repo, absent, what)
                label = absent.runner or absent.digest.short
                if raw is None:
                    result.left_out.append(label)
                    self.progress(Progress("absent", str(absent.digest), 0, 0))
                    log.info("%s: variant %s is not in the store nor on the registry", what, label)
                else:
                    available.append(raw)
                    result.variants.append(f"{label} (already on the registry)")
            list_blob = next(b for b in plan.blobs if b.digest == top.digest)
            await self._ensure_blob(repo, list_blob, result)
            raw, media_type = encode_list(top.raw, available), MEDIA_CARRIER
        else:
            raw, media_type = top.raw, top.media_type
        result.tag_digest = Digest.of_bytes(raw)
        if await self._ensure_manifest(repo, plan.tag, raw, media_type, what):
            result.manifests_pushed += 1
        self.progress(Progress("success", str(top.digest), plan.size, plan.size))
        return result


# -- the command -------------------------------------------------------------------------------


def check_url(url: str) -> str:
    parsed = httpx.URL(url) if "://" in url else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise PushError(f"--to {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    if parsed.query or parsed.fragment:
        raise PushError(f"--to {url!r}: a registry URL has no query or fragment")
    return url.rstrip("/")


async def push_all(
    plans: Sequence[ModelPlan],
    url: str,
    client: httpx.AsyncClient,
    *,
    progress: ProgressSink = _ignore,
    on_result: Callable[[PushResult], None] | None = None,
    **options: int,
) -> list[PushResult]:
    pusher = Pusher(client, url, progress=progress, **options)
    await pusher.check()
    results = []
    for plan in plans:
        result = await pusher.push(plan)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
