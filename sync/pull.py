"""`modelfs pull`: fetch models from peers into a store, verified, resumable, manifests last.

    await pull(layout, names, sources, options, progress) -> PullReport
    Puller(layout, peers, options, progress).pull_one(name) -> ModelResult

For each name, in order:

1. **Manifest.** `GET /v2/<repo>/manifests/<tag>` with `Accept` naming Ollama's list type
   first, from the first source that answers (a source that is unreachable, answers 5xx,
   401, 404 or sends bytes that do not hash to its `Docker-Content-Digest` is passed over,
   and named in the error if none answers). For a manifest list, children are chosen by
   `prefer` (the first runner in that order that the list has; all of them with
   `all_variants`) and each is fetched by digest and checked against it.
2. **Blobs.** Config and layers of every chosen manifest. A blob already in `blobs/` with the
   size the manifest gives is not fetched; one with another size counts as missing, and its
   replacement is renamed over it (never written in place). Missing blobs are fetched four at
   a time:
   - small ones (under `small_max`, 8 MiB) whole, through httpx, hashed in memory, written to
     a temp file in `.modelfs/tmp/`, fsynced, renamed into `blobs/`;
   - larger ones through `sync.partial.PartialBlob` (a preallocated temp file, a sidecar of
     finished byte ranges, a lock), in `chunk`-sized ranged GETs (32 MiB): one connection
     below `parallel_min` (256 MiB), `workers` (4) connections in parallel above it, each
     `recv_into` a buffer and `pwrite` at its offset in a worker thread. A hasher thread
     follows the contiguous prefix from byte 0 (the ranges are handed out in order, so the
     prefix grows steadily and the hash finishes right after the last byte), reading it
     back from the page cache; writeback is started as data lands and the sidecar is
     checkpointed (fdatasync, then the sidecar) every second. When the sha256 matches, the
     file is fsynced and renamed into `blobs/` with a fresh mtime; when it does not, the
     temp file is deleted. After an interruption (kill -9 included) the next run resumes:
     only ranges the sidecar does not list are fetched, with `Range`.
3. **Manifests, last**, each only once every blob it names is present with the right size,
   written atomically (temp file in `.modelfs/tmp/`, fsync, rename), byte for byte:
   - a plain manifest: `manifests/<host>/<ns>/<model>/<tag>`, the legacy file every Ollama
     version reads (and, if the store already has a `manifests-v2/` entry for that name, it
     is moved to the new manifest too, because v2 hides legacy);
   - a manifest list (see `write_list`): the child manifest blobs, then the list blob and
     the `manifests-v2/…/<tag>` symlink to it, then the legacy anchor.

Sources: each blob tries the source that served the manifest first, then the others in the
order given. A source that is unreachable, times out, stalls for `read_timeout` seconds or
answers 5xx is passed over and may be tried once more after the others (the bytes it sent
are kept); one that answers 401/403/404 is not asked again for that blob; one that sends wrong
bytes (a digest mismatch, a wrong Content-Length or Content-Range, a truncated body) is
named in a warning and in the report and is not used again for that blob (after a digest
mismatch, the temp file is deleted, since any byte of it may be the bad one).

A full disk, a read-only store or a permission error is a `LocalWriteError` naming the
store; the temp file is removed (if nothing of it is worth keeping) or left resumable, and
nothing is promoted.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio

from store.blobs import BlobStore
from store.digest import Digest
from store.errors import StoreError
from store.layout import Layout
from store.manifest import (
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    go_marshal,
    parse_manifest,
)
from store.names import Name, parse_name
from store.scan import DEFAULT_PREFER, scan_store
from sync import progress as P
from sync.client import (
    Conn,
    FetchedManifest,
    NeedsHttpx,
    PeerClient,
    Stopped,
    TruncatedBodyError,
    repositories,
)
from sync.errors import (
    LocalWriteError,
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    PeerUnreachableError,
    SyncError,
)
from sync.http import READ_TIMEOUT, make_client, mapped_errors, raise_for_status
from sync.ocirepr import decode_list, parse_carrier
from sync.partial import BlobBusyError, PartialBlob, RangeSet, split, start_writeback

log = logging.getLogger(__name__)

MiB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class PullOptions:
    prefer: tuple[str, ...] = DEFAULT_PREFER
    all_variants: bool = False
    read_timeout: float = READ_TIMEOUT
    small_max: int = 8 * MiB  # blobs below this are fetched whole, in memory
    parallel_min: int = 256 * MiB  # blobs from this size on use `workers` connections
    workers: int = 4
    chunk: int = 32 * MiB  # one ranged GET
    buffer: int = 4 * MiB  # per connection; one pwrite
    max_blobs: int = 4  # blobs in flight at once
    checkpoint_every: float = 1.0
    rounds: int = 2  # tries per source and blob, for transient failures


@dataclass
class ModelResult:
    name: str
    digest: Digest
    written: list[str] = field(default_factory=list)
    fetched: int = 0
    fetched_bytes: int = 0
    present: int = 0
    avoided: dict[str, str] = field(default_factory=dict)  # peer URL -> what it did

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest.hex,
            "written": self.written,
            "fetched": self.fetched,
            "fetched_bytes": self.fetched_bytes,
            "present": self.present,
            "avoided": self.avoided,
        }


@dataclass
class PullReport:
    models: list[ModelResult] = field(default_factory=list)


# -- choosing children ------------------------------------------------------------------------
def _runner_of(runner: str | None, fmt: str | None) -> str:
    if runner:
        return runner.lower()
    # No runner metadata: inferred from the format, as Ollama does.
    return {"safetensors": "mlx", "gguf": "ggml"}.get((fmt or "").lower(), "")


def select_children(lst: ManifestList, prefer: Sequence[str], all_variants: bool) -> list[int]:
    """Indexes of the children to pull: all, or the single best by `prefer` (list order
    breaks ties; a runner not in `prefer` ranks after every one that is)."""
    if all_variants:
        return list(range(len(lst.children)))
    order = [p.lower() for p in prefer]

    def rank(i: int) -> tuple[int, int]:
        c = lst.children[i]
        r = _runner_of(c.runner, c.format)
        return (order.index(r) if r in order else len(order), i)

    return [min(range(len(lst.children)), key=rank)] if lst.children else []


def _is_gguf(runner: str | None, fmt: str | None, manifest: Manifest) -> bool:
    if (fmt or manifest.format or "").lower() == "gguf":
        return True
    if (runner or "").lower() in ("llamacpp", "ggml"):
        return True
    return any(layer.kind == "model" for layer in manifest.layers)


def anchor_bytes(
    child_raw: bytes, list_raw: bytes, refs: Sequence[tuple[str, Digest, int]]
) -> bytes:
    """The legacy anchor written for a manifest list: the chosen child manifest's own JSON,
    with one more layer per manifest blob the tag depends on (the list, then each child
    manifest blob that is present, in list order), as Go's json.Marshal writes it, without a
    trailing newline."""
    obj = json.loads(child_raw.decode("utf-8"))
    layers = list(obj.get("layers") or [])
    layers.append(
        {"mediaType": MEDIA_LIST, "digest": str(Digest.of_bytes(list_raw)), "size": len(list_raw)}
    )
    for media_type, digest, size in refs:
        layers.append({"mediaType": media_type, "digest": str(digest), "size": size})
    obj["layers"] = layers
    return go_marshal(obj)


def _child_media_type(list_raw: bytes, index: int) -> str:
    """The `mediaType` a list gives its child at `index` (the anchor's reference says the same)."""
    try:
        value = json.loads(list_raw.decode("utf-8"))["manifests"][index].get("mediaType")
    except (ValueError, LookupError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else MEDIA_MANIFEST


# -- errors -----------------------------------------------------------------------------------
def _local_error(exc: OSError, layout: Layout, what: str) -> LocalWriteError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LocalWriteError(f"no space left on device for {what} in the store {layout.root}")
    if exc.errno == errno.EXDEV:
        return LocalWriteError(
            f"{layout.tmp} and {layout.blobs} are on different filesystems; cannot write {what}"
        )
    why = exc.strerror or str(exc)
    return LocalWriteError(f"cannot write {what} in the store {layout.root}: {why}")


def _one_error(errors: list[tuple[str, SyncError]], what: str) -> SyncError:
    """One exception whose one-line message names every peer and what it did."""
    if len(errors) == 1:
        return errors[0][1]
    kinds = [type(e) for _, e in errors]
    cls: type[SyncError]
    for cls in (PeerLiedError, PeerAuthError, PeerNotFoundError, PeerUnreachableError):
        if cls in kinds:
            break
    else:
        cls = type(errors[0][1])
    seen: dict[str, None] = {}
    for _, e in errors:
        seen.setdefault(str(e))
    return cls(f"no peer could send {what}: " + "; ".join(seen))


class _Sources:
    """Which peer to ask next for one blob or manifest, and what each did."""

    def __init__(self, peers: Sequence[PeerClient], rounds: int) -> None:
        self.peers = list(peers)
        self.rounds = rounds
        self.tries = {p.url: 0 for p in self.peers}
        self.banned: dict[str, str] = {}
        self.errors: list[tuple[str, SyncError]] = []

    def next(self) -> PeerClient | None:
        for round_ in range(self.rounds):
            for peer in self.peers:
                if peer.url not in self.banned and self.tries[peer.url] == round_:
                    return peer
        return None

    def failed(self, peer: PeerClient, exc: SyncError) -> None:
        self.tries[peer.url] += 1
        self.errors.append((peer.url, exc))
        if isinstance(exc, (PeerLiedError, PeerAuthError, PeerNotFoundError)):
            self.banned[peer.url] = str(exc)


# -- threads under trio -----------------------------------------------------------------------
async def in_thread(fn: Callable[..., T], *args: Any, stop: threading.Event) -> T:
    """Run `fn` in a worker thread. On cancellation, set `stop` (which `fn` polls) and wait
    for the thread to return before unwinding, so no thread outlives the files it uses."""
    lock = threading.Lock()
    started = cancelled = False
    finished = threading.Event()

    def run() -> T:
        nonlocal started
        with lock:
            if cancelled:  # cancelled while waiting for a thread: never start
                raise Stopped()
            started = True
        try:
            return fn(*args)
        finally:
            finished.set()

    try:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    except trio.Cancelled:
        stop.set()
        with lock:
            cancelled = True
            running = started
        if running:
            with trio.CancelScope(shield=True):
                # The thread polls `stop` every POLL seconds. (Waiting for it in another
                # thread would need a slot in a pool that may be full.)
                while not finished.is_set():  # noqa: ASYNC110
                    await trio.sleep(0.01)
        raise


# -- one large blob in flight -----------------------------------------------------------------
class _Transfer:
    """Shared state of one large blob's attempt from one peer: what is on disk, what is
    still to fetch, the first error, and the stop flag every thread polls."""

    def __init__(self, partial: PartialBlob, pieces: list[tuple[int, int]]) -> None:
        self.partial = partial
        self.size = partial.size
        self.done = RangeSet(partial.done.as_list())
        self.todo = list(pieces)
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.hashed = 0
        self.fetched = 0  # bytes received in this attempt

    def take(self) -> tuple[int, int] | None:
        with self.cond:
            if self.stop.is_set() or not self.todo:
                return None
            return self.todo.pop(0)

    def wrote(self, start: int, end: int) -> None:
        with self.cond:
            self.done.add(start, end)
            self.fetched += end - start
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.stop.set()
            self.cond.notify_all()

    def snapshot(self) -> RangeSet:
        with self.cond:
            return RangeSet(self.done.as_list())

    def completed(self) -> int:
        with self.cond:
            return self.done.total()

    def wait_prefix(self, beyond: int) -> int:
        """Block until bytes past `beyond` from 0 are on disk; raise Stopped on stop."""
        with self.cond:
            while True:
                prefix = self.done.prefix()
                if prefix > beyond:
                    return prefix
                if self.stop.is_set():
                    raise Stopped()
                self.cond.wait(0.25)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# -- the puller -------------------------------------------------------------------------------
class Puller:
    """Pulls names from `peers` into one store; reusable for several names."""

    def __init__(
        self,
        layout: Layout,
        peers: Sequence[PeerClient],
        options: PullOptions | None = None,
        progress: P.Progress | None = None,
    ) -> None:
        if not peers:
            raise ValueError("no peers to pull from")
        self.layout = layout
        self.store = BlobStore(layout)
        self.peers = list(peers)
        self.options = options or PullOptions()
        self.progress: P.Progress = progress or P.NullProgress()
        self._blob_limit = trio.CapacityLimiter(self.options.max_blobs)

    # -- manifests ----------------------------------------------------------------------------
    async def _manifest(
        self, name: Name, ref: str | Digest, peers: Sequence[PeerClient], expect: Digest | None
    ) -> tuple[FetchedManifest, Manifest | ManifestList]:
        sources = _Sources(peers, 1)
        while (peer := sources.next()) is not None:
            try:
                fetched = await peer.manifest(name, ref, expect=expect)
                try:
                    if expect is None:
                        fetched = await self._uncarry(peer, name, fetched)
                    parsed = parse_manifest(fetched.raw, f"{peer.url}: manifest {ref}")
                except StoreError as exc:
                    raise PeerLiedError(str(exc)) from None
                return fetched, parsed
            except SyncError as exc:
                log.debug("%s: %s", peer.url, exc)
                sources.failed(peer, exc)
        what = f"manifest {name.shortest}" if expect is None else f"manifest {ref}"
        raise _one_error(sources.errors, what)

    async def _uncarry(
        self, peer: PeerClient, name: Name, fetched: FetchedManifest
    ) -> FetchedManifest:
        """A manifest list that `modelfs push` stored in a registry as a carrier manifest
        (sync.ocirepr): the list's own bytes, from the carrier's config blob, verified."""
        carrier = parse_carrier(fetched.raw, fetched.media_type)
        if carrier is None:
            return fetched
        ref = carrier.list_ref
        the_list = decode_list(carrier, await peer.blob(name, ref.digest, ref.size))
        return FetchedManifest(the_list.raw, MEDIA_LIST, the_list.digest, peer.url)

    def _order(self, first: str) -> list[PeerClient]:
        return sorted(self.peers, key=lambda p: p.url != first)

    # -- the whole model ----------------------------------------------------------------------
    async def pull_one(self, text: str) -> ModelResult:
        name = parse_name(text)
        index = await trio.to_thread.run_sync(scan_store, self.layout)
        existing = index.entries.get(name.key)
        if existing is not None:
            name = existing.name  # keep the store's spelling, as Ollama's getExistingName
        had_v2 = existing is not None and existing.source == "v2"
        label = name.shortest
        self.progress.status(label, P.PULLING_MANIFEST)
        log.debug("%s: asking %s", label, ", ".join(p.url for p in self.peers))

        top, parsed = await self._manifest(name, name.tag, self.peers, None)
        peers = self._order(top.url)
        result = ModelResult(label, top.digest)
        children: list[tuple[int, FetchedManifest | None, Manifest]] = []
        if isinstance(parsed, ManifestList):
            for i in select_children(parsed, self.options.prefer, self.options.all_variants):
                child = parsed.children[i]
                if child.inline is not None:
                    children.append((i, None, child.inline))
                    continue
                fetched, manifest = await self._manifest(name, child.digest, peers, child.digest)
                if isinstance(manifest, ManifestList):
                    raise PeerError(f"{fetched.url}: manifest list {top.digest} nests a list")
                children.append((i, fetched, manifest))
            if not children:
                raise PeerError(f"{top.url}: manifest list for {label} has no children")
            manifests = [m for _, _, m in children]
        else:
            manifests = [parsed]

        # Every blob once, config first, in manifest order.
        blobs: dict[Digest, int] = {}
        for m in manifests:
            if m.config is not None:
                blobs.setdefault(m.config.digest, m.config.size)
            for layer in m.layers:
                blobs.setdefault(layer.digest, layer.size)
        missing = await trio.to_thread.run_sync(self._missing, blobs)
        for digest, size in blobs.items():
            if digest not in missing:
                result.present += 1
                self.progress.blob(label, digest, size, size)
        await self._fetch_all(name, label, {d: blobs[d] for d in missing}, peers, result)

        self.progress.status(label, P.VERIFYING)
        self.progress.status(label, P.WRITING_MANIFEST)
        await trio.to_thread.run_sync(self._check_present, blobs)
        if isinstance(parsed, ManifestList):
            written = await trio.to_thread.run_sync(
                self.write_list, name, top.raw, parsed, children
            )
        else:
            written = await trio.to_thread.run_sync(self.write_manifest, name, top.raw, had_v2)
        result.written = [str(p.relative_to(self.layout.root)) for p in written]
        self.progress.done(label)
        return result

    def _blob_ok(self, digest: Digest, size: int) -> bool:
        try:
            st = os.stat(self.layout.blob(digest), follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def _missing(self, blobs: dict[Digest, int]) -> list[Digest]:
        return [d for d, size in blobs.items() if not self._blob_ok(d, size)]

    def _check_present(self, blobs: dict[Digest, int]) -> None:
        absent = self._missing(blobs)
        if absent:  # pragma: no cover - a fetch that returned without its blob
            raise LocalWriteError(f"blob {absent[0]} vanished from {self.layout.blobs}")

    # -- writing manifests --------------------------------------------------------------------
    def _manifest_blob(self, raw: bytes) -> Digest:
        """`raw` as a blob; a blob of that name with other bytes is replaced (renamed over)."""
        digest = Digest.of_bytes(raw)
        path = self.layout.blob(digest)
        try:
            if path.is_file() and not path.is_symlink() and path.read_bytes() == raw:
                os.utime(path)
                return digest
        except OSError:
            pass
        try:
            with self.store.temp_file("manifest-") as (f, temp):
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
                f.close()
                self.store.install(temp, digest)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"manifest blob {digest}") from None
        return digest

    def write_manifest(self, name: Name, raw: bytes, had_v2: bool) -> list[Path]:
        """A plain manifest: the legacy file, which every Ollama version reads. If the store
        has a `manifests-v2/` entry for the name, it would hide the legacy file, so it is
        pointed at this manifest too (stored as a blob, as Ollama's v2 writer does)."""
        try:
            written = [self.store.write_legacy_manifest(name, raw)]
            if had_v2:
                self._manifest_blob(raw)
                written.append(self.store.write_v2_manifest(name, raw))
        except OSError as exc:
            raise _local_error(exc, self.layout, f"the manifest of {name.shortest}") from None
        return written

    def write_list(
        self,
        name: Name,
        list_raw: bytes,
        lst: ManifestList,
        children: list[tuple[int, FetchedManifest | None, Manifest]],
    ) -> list[Path]:
        """A manifest list, written the way Ollama's manifest-list migration leaves a store:

        1. each pulled child manifest that the list references by digest, as a blob
           `blobs/sha256-<child>` (exact bytes; inline children have no blob of their own);
        2. the list itself as a blob, and `manifests-v2/<host>/<ns>/<model>/<tag>`, a
           relative symlink to it (a hardlink, then a copy, where symlinks fail), made in
           `.modelfs/tmp/` and renamed into place. Ollama with manifest lists reads this, and
           it hides the legacy file of the same name;
        3. the legacy anchor `manifests/<host>/<ns>/<model>/<tag>`: the preferred pulled gguf
           child (else the first pulled child) with one extra layer per manifest blob above
           (the list, then the pulled child manifests in list order). An Ollama from before
           manifest lists reads only `manifests/`: the anchor lets it list and run the gguf
           variant, and because its prune keeps every blob a legacy manifest names, it keeps
           the list and child manifest blobs too. (It does not name another child's layers;
           those are kept by the v2 entry on a current Ollama, and by their fresh mtime for an
           hour on an old one.) This is the same anchor `modelfs demo-store` and Ollama's own
           migration leave, so a pulled store matches its source byte for byte.

        Lists after their children; the anchor last, so each file only names what is already
        there.
        """
        try:
            refs: list[tuple[str, Digest, int]] = []
            for i, fetched, manifest in sorted(children, key=lambda c: c[0]):
                if fetched is not None:
                    self._manifest_blob(fetched.raw)
                    media_type = _child_media_type(list_raw, i)
                    refs.append((media_type, manifest.digest, len(fetched.raw)))
            self._manifest_blob(list_raw)
            written = [self.store.write_v2_manifest(name, list_raw)]

            def rank(item: tuple[int, FetchedManifest | None, Manifest]) -> tuple[int, int]:
                i, _, m = item
                c = lst.children[i]
                order = [p.lower() for p in self.options.prefer]
                r = _runner_of(c.runner, c.format)
                return (
                    0 if _is_gguf(c.runner, c.format, m) else 1,
                    order.index(r) if r in order else len(order),
                )

            _, _, chosen = min(children, key=rank)
            anchor = anchor_bytes(chosen.raw, list_raw, refs)
            written.append(self.store.write_legacy_manifest(name, anchor))
        except OSError as exc:
            raise _local_error(exc, self.layout, f"the manifests of {name.shortest}") from None
        return written

    # -- blobs --------------------------------------------------------------------------------
    async def _fetch_all(
        self,
        name: Name,
        label: str,
        missing: dict[Digest, int],
        peers: list[PeerClient],
        result: ModelResult,
    ) -> None:
        if not missing:
            return
        failure: list[BaseException] = []
        live: dict[Digest, Callable[[], int]] = {}

        async def one(digest: Digest, size: int) -> None:
            try:
                async with self._blob_limit:
                    self.progress.blob(label, digest, size, 0)
                    await self._fetch_blob(name, digest, size, peers, result, live)
                    self.progress.blob(label, digest, size, size)
            except (SyncError, StoreError) as exc:
                failure.append(exc)
                nursery.cancel_scope.cancel()

        async def report() -> None:
            while True:
                await trio.sleep(0.1)
                for digest, completed in list(live.items()):
                    self.progress.blob(label, digest, missing[digest], completed())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            async with trio.open_nursery() as blobs:
                for digest, size in missing.items():
                    blobs.start_soon(one, digest, size)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _fetch_blob(
        self,
        name: Name,
        digest: Digest,
        size: int,
        peers: list[PeerClient],
        result: ModelResult,
        live: dict[Digest, Callable[[], int]],
    ) -> None:
        sources = _Sources(peers, self.options.rounds)
        t0 = time.monotonic()
        if size < self.options.small_max:
            await self._fetch_small(name, digest, size, sources, result)
        else:
            await self._fetch_large(name, digest, size, sources, result, live)
        dt = time.monotonic() - t0
        result.fetched += 1
        result.fetched_bytes += size
        log.debug("fetched %s (%d bytes) in %.2f s", digest, size, dt)

    def _avoid(
        self,
        sources: _Sources,
        peer: PeerClient,
        exc: SyncError,
        result: ModelResult,
        digest: Digest,
    ) -> None:
        sources.failed(peer, exc)
        if isinstance(exc, PeerLiedError):
            result.avoided[peer.url] = str(exc)
            log.warning("%s; not using %s again for %s", exc, peer.url, digest)
        else:
            log.info("%s", exc)

    async def _fetch_small(
        self, name: Name, digest: Digest, size: int, sources: _Sources, result: ModelResult
    ) -> None:
        while (peer := sources.next()) is not None:
            try:
                data = await peer.blob(name, digest, size)
            except SyncError as exc:
                self._avoid(sources, peer, exc, result, digest)
                continue
            await trio.to_thread.run_sync(self._install_bytes, digest, data)
            return
        raise _one_error(sources.errors, f"blob {digest}")

    def _install_bytes(self, digest: Digest, data: bytes) -> None:
        try:
            with self.store.temp_file("pull-") as (f, temp):
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                f.close()
                self.store.install(temp, digest)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {digest}") from None

    # -- large blobs --------------------------------------------------------------------------
    async def _open_partial(self, digest: Digest, size: int) -> PartialBlob | None:
        """Lock and open the temp file; None if another process finished the blob while we
        waited for its lock."""
        said = False
        while True:
            try:
                return await trio.to_thread.run_sync(PartialBlob.open, self.layout, digest, size)
            except BlobBusyError as exc:
                if not said:
                    log.info("%s is being fetched by %s; waiting", digest, exc.owner)
                    said = True
            except OSError as exc:
                raise _local_error(exc, self.layout, f"blob {digest} ({size} bytes)") from None
            if await trio.to_thread.run_sync(self._blob_ok, digest, size):
                return None
            await trio.sleep(0.5)

    async def _fetch_large(
        self,
        name: Name,
        digest: Digest,
        size: int,
        sources: _Sources,
        result: ModelResult,
        live: dict[Digest, Callable[[], int]],
    ) -> None:
        partial = await self._open_partial(digest, size)
        if partial is None:
            return
        retried_clean = False
        try:
            while (peer := sources.next()) is not None:
                resumed = partial.resumed
                transfer = _Transfer(partial, split(partial.done.missing(size), self.options.chunk))
                live[digest] = transfer.completed
                try:
                    got = await self._attempt(name, peer, transfer)
                except SyncError as exc:
                    if isinstance(exc, LocalWriteError):
                        raise
                    self._avoid(sources, peer, exc, result, digest)
                    continue
                finally:
                    live.pop(digest, None)
                if got == digest.hex:
                    await trio.to_thread.run_sync(self._promote, partial)
                    return
                # Wrong bytes. Delete them all: any byte may be the bad one.
                await trio.to_thread.run_sync(self._restart, partial)
                if resumed and not retried_clean:
                    # Part of it came from an earlier run; that part may be what was wrong.
                    retried_clean = True
                    log.warning(
                        "blob %s resumed from an earlier run hashed to %s; fetching it again",
                        digest,
                        got,
                    )
                    continue
                exc = PeerLiedError(f"{peer.url}: blob {digest} arrived with sha256 {got}")
                self._avoid(sources, peer, exc, result, digest)
            raise _one_error(sources.errors, f"blob {digest}")
        finally:
            if partial.done.total() == 0:
                # Not a byte worth resuming from (refused, 401, a digest mismatch): no file.
                partial.close()
                partial.discard()
            partial.release()

    def _restart(self, partial: PartialBlob) -> None:
        try:
            partial.restart()
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {partial.digest}") from None

    def _promote(self, partial: PartialBlob) -> None:
        try:
            partial.close()
            self.store.install(partial.path, partial.digest)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {partial.digest}") from None
        with contextlib.suppress(FileNotFoundError):
            partial.sidecar.unlink()

    async def _attempt(self, name: Name, peer: PeerClient, t: _Transfer) -> str | None:
        """Fetch what `t` lacks from `peer`; the sha256 hex of the whole file when every byte
        is there, or raise the first error (its progress checkpointed for a later resume)."""
        opts = self.options
        partial = t.partial
        workers = opts.workers if t.size >= opts.parallel_min else 1
        fetched_all = trio.Event()
        digest_hex: list[str] = []

        async def worker() -> None:
            conn: Conn | None = None
            try:
                while (piece := t.take()) is not None:
                    try:
                        conn = await in_thread(
                            self._fetch_piece, peer, name, t, piece, conn, stop=t.stop
                        )
                    except NeedsHttpx:
                        conn = None
                        await self._fetch_piece_httpx(peer, name, t, piece)
            except Stopped:
                pass
            except Exception as exc:
                t.fail(exc)
            finally:
                if conn is not None:
                    conn.close()

        async def hasher() -> None:
            try:
                digest_hex.append(await in_thread(self._hash, t, stop=t.stop))
            except Stopped:
                pass
            except Exception as exc:
                t.fail(exc)

        async def syncer() -> None:
            # Keep writeback going while bytes arrive, make progress durable every second,
            # and fsync once the last byte is written (while the hash catches up).
            last = time.monotonic()
            while not fetched_all.is_set():
                with trio.move_on_after(0.1):
                    await fetched_all.wait()
                if t.stop.is_set():
                    return
                await trio.to_thread.run_sync(start_writeback, partial.fd)
                if time.monotonic() - last >= opts.checkpoint_every:
                    last = time.monotonic()
                    await trio.to_thread.run_sync(partial.checkpoint, t.snapshot())
            try:
                await trio.to_thread.run_sync(os.fsync, partial.fd)
            except OSError as exc:
                t.fail(_local_error(exc, self.layout, f"blob {partial.digest}"))

        complete = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hasher)
                nursery.start_soon(syncer)
                async with trio.open_nursery() as pool:
                    for _ in range(workers):
                        pool.start_soon(worker)
                if t.error is None:
                    fetched_all.set()
            complete = t.error is None and bool(digest_hex)
        finally:
            partial.done = t.snapshot()
            if not complete:
                # Interrupted, cancelled or failed: make what arrived durable for a resume.
                with trio.CancelScope(shield=True), contextlib.suppress(OSError):
                    await trio.to_thread.run_sync(partial.checkpoint, partial.done)
        if t.error is not None:
            err = t.error
            if isinstance(err, OSError):
                raise _local_error(err, self.layout, f"blob {partial.digest}")
            raise err
        if not digest_hex:  # pragma: no cover - every byte written but no hash: a bug
            raise PeerError(f"{peer.url}: blob {partial.digest} incomplete")
        return digest_hex[0]

    def _fetch_piece(
        self,
        peer: PeerClient,
        name: Name,
        t: _Transfer,
        piece: tuple[int, int],
        conn: Conn | None,
    ) -> Conn | None:
        """One ranged GET into the file (blocking, in a worker thread)."""
        start, end = piece
        partial = t.partial
        body = peer.open_range(name, partial.digest, start, end, t.size, stop=t.stop, conn=conn)
        buf = bytearray(min(self.options.buffer, end - start))
        view = memoryview(buf)
        pos = start
        try:
            while pos < end:
                limit = min(len(buf), end - pos)
                filled = 0
                try:
                    while filled < limit:
                        filled += body.readinto(view[filled:limit])
                finally:
                    # On a failure, what arrived before it is as good as any byte: keep it.
                    if filled:
                        self._write(partial, view[:filled], pos)
                        t.wrote(pos, pos + filled)
                        pos += filled
        except BaseException:
            body.conn.close()
            raise
        return body.release()

    def _write(self, partial: PartialBlob, view: memoryview, offset: int) -> None:
        try:
            _pwrite_all(partial.fd, view, offset)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {partial.digest}") from None

    async def _fetch_piece_httpx(
        self, peer: PeerClient, name: Name, t: _Transfer, piece: tuple[int, int]
    ) -> None:
        """The same range through httpx, for responses the raw receiver does not take."""
        start, end = piece
        partial = t.partial
        what = f"blob {partial.digest}"
        url = peer.blob_url(repositories(name)[0], partial.digest)
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        pos = start
        pending = bytearray()

        async def flush() -> None:
            nonlocal pos
            if pending:
                data = bytes(pending)
                pending.clear()
                await trio.to_thread.run_sync(self._write, partial, memoryview(data), pos)
                t.wrote(pos, pos + len(data))
                pos += len(data)

        try:
            with mapped_errors(peer.url, what):
                async with peer.http.stream("GET", url, headers=headers) as response:
                    raise_for_status(response, what)
                    if response.status_code == 200 and start != 0:
                        raise PeerError(f"{url}: ignores Range requests; cannot resume {what}")
                    async for chunk in response.aiter_bytes():
                        if t.stop.is_set():
                            raise Stopped()
                        take = chunk[: end - pos - len(pending)]
                        pending += take
                        if len(pending) >= self.options.buffer:
                            await flush()
                        if pos + len(pending) >= end:
                            break
            await flush()
        except PeerError as exc:
            await flush()
            if "incomplete" in str(exc).lower() or "peer closed" in str(exc).lower():
                raise TruncatedBodyError(
                    f"{url}: truncated body ({pos - start} of {end - start} bytes) "
                    f"while fetching {what}"
                ) from None
            raise
        if pos < end:
            raise TruncatedBodyError(
                f"{url}: truncated body ({pos - start} of {end - start} bytes) "
                f"while fetching {what}"
            )

    def _hash(self, t: _Transfer) -> str:
        """sha256 of the file from byte 0, following the prefix as it grows (a thread)."""
        h = hashlib.sha256()
        buf = bytearray(self.options.buffer)
        pos = 0
        while pos < t.size:
            upto = t.wait_prefix(pos)
            for piece in t.partial.chunks(pos, upto, buf):
                h.update(piece)
            pos = upto
            t.hashed = pos
        return h.hexdigest()


# -- entry point ------------------------------------------------------------------------------
async def pull(
    layout: Layout,
    names: Sequence[str],
    sources: Sequence[str],
    *,
    options: PullOptions | None = None,
    progress: P.Progress | None = None,
    authorization: str | None = None,
    http: httpx.AsyncClient | None = None,
) -> PullReport:
    """Pull each name, in order; the first failure is raised (earlier names stay pulled)."""
    options = options or PullOptions()
    layout.tmp.mkdir(parents=True, exist_ok=True)
    layout.blobs.mkdir(parents=True, exist_ok=True)
    report = PullReport()
    async with contextlib.AsyncExitStack() as stack:
        if http is None:
            http = await stack.enter_async_context(make_client())
            http.timeout = httpx.Timeout(
                connect=10.0, read=options.read_timeout, write=options.read_timeout, pool=None
            )
            if authorization:
                http.headers["Authorization"] = authorization
        peers = [
            PeerClient(url, http, authorization=authorization, read_timeout=options.read_timeout)
            for url in sources
        ]
        puller = Puller(layout, peers, options, progress)
        for text in names:
            report.models.append(await puller.pull_one(text))
    return report


def run_pull(
    root: Path,
    names: Sequence[str],
    sources: Sequence[str],
    *,
    options: PullOptions | None = None,
    progress: P.Progress | None = None,
    authorization: str | None = None,
) -> PullReport:
    """`pull` under `trio.run`, for the CLI."""

    async def main() -> PullReport:
        return await pull(
            Layout(root),
            names,
            sources,
            options=options,
            progress=progress,
            authorization=authorization,
        )

    return trio.run(main)


def read_credentials(path: str | os.PathLike[str] | None) -> str | None:
    """The `Authorization` header value from a token file: `Bearer <token>`, or `Basic …`
    for a `user:password` line (a registry with htpasswd auth, as `modelfs push` reads it)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise LocalWriteError(f"--token-file {path}: {why}") from None
    if not text or "\n" in text:
        raise LocalWriteError(f"--token-file {path}: expected one line (a token, or user:password)")
    if ":" in text:
        return "Basic " + base64.b64encode(text.encode()).decode()
    return f"Bearer {text}"


__all__ = [
    "ModelResult",
    "PullOptions",
    "PullReport",
    "Puller",
    "anchor_bytes",
    "pull",
    "run_pull",
    "select_children",
]
