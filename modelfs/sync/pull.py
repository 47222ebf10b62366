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
     finished byte ranges, a lock). A receiver thread sends a ranged GET on a plain socket
     (`PeerClient.open_range`) and `recv_into`s page-aligned pool buffers of `chunk` bytes
     (16 MiB); each full buffer goes to two places at once: a writer thread, which writes
     it with O_DIRECT at its offset (no page cache to fill and write back; an ordinary
     pwrite where the filesystem refuses O_DIRECT), and the hasher thread, which feeds
     buffers to sha256 strictly in order. Nothing is read back, except bytes a previous run
     left on disk. One connection asks for the rest of the blob in one GET; blobs from
     `parallel_min` (256 MiB) on are asked for in chunk-sized ranges, handed out in order,
     and up to `workers` (4) connections share them, a new one opened whenever the hasher
     spent over half of the last half second waiting for bytes (so on loopback or a LAN,
     where one stream outruns sha256, one stream it stays). The pool (connections + 3
     buffers) bounds the memory and how far receivers run ahead of the hash. Every second
     the progress is made durable (fdatasync, then the sidecar). When the last byte is
     written the file is fsynced; when the sha256 matches it is renamed into `blobs/` with a
     fresh mtime; when it does not, the temp file is deleted. After an interruption (kill
     -9 included) the next run resumes: only ranges the sidecar does not list are fetched,
     with `Range`, and what is on disk is hashed again from byte 0. A peer that ignores
     `Range` (a plain web server, some proxies) answers 200 with the whole blob: the bytes
     before each missing range are read and dropped, one stream carries them all, and no
     more connections are opened.
3. **Manifests, last**, each only once every blob it names is present with the right size,
   written atomically (temp file in `.modelfs/tmp/`, fsync, rename), byte for byte:
   - a plain manifest: `manifests/<host>/<ns>/<model>/<tag>`, the legacy file every Ollama
     version reads (and, if the store already has a `manifests-v2/` entry for that name, it
     is moved to the new manifest too, because v2 hides legacy);
   - a manifest list (see `write_list`): the child manifest blobs, then the list blob and
     the `manifests-v2/…/<tag>` symlink to it, then the legacy anchor, then a legacy
     `<tag>-<runner>` file for each other pulled child.

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

import contextlib
import errno
import functools
import hashlib
import json
import logging
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from modelfs.runtime.leasing import LiveLease, leased
from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    go_marshal,
    parse_manifest,
)
from modelfs.store.names import Name, name_from_path_parts, parse_name
from modelfs.store.scan import DEFAULT_PREFER, child_runner, rank_children, read_limited
from modelfs.sync import progress as P
from modelfs.sync.client import (
    Conn,
    FetchedManifest,
    NeedsHttpx,
    PeerClient,
    PeerSession,
    RangeBody,
    TruncatedBodyError,
    peer_session,
    repositories,
)
from modelfs.sync.credentials import Credentials
from modelfs.sync.errors import (
    LocalWriteError,
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    PeerUnreachableError,
    SyncError,
)
from modelfs.sync.http import READ_TIMEOUT, mapped_errors, raise_for_status
from modelfs.sync.ocirepr import decode_list, parse_carrier
from modelfs.sync.partial import (
    ALIGN,
    AlignedPool,
    BlobBusyError,
    PartialBlob,
    RangeSet,
    Stopped,
    split,
    start_writeback,
)
from modelfs.sync.threads import in_thread, run_unwrapped

log = logging.getLogger(__name__)

MiB = 1 << 20
VANISH_ROUNDS = 4  # fetches of one model's blobs before blobs vanishing under it is an error
WRITERS = 2  # threads writing one blob: two direct writes in flight keep a disk busy


@dataclass(frozen=True)
class PullOptions:
    prefer: tuple[str, ...] = DEFAULT_PREFER
    all_variants: bool = False
    # When no peer has the preferred child of a list: take the next one some peer has (a
    # pull by hand), or fail and write nothing (the sync daemon: the old version stays
    # rather than the tag switching to a variant this host did not choose).
    fallback: bool = True
    read_timeout: float = READ_TIMEOUT
    small_max: int = 8 * MiB  # blobs below this are fetched whole, in memory
    parallel_min: int = 256 * MiB  # blobs from this size on may use several connections:
    workers: int = 4  # up to this many,
    parallel_below: float = 256e6  # when one brings less than this many bytes/s
    chunk: int = 16 * MiB  # one receive buffer; one ranged GET when several connections
    max_blobs: int = 4  # blobs in flight at once
    checkpoint_every: float = 1.0
    rounds: int = 2  # tries per source and blob, for transient failures
    # While blobs are fetched, those of the model already here get a fresh mtime this often:
    # Ollama's prune spares what is under an hour old, and it does not read our leases.
    freshen_every: float = 15 * 60.0


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
    # (name as asked, its error, whose message names the model): the models not pulled
    failed: list[tuple[str, SyncError | StoreError]] = field(default_factory=list)


# -- choosing children ------------------------------------------------------------------------
def select_children(lst: ManifestList, prefer: Sequence[str], all_variants: bool) -> list[int]:
    """Indexes of the children to pull, best first: all of them, or the single best by
    `prefer` (store.scan.rank_children, the ranking the mount uses too)."""
    ranked = rank_children(lst, prefer)
    return ranked if all_variants else ranked[:1]


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


def existing_name(layout: Layout, name: Name) -> tuple[Name | None, bool]:
    """The spelling a store already has for `name` (each part matched case-insensitively, as
    Ollama's getExistingName), and whether that is a `manifests-v2/` entry (which hides the
    legacy file). Looks only along the name's own path, not at the whole store."""
    trees = (
        (layout.manifests_v2, name.v2_parts(), True),
        (layout.manifests, name.legacy_parts(), False),
    )
    for root, parts, v2 in trees:
        path, found = root, []
        for part in parts:
            try:
                entries = sorted(os.listdir(path))
            except OSError:
                break
            hit = (
                part
                if part in entries
                else next((e for e in entries if e.lower() == part.lower()), None)
            )
            if hit is None:
                break
            path = path / hit
            found.append(hit)
        else:
            if path.is_file():
                try:
                    return name_from_path_parts(found, v2=v2), v2
                except StoreError:
                    pass
    return None, False


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


# -- one large blob in flight -----------------------------------------------------------------
@dataclass(eq=False)
class _Segment:
    """Bytes [start, start + length) of the blob in a pool buffer, on their way to the disk
    and to the hash; the buffer goes back to the pool when both are done with it."""

    start: int
    length: int
    buf: mmap.mmap
    refs: int = 2


@dataclass(eq=False)
class _Piece:
    """A byte range one connection is fetching. `end` may be pulled in (under the transfer's
    lock) when the rest is split among more connections; `pos` is where it is now."""

    start: int
    end: int
    pos: int = -1


class _Transfer:
    """Shared state of one large blob's attempt from one peer.

    Receivers (one per connection) fill page-aligned pool buffers, one `_Segment` at a
    time, and hand each to the writers (O_DIRECT pwrite, `write_q`) and to the hasher
    (`ready`, by offset); the hasher consumes segments strictly in order. Ranges are handed
    out in order too, so the hasher never waits long, and the pool's size bounds how far the
    receivers can run ahead of it.
    """

    def __init__(
        self, partial: PartialBlob, pieces: list[tuple[int, int]], pool: AlignedPool
    ) -> None:
        self.partial = partial
        self.size = partial.size
        self.on_disk = RangeSet(partial.done.as_list())  # from before this attempt
        self.done = RangeSet(partial.done.as_list())  # on disk now
        self.todo = [_Piece(a, b, a) for a, b in pieces]
        self.active: list[_Piece] = []
        self.pool = pool
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.ready: dict[int, _Segment] = {}
        self.write_q: queue.Queue[_Segment | None] = queue.Queue()
        self.hash_wait = 0.0  # seconds the hasher spent waiting for bytes
        # The peer answered a range with the whole blob (it ignores Range): one stream
        # carries the rest, and no more connections are opened (each would resend it all).
        self.whole = False

    def take(self) -> _Piece | None:
        with self.cond:
            if self.stop.is_set() or not self.todo:
                return None
            piece = self.todo.pop(0)
            self.active.append(piece)
            return piece

    def finished(self, piece: _Piece) -> None:
        with self.cond:
            self.active.remove(piece)

    def is_head(self, piece: _Piece) -> bool:
        """True if `piece` is the active range furthest behind: the hash waits on it."""
        with self.cond:
            return all(piece.pos <= p.pos or p.pos < 0 for p in self.active)

    def make_room(self) -> bool:
        """Work for one more connection: a range not yet started, or else the far end of the
        range with the most left, cut off in chunk-sized ranges. False if too little is left."""
        size = self.pool.size
        with self.cond:
            if self.todo:
                return True
            piece = max(self.active, key=lambda p: p.end - p.pos, default=None)
            if piece is None:
                return False
            cut = max(piece.pos, piece.start) + 2 * size
            if piece.end - cut < 2 * size:
                return False
            self.todo = [_Piece(a, b, a) for a, b in split([(cut, piece.end)], size)]
            piece.end = cut
            return True

    def submit(self, seg: _Segment, *, hash_it: bool = True) -> None:
        if hash_it:
            with self.cond:
                self.ready[seg.start] = seg
                self.cond.notify_all()
        else:
            seg.refs -= 1
        self.write_q.put(seg)

    def written(self, seg: _Segment) -> None:
        with self.cond:
            self.done.add(seg.start, seg.start + seg.length)
            self.cond.notify_all()
        self.release(seg)

    def release(self, seg: _Segment) -> None:
        with self.cond:
            seg.refs -= 1
            free = seg.refs == 0
        if free:
            self.pool.put(seg.buf)

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

    def segment_at(self, pos: int) -> _Segment:
        """Block until the segment that starts at `pos` has arrived; Stopped on stop."""
        with self.cond:
            t0 = time.monotonic()
            try:
                while (seg := self.ready.pop(pos, None)) is None:
                    if self.stop.is_set():
                        raise Stopped()
                    self.cond.wait(0.25)
                return seg
            finally:
                self.hash_wait += time.monotonic() - t0


# -- the puller -------------------------------------------------------------------------------
class Puller:
    """Pulls names from `peers` into one store; reusable for several names."""

    def __init__(
        self,
        layout: Layout,
        peers: Sequence[PeerClient],
        options: PullOptions | None = None,
        progress: P.Progress | None = None,
        lease: LiveLease | None = None,
    ) -> None:
        if not peers:
            raise ValueError("no peers to pull from")
        self.layout = layout
        self.lease = lease  # None: each pull_one keeps a lease of its own
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

    async def _child(
        self, name: Name, digest: Digest, peers: Sequence[PeerClient], top: FetchedManifest
    ) -> tuple[FetchedManifest, Manifest]:
        """A child manifest of the list `top`, by digest, checked against it."""
        fetched, manifest = await self._manifest(name, digest, peers, digest)
        if isinstance(manifest, ManifestList):
            raise PeerError(f"{fetched.url}: manifest list {top.digest} nests a list")
        return fetched, manifest

    def _order(self, first: str) -> list[PeerClient]:
        return sorted(self.peers, key=lambda p: p.url != first)

    # -- the whole model ----------------------------------------------------------------------
    async def pull_one(self, text: str) -> ModelResult:
        if self.lease is not None:
            return await self._pull_one(text, self.lease)
        async with pull_lease(self.layout) as lease:
            return await self._pull_one(text, lease)

    async def _pull_one(self, text: str, lease: LiveLease) -> ModelResult:
        name = parse_name(text)
        existing, had_v2 = await trio.to_thread.run_sync(existing_name, self.layout, name)
        if existing is not None:
            name = existing  # keep the store's spelling, as Ollama's getExistingName
        label = name.shortest
        self.progress.status(label, P.PULLING_MANIFEST)
        log.debug("%s: asking %s", label, ", ".join(p.url for p in self.peers))

        top, parsed = await self._manifest(name, name.tag, self.peers, None)
        peers = self._order(top.url)
        result = ModelResult(label, top.digest)
        children: list[tuple[int, FetchedManifest | None, Manifest]] = []
        if isinstance(parsed, ManifestList):
            # The best child by `prefer` (or every child): with `fallback`, the best that
            # some peer has, since a peer that pulled one variant serves a list naming
            # children it does not hold; without, that one or nothing.
            absent: list[tuple[int, SyncError]] = []
            got: dict[Digest, tuple[FetchedManifest, Manifest]] = {}
            for child in parsed.children:
                # A child the list names no runner for is ranked by its manifest, as the
                # mount ranks it.
                if child.runner is None and child.inline is None:
                    with contextlib.suppress(PeerNotFoundError):
                        got[child.digest] = await self._child(name, child.digest, peers, top)
            known = {d: m for d, (_, m) in got.items()}
            for i in rank_children(parsed, self.options.prefer, known):
                child = parsed.children[i]
                if child.inline is not None:
                    children.append((i, None, child.inline))
                else:
                    try:
                        fetched, manifest = got.get(child.digest) or await self._child(
                            name, child.digest, peers, top
                        )
                    except PeerNotFoundError as exc:
                        if not (self.options.fallback or self.options.all_variants):
                            runner = child_runner(child, known.get(child.digest))
                            raise PeerNotFoundError(
                                f"no peer has the {runner or child.digest.short} variant of "
                                f"{label} ({exc})"
                            ) from None
                        absent.append((i, exc))
                        continue
                    children.append((i, fetched, manifest))
                if not self.options.all_variants:
                    break
            if not children:
                if absent:
                    raise absent[0][1]
                raise PeerError(f"{top.url}: manifest list for {label} has no children")
            for i, gone in absent:
                runner = parsed.children[i].runner or "?"
                log.warning("%s: no peer has its %s variant (%s); skipped", label, runner, gone)
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
        # Leased (on disk) before any blob is judged present or fetched, until the manifest
        # names them: a GC on any host leaves them alone meanwhile (GC invariant 3,
        # docs/architecture.md).
        roots = [top.digest, *(f.digest for _, f, _ in children if f is not None), *blobs]
        try:
            await lease.hold(roots)
        except OSError as exc:
            raise _local_error(exc, self.layout, "the pull's lease") from None
        try:
            # What is here already gets a fresh mtime at once, even when nothing is missing:
            # a GC (ours on another host, whose view of our lease may lag behind; Ollama's
            # prune) spares young blobs, and its last look before a move sees the change.
            missing = await trio.to_thread.run_sync(self._missing, blobs, True)
            for digest, size in blobs.items():
                if digest not in missing:
                    result.present += 1
                    self.progress.blob(label, digest, size, size)
            await self._fetch_until_present(name, label, missing, peers, result, blobs)
            self.progress.status(label, P.VERIFYING)
            self.progress.status(label, P.WRITING_MANIFEST)
            if isinstance(parsed, ManifestList):
                written = await trio.to_thread.run_sync(
                    self.write_list, name, top.raw, parsed, children
                )
            else:
                written = await trio.to_thread.run_sync(self.write_manifest, name, top.raw, had_v2)
        finally:
            lease.drop(roots)  # named by the manifest now (or the pull failed)
        result.written = [str(p.relative_to(self.layout.root)) for p in written]
        self.progress.done(label)
        return result

    def _blob_ok(self, digest: Digest, size: int) -> bool:
        try:
            st = os.stat(self.layout.blob(digest), follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def _missing(self, blobs: dict[Digest, int], freshen: bool = False) -> list[Digest]:
        """The blobs not here with the right size; with `freshen`, each one here gets a fresh
        mtime, so that a prune that spares young blobs (Ollama's: under an hour) spares it."""
        missing = []
        for d, size in blobs.items():
            if not self._blob_ok(d, size):
                missing.append(d)
            elif freshen:
                try:
                    os.utime(self.layout.blob(d))
                except FileNotFoundError:
                    missing.append(d)
                except OSError as exc:  # someone else's blob: it keeps its age
                    log.debug("cannot touch %s: %s", d, exc.strerror)
        return missing

    async def _keep_young(self, blobs: dict[Digest, int]) -> None:
        while True:
            await trio.sleep(self.options.freshen_every)
            await trio.to_thread.run_sync(self._missing, blobs, True)

    async def _fetch_until_present(
        self,
        name: Name,
        label: str,
        missing: list[Digest],
        peers: list[PeerClient],
        result: ModelResult,
        blobs: dict[Digest, int],
    ) -> None:
        """Fetch `missing`, then look again (freshening what is here) and fetch whatever
        vanished meanwhile (pruned or collected by another process between "present" and
        "refreshed"), up to `VANISH_ROUNDS` times, so a concurrent GC costs a fetch, not
        the pull."""
        for round_ in range(VANISH_ROUNDS):
            if missing:
                if round_:
                    log.warning(
                        "%s: %s vanished from the store during the pull (pruned or collected "
                        "by another process?); fetching again",
                        label,
                        ", ".join(str(d) for d in missing),
                    )
                fetch = {d: blobs[d] for d in missing}
                await self._fetch_all(name, label, fetch, peers, result, blobs)
            missing = await trio.to_thread.run_sync(self._missing, blobs, True)
            if not missing:
                return
        raise LocalWriteError(f"blob {missing[0]} vanished from {self.layout.blobs} again")

    # -- writing manifests --------------------------------------------------------------------
    def _manifest_blob(self, raw: bytes) -> Digest:
        """`raw` as a blob; a blob of that name with other bytes is replaced (renamed over)."""
        try:
            return self.store.put_bytes(raw)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"manifest blob {Digest.of_bytes(raw)}") from None

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
           the list and child manifest blobs too. This is the same anchor `modelfs
           demo-store` and Ollama's own migration leave;
        4. for every other pulled child, `manifests/…/<tag>-<runner>`: its own bytes
           (`_variant_anchors`), so that an Ollama reading only `manifests/` keeps its layers.

        Lists after their children; the anchor last, so each file only names what is already
        there.
        """
        try:
            ours = {c.digest for c in lst.children} | self._list_children(name)
            refs: list[tuple[str, Digest, int]] = []
            for i, fetched, manifest in sorted(children, key=lambda c: c[0]):
                if fetched is not None:
                    self._manifest_blob(fetched.raw)
                    media_type = _child_media_type(list_raw, i)
                    refs.append((media_type, manifest.digest, len(fetched.raw)))
            self._manifest_blob(list_raw)
            written = [self.store.write_v2_manifest(name, list_raw)]

            known = {m.digest: m for _, _, m in children}
            ranked = rank_children(lst, self.options.prefer, known)

            def rank(item: tuple[int, FetchedManifest | None, Manifest]) -> tuple[bool, int]:
                i, _, m = item
                c = lst.children[i]
                return (not _is_gguf(c.runner, c.format, m), ranked.index(i))

            chosen_i, _, chosen = min(children, key=rank)
            anchor = anchor_bytes(chosen.raw, list_raw, refs)
            written.append(self.store.write_legacy_manifest(name, anchor))
            extra = [
                (i, f.raw)
                for i, f, _ in sorted(children, key=lambda c: c[0])
                if i != chosen_i and f is not None
            ]
            written += self._variant_anchors(name, lst, extra, ours)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"the manifests of {name.shortest}") from None
        return written

    def _list_children(self, name: Name) -> set[Digest]:
        """The children of the list the store's `manifests-v2/` entry for `name` holds now."""
        try:
            old = parse_manifest(
                read_limited(self.layout.v2_manifest(name), MAX_MANIFEST_BYTES), name.shortest
            )
        except (OSError, StoreError):
            return set()
        return {c.digest for c in old.children} if isinstance(old, ManifestList) else set()

    def _variant_anchors(
        self, name: Name, lst: ManifestList, extra: list[tuple[int, bytes]], ours: set[Digest]
    ) -> list[Path]:
        """A legacy manifest `<tag>-<runner>` for each pulled child the anchor is not: the
        child's own bytes, as `ollama pull` of that child would write them.

        A stock Ollama reads only `manifests/` and deletes every blob no file there names:
        its startup prune (ollama/ollama fb30760 server/images.go:874-929), `ollama rm`
        (manifest/manifest.go:74-110) and a re-pull (server/images.go:998-1015,1115-1120).
        The anchor names the layers of one child only; this names the other children's, so
        they live as long as this tag. It names no list or child manifest blob, so an
        `ollama rm` of the main tag still removes the list. An existing file of that name is
        replaced only when it is a child of this list or of the list it replaces (another
        model of that name is left alone, and the variant's blobs unnamed; a warning says so).
        """
        written: list[Path] = []
        taken: set[str] = set()
        for i, raw in extra:
            child = lst.children[i]
            base = f"{name.tag}-{(child_runner(child) or 'variant').lower()}"
            tag, n = base, 1
            while tag.lower() in taken:
                n += 1
                tag = f"{base}-{n}"
            taken.add(tag.lower())
            try:
                anchor = name.with_tag(tag)
            except StoreError:
                log.warning(
                    "%s: no legacy name for its child %s (%s is too long)",
                    name.shortest,
                    child.digest,
                    tag,
                )
                continue
            path = self.layout.legacy_manifest(anchor)
            try:
                there = Digest.of_bytes(read_limited(path, MAX_MANIFEST_BYTES))
            except FileNotFoundError:
                there = None
            if there is not None and there not in ours:
                log.warning(
                    "%s exists and is another model; %s's child %s is named by no legacy "
                    "manifest, so a stock Ollama's prune would delete its blobs",
                    anchor.shortest,
                    name.shortest,
                    child.digest,
                )
                continue
            written.append(self.store.write_legacy_manifest(anchor, raw))
        return written

    # -- blobs --------------------------------------------------------------------------------
    async def fetch_blob(self, name: Name, digest: Digest, size: int) -> ModelResult:
        """Fetch one blob by digest from the peers, under the repository of `name` (a model
        whose manifest names it), verified and renamed into `blobs/` as a pull does; for
        `modelfs verify --repair-from`. Raises a SyncError if no peer sends it."""
        result = ModelResult(name.shortest, digest)
        blobs = {digest: size}

        async def fetch(lease: LiveLease) -> None:
            try:
                await lease.hold([digest])
            except OSError as exc:
                raise _local_error(exc, self.layout, "the pull's lease") from None
            try:
                await self._fetch_all(name, name.shortest, blobs, self.peers, result, blobs)
            finally:
                lease.drop([digest])

        if self.lease is not None:
            await fetch(self.lease)
        else:
            async with pull_lease(self.layout) as lease:
                await fetch(lease)
        return result

    async def _fetch_all(
        self,
        name: Name,
        label: str,
        missing: dict[Digest, int],
        peers: list[PeerClient],
        result: ModelResult,
        young: dict[Digest, int],
    ) -> None:
        """Fetch `missing`; meanwhile every blob of `young` here is kept young."""
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
            except Exception as exc:  # the first failure ends the model's pull
                failure.append(exc)
                nursery.cancel_scope.cancel()

        async def report() -> None:
            while True:
                await trio.sleep(0.1)
                for digest, completed in list(live.items()):
                    self.progress.blob(label, digest, missing[digest], completed())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            nursery.start_soon(self._keep_young, young)
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
        # `data` was verified against `digest` on arrival; put_bytes writes, fsyncs, renames.
        try:
            self.store.put_bytes(data)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {digest}") from None

    # -- large blobs --------------------------------------------------------------------------
    async def _open_partial(self, digest: Digest, size: int) -> PartialBlob | None:
        """Lock and open the temp file; None if another process finished the blob while we
        waited for its lock."""
        said = False
        while True:
            try:
                partial = await trio.to_thread.run_sync(PartialBlob.open, self.layout, digest, size)
            except BlobBusyError as exc:
                if not said:
                    log.info("%s is being fetched by %s; waiting", digest, exc.owner)
                    said = True
            except OSError as exc:
                raise _local_error(exc, self.layout, f"blob {digest} ({size} bytes)") from None
            else:
                # The lock may have been freed by a holder that just finished the blob: then
                # the fresh temp file is not needed. A plain call, not a thread hop: a
                # checkpoint here could be cancelled and leak the lock we just took.
                if not self._blob_ok(digest, size):
                    return partial
                partial.discard()
                partial.release()
                return None
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
        opts = self.options
        workers = opts.workers if size >= opts.parallel_min else 1
        pool = AlignedPool(4, min(opts.chunk, size))
        retried_clean = False
        try:
            while (peer := sources.next()) is not None:
                resumed = partial.resumed
                gaps = partial.done.missing(size)
                # One GET for each gap; a connection that joins later takes the far end of
                # one, cut in chunk-sized ranges (`_Transfer.make_room`).
                transfer = _Transfer(partial, gaps, pool)
                live[digest] = transfer.completed
                try:
                    got = await self._attempt(name, peer, transfer, workers)
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
                lie = PeerLiedError(f"{peer.url}: blob {digest} arrived with sha256 {got}")
                self._avoid(sources, peer, lie, result, digest)
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
        if not partial.lock.holds():
            # Another process took the blob over while we fetched: the file at the path may
            # hold its bytes as well as ours, whatever we hashed. Let the holder finish it.
            raise LocalWriteError(
                f"blob {partial.digest}: another process took over its temp file; not installed"
            )
        try:
            partial.close()
            self.store.install(partial.path, partial.digest)
        except OSError as exc:
            raise _local_error(exc, self.layout, f"blob {partial.digest}") from None
        with contextlib.suppress(FileNotFoundError):
            partial.sidecar.unlink()

    async def _attempt(self, name: Name, peer: PeerClient, t: _Transfer, workers: int) -> str:
        """Fetch what `t` lacks from `peer`. Returns the sha256 hex of the whole file once
        every byte is on disk and fsynced; raises the first error otherwise, after making
        what did arrive durable (fdatasync + sidecar) for a later resume."""
        opts = self.options
        partial = t.partial
        writes_done = trio.Event()
        digest_hex: list[str] = []

        async def receiver() -> None:
            # A kept-alive connection, or the open body of a whole-blob answer to go on with.
            conn: Conn | RangeBody | None = None
            try:
                while (piece := t.take()) is not None:
                    try:
                        conn = await in_thread(
                            self._receive, peer, name, t, piece, conn, stop=t.stop
                        )
                    except NeedsHttpx:
                        conn = None
                        await self._receive_httpx(peer, name, t, piece)
            except Stopped:
                pass
            except Exception as exc:
                t.fail(exc)
            finally:
                if conn is not None:
                    conn.close()

        running = 0
        growing = trio.CancelScope()

        async def tracked_receiver() -> None:
            nonlocal running
            running += 1
            try:
                await receiver()
            finally:
                running -= 1
                if running == 0:
                    growing.cancel()  # nothing left to share

        async def more_receivers(receivers: trio.Nursery, most: int) -> None:
            with growing:
                await grow(receivers, most)

        async def grow(receivers: trio.Nursery, most: int) -> None:
            # Another connection only helps when one connection is what we wait for: open
            # one more (up to `most`) when, over the last half second, the hasher spent over
            # half its time waiting for bytes and they came slower than `parallel_below`
            # (a per-connection limit, a long fat pipe). On loopback or a LAN one stream
            # does better than several (each range is another request), so it stays one.
            # A connection that did not make things 10% faster is the last one opened.
            count = 1
            last_wait, last, last_bytes = t.hash_wait, time.monotonic(), t.completed()
            rate_before: float | None = None
            while count < most:
                await trio.sleep(0.5)
                if t.stop.is_set() or t.whole:
                    return
                now, got = time.monotonic(), t.completed()
                starved = (t.hash_wait - last_wait) / (now - last) > 0.5
                rate = (got - last_bytes) / (now - last)
                last_wait, last, last_bytes = t.hash_wait, now, got
                if rate_before is not None and rate < rate_before * 1.1:
                    return
                if starved and rate < opts.parallel_below:
                    if not t.make_room():
                        return
                    t.pool.grow(1)
                    receivers.start_soon(tracked_receiver)
                    count += 1
                    rate_before = rate
                    log.debug("%s: connection %d of %d", partial.digest, count, most)
                    await trio.sleep(0.5)  # let it get going before judging it
                    last_wait, last, last_bytes = t.hash_wait, time.monotonic(), t.completed()
                else:
                    rate_before = None

        async def writer() -> None:
            try:
                await in_thread(self._writer, t, stop=t.stop)
            except Stopped:
                pass
            except Exception as exc:
                t.fail(exc)

        async def hasher() -> None:
            try:
                digest_hex.append(await in_thread(self._hash, t, stop=t.stop))
            except Stopped:
                pass
            except Exception as exc:
                t.fail(exc)

        async def syncer() -> None:
            # Make progress durable every so often while bytes arrive (fdatasync, then the
            # sidecar), and fsync once the last byte is written, while the hash catches up.
            while not writes_done.is_set():
                with trio.move_on_after(opts.checkpoint_every):
                    await writes_done.wait()
                if writes_done.is_set():
                    break
                await trio.to_thread.run_sync(start_writeback, partial.fd)
                try:
                    await trio.to_thread.run_sync(partial.checkpoint, t.snapshot())
                except OSError as exc:
                    t.fail(_local_error(exc, self.layout, f"blob {partial.digest}"))
                    return
            if t.error is None:
                try:
                    await trio.to_thread.run_sync(os.fsync, partial.fd)
                except OSError as exc:
                    t.fail(_local_error(exc, self.layout, f"blob {partial.digest}"))

        complete = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hasher)
                nursery.start_soon(syncer)
                async with trio.open_nursery() as io:
                    for _ in range(WRITERS):
                        io.start_soon(writer)
                    async with trio.open_nursery() as receivers:
                        receivers.start_soon(tracked_receiver)
                        if workers > 1:
                            receivers.start_soon(more_receivers, receivers, workers)
                    for _ in range(WRITERS):
                        t.write_q.put(None)
                writes_done.set()
            complete = t.error is None and bool(digest_hex)
        finally:
            # Segments the hasher never took (it stopped): their buffers go back to the pool,
            # which the next attempt reuses.
            with t.cond:
                leftovers = list(t.ready.values())
                t.ready.clear()
            for seg in leftovers:
                t.release(seg)
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

    def _receive(
        self,
        peer: PeerClient,
        name: Name,
        t: _Transfer,
        piece: _Piece,
        conn: Conn | RangeBody | None,
    ) -> Conn | RangeBody | None:
        """One ranged GET, received into pool buffers, segment by segment (a thread).

        A peer that ignores Range answers with the whole blob: the bytes before the piece
        (on disk already, or another connection's) are read and dropped, and the open body
        is returned to carry the next piece too, so a resume or a blob cut in ranges costs
        one pass over the wire. `conn` may be such a body, if it has not passed the piece.
        """
        body: RangeBody | None = None
        try:
            if isinstance(conn, RangeBody) and conn.pos <= piece.start:
                body = conn
            else:
                if isinstance(conn, RangeBody):
                    conn.close()
                    conn = None
                body = peer.open_range(
                    name, t.partial.digest, piece.start, piece.end, t.size, stop=t.stop, conn=conn
                )
                if body.whole:
                    t.whole = True
            body.skip_to(piece.start)
        except NeedsHttpx:
            raise  # the piece stays active: `_receive_httpx` takes it over
        except BaseException:
            if body is not None:
                body.close()
            t.finished(piece)
            raise
        pos = piece.start
        try:
            while True:
                with t.cond:
                    piece.pos, end = pos, piece.end
                if pos >= end:
                    break
                buf = t.pool.get(t.stop, last=lambda: t.is_head(piece))
                view = memoryview(buf)
                limit = min(len(buf), end - pos)
                filled = 0
                try:
                    while filled < limit:
                        filled += body.readinto(view[filled:limit])
                except BaseException:
                    # What arrived before the failure is as good as any byte: keep the
                    # block-aligned part of it (the rest is asked for again).
                    keep = filled - filled % ALIGN
                    if keep:
                        t.submit(_Segment(pos, keep, buf), hash_it=False)
                    else:
                        t.pool.put(buf)
                    raise
                finally:
                    view.release()
                t.submit(_Segment(pos, filled, buf))
                pos += filled
        except BaseException:
            body.conn.close()
            raise
        finally:
            t.finished(piece)
        if body.whole and body.remaining:
            return body
        return body.release()  # closed, not kept, if the range was cut short

    async def _receive_httpx(
        self, peer: PeerClient, name: Name, t: _Transfer, piece: _Piece
    ) -> None:
        """The same range through httpx, for answers the raw receiver does not take (it is
        not cut short for another connection; a whole-blob answer is read from byte 0 and
        what comes before the range is dropped)."""
        try:
            await self._receive_httpx_range(peer, name, t, piece.start, piece.end)
        finally:
            t.finished(piece)

    async def _receive_httpx_range(
        self, peer: PeerClient, name: Name, t: _Transfer, start: int, end: int
    ) -> None:
        what = f"blob {t.partial.digest}"
        url = peer.blob_url(repositories(name)[0], t.partial.digest)
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        pos = start
        buf: mmap.mmap | None = None
        filled = 0

        def flush(*, hash_it: bool = True) -> None:
            nonlocal buf, filled, pos
            if buf is not None:
                keep = filled if hash_it else filled - filled % ALIGN
                if keep:
                    t.submit(_Segment(pos, keep, buf), hash_it=hash_it)
                else:
                    t.pool.put(buf)
                pos += keep
                buf, filled = None, 0

        try:
            with mapped_errors(peer.url, what):
                async with peer.http.stream("GET", url, headers=headers) as response:
                    raise_for_status(response, what)
                    skip = 0
                    if response.status_code == 200:
                        t.whole = True
                        skip = start
                    async for chunk in response.aiter_bytes():
                        data = memoryview(chunk)
                        if skip:
                            dropped = min(skip, len(data))
                            data, skip = data[dropped:], skip - dropped
                        while data and pos + filled < end:
                            if buf is None:
                                get = functools.partial(t.pool.get, last=lambda: True)
                                buf = await in_thread(get, t.stop, stop=t.stop)
                            n = min(len(data), len(buf) - filled, end - pos - filled)
                            buf[filled : filled + n] = data[:n]
                            filled += n
                            data = data[n:]
                            if filled == len(buf) or pos + filled == end:
                                flush()
                        if pos >= end:
                            break
        except BaseException as exc:
            flush(hash_it=False)
            if isinstance(exc, PeerError) and (
                "incomplete" in str(exc).lower() or "peer closed" in str(exc).lower()
            ):
                raise TruncatedBodyError(
                    f"{url}: truncated body ({pos - start} of {end - start} bytes) "
                    f"while fetching {what}"
                ) from None
            raise
        if pos < end:
            flush(hash_it=False)
            raise TruncatedBodyError(
                f"{url}: truncated body ({pos - start} of {end - start} bytes) "
                f"while fetching {what}"
            )

    def _writer(self, t: _Transfer) -> None:
        """Write segments to the file as they come (a thread; runs until its None, or until
        the transfer stops and nothing is left to write)."""
        while True:
            try:
                seg = t.write_q.get(timeout=0.25)
            except queue.Empty:
                if t.stop.is_set():
                    return
                continue
            if seg is None:
                return
            try:
                if t.error is None or not isinstance(t.error, LocalWriteError):
                    with memoryview(seg.buf) as view:
                        t.partial.write(view[: seg.length], seg.start)
                    t.written(seg)
                    continue
            except OSError as exc:
                t.fail(_local_error(exc, self.layout, f"blob {t.partial.digest}"))
            t.release(seg)

    def _hash(self, t: _Transfer) -> str:
        """sha256 of the blob from byte 0 (a thread): bytes already on disk from an earlier
        run or attempt are read back, the rest is hashed from the receive buffers in order."""
        h = hashlib.sha256()
        pos = 0
        scratch: bytearray | None = None
        while pos < t.size:
            end = t.on_disk.end_of(pos)
            if end is not None:
                scratch = scratch or bytearray(1 << 20)
                for piece in t.partial.chunks(pos, end, scratch):
                    h.update(piece)
                    if t.stop.is_set():
                        raise Stopped()
                pos = end
                continue
            seg = t.segment_at(pos)
            with memoryview(seg.buf) as view:
                h.update(view[: seg.length])
            pos += seg.length
            t.release(seg)
        return h.hexdigest()


# -- entry point ------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def pull_lease(layout: Layout) -> AsyncIterator[LiveLease]:
    """The lease of a pull: every blob of the models in flight, on disk while they are."""
    keeper = LeaseKeeper(layout, "pull")
    try:
        await trio.to_thread.run_sync(keeper.write)  # empty; says early that it cannot be
    except OSError as exc:
        raise _local_error(exc, layout, "the pull's lease") from None
    async with leased(keeper, strict=True) as lease:
        yield lease


async def pull(
    layout: Layout,
    names: Sequence[str],
    sources: Sequence[str],
    *,
    options: PullOptions | None = None,
    progress: P.Progress | None = None,
    credentials: Credentials | None = None,
    session: PeerSession | None = None,
    lease: LiveLease | None = None,
) -> PullReport:
    """Pull each name, in order. A model that fails (a full disk, a peer without it) is
    listed in `report.failed`, its error naming it, and the others are still tried: a smaller
    one may fit where a bigger one did not. With one name its failure is raised, as is.

    The peers are spoken to through `session` (a daemon's, with its credentials and read
    timeout), or one made here with `credentials` and `options.read_timeout`. Pulls running
    at once in one process share one `lease` (its file is per process)."""
    options = options or PullOptions()
    try:
        BlobStore(layout).ensure_dirs()
    except OSError as exc:
        raise _local_error(exc, layout, "anything") from None
    report = PullReport()
    async with contextlib.AsyncExitStack() as stack:
        peers = await stack.enter_async_context(
            peer_clients(sources, options, credentials, session)
        )
        if lease is None:
            lease = await stack.enter_async_context(pull_lease(layout))
        puller = Puller(layout, peers, options, progress, lease)
        for text in names:
            try:
                report.models.append(await puller.pull_one(text))
            except (SyncError, StoreError, OSError) as exc:
                if len(names) == 1:
                    raise  # as it was: the caller (the daemon, one CLI name) knows the name
                failure = _naming_model(exc, text, layout)
                # Said now, not only in the end: the other models may take hours.
                puller.progress.error(str(failure))
                log.error("%s", failure)
                report.failed.append((text, failure))
    return report


def _naming_model(
    exc: SyncError | StoreError | OSError, text: str, layout: Layout
) -> SyncError | StoreError:
    """The error of one model's pull, its message naming the model (blob errors name only
    the blob). The class is kept, so callers still tell a lying peer from a full disk."""
    if isinstance(exc, OSError):
        exc = _local_error(exc, layout, f"model {text}")
    message = str(exc)
    if text not in message:
        exc.args = (f"{text}: {message}",)
    return exc


@contextlib.asynccontextmanager
async def peer_clients(
    sources: Sequence[str],
    options: PullOptions,
    credentials: Credentials | None = None,
    session: PeerSession | None = None,
) -> AsyncIterator[list[PeerClient]]:
    """A `PeerClient` per source URL, from `session` (or one made here)."""
    async with contextlib.AsyncExitStack() as stack:
        if session is None:
            session = await stack.enter_async_context(
                peer_session(credentials, read_timeout=options.read_timeout)
            )
        yield [session.peer(url) for url in sources]


def run_pull(
    root: Path,
    names: Sequence[str],
    sources: Sequence[str],
    *,
    options: PullOptions | None = None,
    progress: P.Progress | None = None,
    credentials: Credentials | None = None,
) -> PullReport:
    """`pull` under `trio.run`, for the CLI."""

    async def main() -> PullReport:
        return await pull(
            Layout(root),
            names,
            sources,
            options=options,
            progress=progress,
            credentials=credentials,
        )

    return run_unwrapped(main)


__all__ = [
    "ModelResult",
    "PullOptions",
    "PullReport",
    "Puller",
    "anchor_bytes",
    "peer_clients",
    "pull",
    "run_pull",
    "run_unwrapped",
    "select_children",
]
