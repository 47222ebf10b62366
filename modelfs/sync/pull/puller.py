"""`modelfs pull`: fetch models from peers into a store, verified, resumable, manifests last.

    await pull(layout, names, sources, options, progress) -> PullReport
    Puller(layout, peers, options, progress).pull_one(name) -> ModelResult

For each name, in order:

1. **Manifest**, from the first source that answers (`sync.sources.fetch_manifest`). For a
   manifest list, children are chosen by `prefer` (`store.scan.rank_children`, the ranking
   the mount uses too: the first runner in that order that the list has; all of them with
   `all_variants`) and each is fetched by digest and checked against it.
2. **Lease, then look.** The manifests and every blob of the chosen manifests are held in
   the pull's lease before any blob is judged present. A blob already in `blobs/` with the
   size the manifest gives is not fetched (and gets a fresh mtime); the others are fetched
   four at a time (`sync.transfer.BlobFetcher`: small ones whole, large ones through
   `sync.fastpath`, resumable), each from the sources in turn (`sync.sources.Sources`).
3. **Manifests, last** (`sync.manifests.ManifestWriter`), each only once every blob it names
   is present with the right size.

A full disk, a read-only store or a permission error is a `LocalWriteError` naming the
store (`sync.errors.local_error`), and nothing is promoted.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from modelfs.runtime.leasing import LiveLease, leased
from modelfs.store.blobs import BlobStore
from modelfs.store.collect.reach import reachable
from modelfs.store.digest import Digest
from modelfs.store.errors import ManifestError, StoreError
from modelfs.store.formats.artifacts import check_artifact, land
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper, read_leases
from modelfs.store.manifest import Manifest, ManifestList
from modelfs.store.names import Name, parse_name
from modelfs.store.scan import child_runner, rank_children
from modelfs.sync.client.credentials import Credentials
from modelfs.sync.client.peer import FetchedManifest, PeerClient, PeerSession, peer_session
from modelfs.sync.client.threads import run_unwrapped
from modelfs.sync.errors import (
    LocalWriteError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    SyncError,
    local_error,
)
from modelfs.sync.pull import progress as P
from modelfs.sync.pull.manifests import ManifestWriter, existing_name
from modelfs.sync.pull.options import ModelResult, PullOptions
from modelfs.sync.pull.sources import fetch_child, fetch_manifest, order
from modelfs.sync.pull.transfer import BlobFetcher, blob_ok

log = logging.getLogger(__name__)

VANISH_ROUNDS = 4  # fetches of one model's blobs before blobs vanishing under it is an error


@dataclass
class PullReport:
    models: list[ModelResult] = field(default_factory=list)
    # (name as asked, its error, whose message names the model): the models not pulled
    failed: list[tuple[str, SyncError | StoreError]] = field(default_factory=list)


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
        self.fetcher = BlobFetcher(layout, self.options)
        self.manifests = ManifestWriter(layout, self.options.prefer)

    # -- manifests ----------------------------------------------------------------------------

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

        top, parsed = await fetch_manifest(name, name.tag, self.peers, None)
        peers = order(self.peers, top.url)
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
                        got[child.digest] = await fetch_child(name, child.digest, peers, top)
            known = {d: m for d, (_, m) in got.items()}
            for i in rank_children(parsed, self.options.prefer, known):
                child = parsed.children[i]
                if child.inline is not None:
                    children.append((i, None, child.inline))
                else:
                    try:
                        fetched, manifest = got.get(child.digest) or await fetch_child(
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
            check_artifact(parsed)  # an artifact modelfs cannot land: nothing fetched
            manifests = [parsed]

        # Every blob once, config first, in manifest order.
        blobs: dict[Digest, int] = {}
        for m in manifests:
            refs = [m.config, *m.layers] if m.config is not None else m.layers
            for ref in refs:
                # One blob, two sizes: fetched at one, the manifest would name it at the
                # other, a blob that is never here.
                if blobs.setdefault(ref.digest, ref.size) != ref.size:
                    raise PeerLiedError(
                        f"{top.url}: {label} names blob {ref.digest} with two sizes "
                        f"({blobs[ref.digest]} and {ref.size} bytes)"
                    )
        # Leased (on disk) before any blob is judged present or fetched, until the manifest
        # names them: a GC on any host leaves them alone meanwhile (GC invariant 3,
        # docs/architecture.md).
        roots = [top.digest, *(f.digest for _, f, _ in children if f is not None), *blobs]
        try:
            await lease.hold(roots)
        except OSError as exc:
            raise local_error(exc, self.layout, "the pull's lease") from None
        try:
            # What is here already gets a fresh mtime at once, even when nothing is missing:
            # a GC (ours on another host, whose view of our lease may lag behind; Ollama's
            # prune) spares young blobs, and its last look before a move sees the change.
            missing = await trio.to_thread.run_sync(self._missing, blobs, True)
            fetched_here = list(missing)
            for digest, size in blobs.items():
                if digest not in missing:
                    result.present += 1
                    self.progress.blob(label, digest, size, size)
            await self._fetch_until_present(name, label, missing, peers, result, blobs)
            self.progress.status(label, P.VERIFYING)
            self.progress.status(label, P.WRITING_MANIFEST)
            if isinstance(parsed, ManifestList):
                written = await trio.to_thread.run_sync(
                    self.manifests.write_list, name, top.raw, parsed, children
                )
            else:
                # Another tool's model artifact becomes an Ollama manifest naming its blobs.
                try:
                    raw = await trio.to_thread.run_sync(land, self.store, parsed)
                except ManifestError:
                    # Refused for what only its blobs showed (a tar's members): what this
                    # pull fetched for it goes again, as if never asked for.
                    await trio.to_thread.run_sync(self._discard, fetched_here, lease.keeper)
                    raise
                except OSError as exc:
                    # A full disk while the tar's members are copied out: the fetched blobs
                    # stay (a pull with room lands them without fetching), nothing is named.
                    raise local_error(exc, self.layout, f"the files of {label}") from None
                written = await trio.to_thread.run_sync(
                    self.manifests.write_manifest, name, raw, had_v2
                )
        finally:
            lease.drop(roots)  # named by the manifest now (or the pull failed)
        result.written = [str(p.relative_to(self.layout.root)) for p in written]
        self.progress.done(label)
        return result

    def _discard(self, digests: list[Digest], keeper: LeaseKeeper) -> None:
        """Remove blobs this pull fetched that nothing else holds: no other pull of this
        process (a daemon's share one lease), no other process's lease, and no manifest. A
        pull elsewhere that found one of them here meanwhile named it in its manifest and
        dropped its lease: the leases are read first, then the manifests, so that such a
        pull is seen in one or the other (as GC reads them, docs/architecture.md)."""
        others: set[Digest] = set()
        for held in read_leases(self.layout).live:
            if not keeper.mine(held):
                others |= held.digests
        reach = reachable(self.layout)
        if not reach.complete:
            return  # a manifest unread may name any of them: GC decides later
        for d in digests:
            if keeper.holds(d) <= 1 and d not in others and d.blob_name not in reach.blob_names:
                with contextlib.suppress(FileNotFoundError):
                    self.layout.blob(d).unlink()

    def _missing(self, blobs: dict[Digest, int], freshen: bool = False) -> list[Digest]:
        """The blobs not here with the right size; with `freshen`, each one here gets a fresh
        mtime, so that a prune that spares young blobs (Ollama's: under an hour) spares it."""
        missing = []
        for d, size in blobs.items():
            if not blob_ok(self.layout, d, size):
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
                raise local_error(exc, self.layout, "the pull's lease") from None
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
                    await self.fetcher.fetch(name, digest, size, peers, result, live)
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


# -- entry point ------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def pull_lease(layout: Layout) -> AsyncIterator[LiveLease]:
    """The lease of a pull: every blob of the models in flight, on disk while they are."""
    keeper = LeaseKeeper(layout, "pull")
    try:
        await trio.to_thread.run_sync(keeper.write)  # empty; says early that it cannot be
    except OSError as exc:
        raise local_error(exc, layout, "the pull's lease") from None
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
        raise local_error(exc, layout, "anything") from None
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
        exc = local_error(exc, layout, f"model {text}")
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
    "peer_clients",
    "pull",
    "run_pull",
]
