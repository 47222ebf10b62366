"""A pull-through mirror of one upstream registry, for `modelfs serve --mirror URL`.

    mirror = Mirror(layout, url, logins, ttl=300.0, prefer=DEFAULT_PREFER, changed=app.changed)
    await nursery.start(mirror.run)                 the upstream session, the lease, the fetches
    await mirror.manifest(view, repo, ref, lists=…) -> Manifest | ManifestList | None
    await mirror.blob(repo, digest) -> BlobFetch | None

The server (sync.server) asks the mirror whenever a manifest or blob request finds nothing in
the store, and for a tag whose last look upstream is older than `ttl`; None means "serve it
from the store". What comes from upstream goes where a pull puts it, by the pull's own code:

- **Manifests.** Fetched with the pull's client (`PeerClient.manifest`: the token flow,
  docker's credentials, proxies; bytes checked against `Docker-Content-Digest`). A tag's
  manifest is looked up upstream again once `ttl` seconds have passed since the last look; when
  upstream cannot answer (down, 5xx, 404) the store's copy is served. A manifest by digest is
  immutable: once held, never asked for again. A tag's manifest is *pending* until every blob
  it names is in `blobs/`: its digests are in the mirror's lease meanwhile (GC invariant 3,
  docs/architecture.md), and then `ManifestWriter.write_manifest` writes it (the legacy file),
  as a pull's last step. A GET of a tag starts fetching its missing blobs in the background,
  so the model lands whole even when the client had some of its blobs already.
- **Blobs.** One `BlobFetch` a blob: the pull's temp file and lock (`sync.partial.PartialBlob`,
  `sync.transfer.open_partial`: a pull into the same store and the mirror never fetch one blob
  twice), filled front to back from one upstream GET on the pull's raw receiver
  (`PeerClient.open_range`), hashed as it arrives, fsynced and renamed into `blobs/`
  (`sync.transfer.promote`) only when the sha256 is the digest. Every request for that blob
  meanwhile, from any number of clients, reads the temp file behind the writer
  (`BlobFetch.ready`): single flight, upstream sees one GET. The answer that carries the blob's
  last byte waits for the hash, so a blob whose bytes are wrong is never kept and no client
  gets a complete answer with it (their connection is cut); earlier ranges (a ranged client's
  parts) complete as their bytes arrive, and that client's check of the whole blob fails.
  A failed fetch is forgotten: the next request starts a fresh one.

- **Manifest lists.** A pull writes a list's tag from the children it chose; a mirror keeps
  it from the children its clients chose. The list is stored as a blob and leased as a root
  at once (so every child manifest and blob fetched meanwhile is reachable through it), and
  once some child's manifest and all its blobs are in the store, `ManifestWriter.write_list`
  writes the tag from the children that are: the v2 link, the legacy anchor and a variant
  anchor for each other child, as a pull with those children writes them. A child completed
  later (a client that prefers another runner) writes the tag again with it. From the first
  write on the tag is the store's: served without upstream when upstream is down, and kept
  by GC as any tag.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from modelfs.runtime.keyedlocks import KeyedLocks
from modelfs.runtime.leasing import LiveLease, leased
from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.errors import MissingBlobError, ModelNotFoundError, StoreError
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseKeeper
from modelfs.store.listtag import present_children
from modelfs.store.manifest import (
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    parse_manifest,
)
from modelfs.store.names import Name
from modelfs.store.scan import DEFAULT_PREFER, rank_children
from modelfs.sync.client.credentials import Logins
from modelfs.sync.client.http import mapped_errors, raise_for_status
from modelfs.sync.client.partial import AlignedPool, PartialBlob
from modelfs.sync.client.peer import (
    FetchedManifest,
    PeerClient,
    PeerSession,
    peer_session,
)
from modelfs.sync.client.rawhttp import NeedsHttpx, TruncatedBodyError
from modelfs.sync.client.threads import in_thread
from modelfs.sync.errors import PeerLiedError, PeerNotFoundError, SyncError
from modelfs.sync.pull.manifests import ManifestWriter, existing_name
from modelfs.sync.pull.transfer import blob_ok, open_partial, promote
from modelfs.sync.wire.protocol import name_from_repository
from modelfs.sync.wire.registry_names import repositories

log = logging.getLogger(__name__)

DEFAULT_TTL = 300.0  # seconds a tag's manifest is served before upstream is asked again
CHUNK = 4 << 20  # one receive, write and hash; what a reader is told about at once
WRITES_AHEAD = 2  # chunks received and hashed while earlier ones are still being written
RECENT = 8  # chunks kept in memory for the readers that follow the writer closely
BACKGROUND = 2  # blobs of a pending model fetched at once when no client asks for them


class MirrorError(SyncError):
    """Upstream could not give what was asked for, and the store has no copy."""


# -- one blob on its way ----------------------------------------------------------------------
@dataclass(eq=False)
class BlobFetch:
    """A blob being fetched into the store: where its bytes are, how many, how it ended."""

    digest: Digest
    size: int
    path: Path | None = None  # the temp file, once open; the blob itself once it landed
    written: int = 0
    landed: bool = False
    error: BaseException | None = None
    _changed: trio.Event = field(default_factory=trio.Event)
    opened: trio.Event = field(default_factory=trio.Event)
    # The last chunks written, by offset: readers right behind the writer copy them from
    # here, not back from the file (which the writer fills with O_DIRECT, so reading it means
    # the disk again: on this project's VM ~2 s of CPU a GiB).
    recent: dict[int, bytes] = field(default_factory=dict)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def advance(self, written: int, chunk: bytes = b"") -> None:
        if chunk:
            self.recent[written - len(chunk)] = chunk
            while len(self.recent) > RECENT:
                del self.recent[next(iter(self.recent))]
        self.written = written
        self._wake()

    def cached(self, pos: int, end: int) -> bytes | None:
        """Bytes [pos, end) as far as one recent chunk holds them, or None."""
        start = pos - pos % CHUNK
        data = self.recent.get(start)
        if data is None:
            return None
        stop = min(end, start + len(data))
        if pos == start and stop == start + len(data):
            return data
        return data[pos - start : stop - start]

    def land(self, path: Path) -> None:
        self.path, self.written, self.landed = path, self.size, True
        self.opened.set()
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.opened.set()
        self._wake()

    @property
    def done(self) -> bool:
        return self.landed or self.error is not None

    async def ready(self, pos: int, end: int) -> int:
        """Wait until bytes from `pos` on are on disk; how far (at most `end`) they may be
        read. The blob's last byte only once the whole blob hashed to its digest; raises the
        fetch's error when it failed."""
        while True:
            if self.error is not None:
                raise MirrorError(f"blob {self.digest}: {self.error}")
            limit = min(end, self.written)
            if limit == self.size and not self.landed:
                limit -= 1  # held back until the hash says the bytes are right
            if limit > pos:
                return limit
            await self._changed.wait()

    async def wait(self) -> None:
        while not self.done:
            await self._changed.wait()


@dataclass(eq=False)
class Pending:
    """A tag's manifest served from upstream, written to the store once its blobs are (a
    list's: once some child's are)."""

    name: Name
    raw: bytes
    manifest: Manifest | ManifestList
    blobs: dict[Digest, int]  # a list's are its children's, found in `_settle_list`
    background: bool = False  # its missing blobs are being fetched
    written: frozenset[int] = frozenset()  # the children of a list its tag was written with
    leased: bool = True  # its digests are in the mirror's lease


# -- the mirror -------------------------------------------------------------------------------
class Mirror:
    def __init__(
        self,
        layout: Layout,
        url: str,
        logins: Logins,
        *,
        ttl: float = DEFAULT_TTL,
        prefer: Sequence[str] = DEFAULT_PREFER,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.layout = layout
        self.url = url.rstrip("/")
        self.logins = logins
        self.ttl = ttl
        self.prefer = tuple(prefer)
        self.changed = changed  # the store changed: the server looks at it again
        self.writer = ManifestWriter(layout, prefer)
        self._session: PeerSession | None = None
        self._lease: LiveLease | None = None
        self._nursery: trio.Nursery | None = None
        self._fetches: dict[Digest, BlobFetch] = {}
        self._sizes: dict[Digest, int] = {}  # from the manifests seen upstream
        self._pending: dict[tuple[str, str, str, str], Pending] = {}
        # tag -> upstream's manifest, while it is not (yet) the store's
        self._tops: dict[tuple[str, str, str, str], Manifest | ManifestList] = {}
        self._looked: dict[tuple[str, str, str, str], float] = {}  # tag -> last look upstream
        # tag -> its lock while a request looks it up (a client may name any tag)
        self._tag_locks = KeyedLocks[tuple[str, str, str, str]]()
        # One settle at a time: a list's settle awaits between its check and its write, and
        # two of them (each blob fetch that lands settles) wrote and forgot it twice.
        self._settling = trio.Lock()
        self._background = trio.CapacityLimiter(BACKGROUND)
        self.upstream_requests = 0  # manifests and blobs asked of upstream, for status

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the upstream session, the lease and the fetches until cancelled."""
        BlobStore(self.layout).ensure_dirs()
        async with (
            peer_session(self.logins) as self._session,
            leased(LeaseKeeper(self.layout, "mirror"), strict=True) as self._lease,
            trio.open_nursery() as self._nursery,
        ):
            log.info("mirroring %s", self.url)
            task_status.started()
            await trio.sleep_forever()

    @property
    def upstream(self) -> PeerClient:
        assert self._session is not None, "Mirror.run is not running"
        return self._session.peer(self.url)

    @property
    def lease(self) -> LiveLease:
        assert self._lease is not None, "Mirror.run is not running"
        return self._lease

    # -- manifests ------------------------------------------------------------------------------
    async def manifest(
        self,
        index_has: Callable[[Name], Digest | None],
        repository: str,
        reference: str,
        *,
        lists: bool,
        get: bool,
    ) -> Manifest | ManifestList | None:
        """What a manifest request is answered with; None: the store's copy.

        `index_has(name)` is the digest of the store's manifest for a tag (None: none);
        `lists`: the client takes manifest lists; `get`: a GET (a HEAD starts no blob fetch).
        """
        if ":" in reference:
            return await self._by_digest(repository, Digest.parse(reference))
        name = name_from_repository(repository, reference)
        key = name.key
        async with self._tag_locks.hold(key):
            fresh = time.monotonic() - self._looked.get(key, -float("inf")) < self.ttl
            if fresh:
                top: Manifest | ManifestList | None = self._tops.get(key)
            else:
                top = await self._look_up(name, reference, index_has(name))
        if top is None:
            return None
        if isinstance(top, ManifestList) and not lists:
            # As the store answers such a client (sync.server `_resolve_tag`): the child
            # `prefer` ranks first.
            child = top.children[rank_children(top, self.prefer)[0]]
            return await self._by_digest(repository, child.digest)
        if get and key in self._pending:
            self._start_background(self._pending[key])
        return top

    async def _look_up(
        self, name: Name, reference: str, stored: Digest | None
    ) -> Manifest | ManifestList | None:
        """Ask upstream for a tag (under its lock); None when the store's copy is the one."""
        try:
            self.upstream_requests += 1
            fetched = await self.upstream.manifest(name, reference)
            parsed = _parse(fetched.raw, f"{self.url}: manifest {name.shortest}")
        except SyncError as exc:
            if stored is not None:
                log.warning("%s: %s; serving the stored copy", name.shortest, exc)
                return None
            if isinstance(exc, PeerNotFoundError):
                raise ModelNotFoundError(f"{name.shortest}: not here, nor upstream") from None
            raise MirrorError(str(exc)) from None
        self._looked[name.key] = time.monotonic()
        old = self._pending.get(name.key)
        if old is not None and old.raw == fetched.raw:
            return old.manifest
        if old is not None:  # upstream moved the tag on before the old one landed
            del self._pending[name.key]
            self._release(old)
        if fetched.digest == stored:
            self._tops.pop(name.key, None)
            return None
        self._tops[name.key] = parsed
        if isinstance(parsed, Manifest):
            blobs = parsed.blob_sizes()
            self._sizes.update(blobs)
        else:
            # Stored now, so that the lease's root below names the children (and their
            # blobs) fetched before the tag is written.
            await trio.to_thread.run_sync(BlobStore(self.layout).put_bytes, fetched.raw)
            blobs = {}
        pending = Pending(name, fetched.raw, parsed, blobs)
        # The pending owns the hold from the moment it is counted: a request cancelled while
        # the lease is written leaves it to the pending, let go when it lands or is replaced.
        self._pending[name.key] = pending
        await self.lease.hold(blobs, manifests=[fetched.digest])
        await self._settle()
        return parsed

    async def _by_digest(self, repository: str, digest: Digest) -> Manifest | ManifestList | None:
        """A manifest by digest: the store's if it holds it (None), else upstream's, kept as
        a blob (immutable: never asked for again)."""
        if await trio.to_thread.run_sync(BlobStore(self.layout).has, digest):
            return None
        name = name_from_repository(repository, "latest")
        try:
            self.upstream_requests += 1
            fetched = await self.upstream.manifest(name, digest, expect=digest)
        except PeerNotFoundError:
            raise ModelNotFoundError(f"manifest {digest}: not here, nor upstream") from None
        except SyncError as exc:
            raise MirrorError(str(exc)) from None
        parsed = _parse(fetched.raw, f"{self.url}: manifest {digest}")
        if isinstance(parsed, Manifest):
            self._sizes.update(parsed.blob_sizes())
        await trio.to_thread.run_sync(BlobStore(self.layout).put_bytes, fetched.raw)
        self.changed()
        return parsed

    def _release(self, pending: Pending) -> None:
        if pending.leased:
            pending.leased = False
            self.lease.drop(pending.blobs, manifests=[Digest.of_bytes(pending.raw)])

    async def _settle(self) -> None:
        """Write every pending manifest whose blobs are all here, as a pull's last step."""
        async with self._settling:
            await self._settle_all()

    async def _settle_all(self) -> None:
        for key, pending in list(self._pending.items()):
            if isinstance(pending.manifest, ManifestList):
                await self._settle_list(key, pending, pending.manifest)
                continue
            present = await trio.to_thread.run_sync(_all_present, self.layout, pending.blobs)
            if not present or self._pending.get(key) is not pending:
                continue
            del self._pending[key]
            if self._tops.get(key) is pending.manifest:
                del self._tops[key]  # the store's copy from now on
            try:
                await trio.to_thread.run_sync(self._write, pending)
            except (SyncError, StoreError, OSError) as exc:
                log.error("%s: cannot write its manifest: %s", pending.name.shortest, exc)
            else:
                log.info("%s: kept", pending.name.shortest)
            finally:
                self._release(pending)
            self.changed()

    async def _settle_list(
        self, key: tuple[str, str, str, str], pending: Pending, lst: ManifestList
    ) -> None:
        """Write a pending list's tag from its children that are whole here, when they are
        more than it was last written with; forget it once every child is."""
        kept = await trio.to_thread.run_sync(_whole_children, self.layout, lst, self.url)
        done = frozenset(i for i, _, _ in kept)
        if not kept or done <= pending.written or self._pending.get(key) is not pending:
            return
        try:
            await trio.to_thread.run_sync(self._write_list, pending, kept)
        except (SyncError, StoreError, OSError) as exc:
            log.error("%s: cannot write its manifests: %s", pending.name.shortest, exc)
            return
        pending.written = done
        if self._tops.get(key) is pending.manifest:
            del self._tops[key]  # the store's copy from now on
        # The tag names the list now, and through it every child here: the lease may go.
        self._release(pending)
        runners = ", ".join(lst.children[i].runner or lst.children[i].digest.short for i in done)
        log.info("%s: kept (%s)", pending.name.shortest, runners)
        if len(done) == len(lst.children) and self._pending.get(key) is pending:
            del self._pending[key]
        self.changed()

    def _write(self, pending: Pending) -> None:
        existing, had_v2 = existing_name(self.layout, pending.name)
        self.writer.write_manifest(existing or pending.name, pending.raw, had_v2)

    def _write_list(
        self, pending: Pending, kept: list[tuple[int, FetchedManifest | None, Manifest]]
    ) -> None:
        assert isinstance(pending.manifest, ManifestList)
        existing, _ = existing_name(self.layout, pending.name)
        self.writer.write_list(existing or pending.name, pending.raw, pending.manifest, kept)

    def _start_background(self, pending: Pending) -> None:
        """Fetch the pending model's missing blobs, two at a time, unless a client asks first."""
        assert self._nursery is not None
        if pending.background:
            return
        pending.background = True
        repository = repositories(pending.name)[-1]
        for digest in pending.blobs:
            if digest not in self._fetches:
                self._nursery.start_soon(self._background_fetch, repository, digest)

    async def _background_fetch(self, repository: str, digest: Digest) -> None:
        async with self._background:
            try:
                fetch = await self.blob(repository, digest)
                if fetch is not None:
                    await fetch.wait()
            except (SyncError, StoreError) as exc:
                log.info("background fetch of %s: %s", digest, exc)

    # -- blobs ----------------------------------------------------------------------------------
    async def blob(self, repository: str, digest: Digest) -> BlobFetch | None:
        """The fetch of a blob the store lacks, started now or already under way, once its
        temp file is open; None when the blob is in the store."""
        fetch = self._fetches.get(digest)
        if fetch is None or fetch.error is not None:
            size = self._sizes.get(digest)
            if size is not None and await trio.to_thread.run_sync(
                blob_ok, self.layout, digest, size
            ):
                return None
            if size is None:
                size = await self._blob_size(repository, digest)
            fetch = self._fetches.get(digest)  # another request may have started it meanwhile
            if fetch is None or fetch.error is not None:
                fetch = BlobFetch(digest, size)
                self._fetches[digest] = fetch
                assert self._nursery is not None
                self._nursery.start_soon(self._fetch, repository, fetch)
        await fetch.opened.wait()
        if fetch.error is not None:
            raise MirrorError(f"blob {digest}: {fetch.error}")
        return fetch

    async def _blob_size(self, repository: str, digest: Digest) -> int:
        """A blob no manifest seen here names: its size, from upstream's answer to HEAD."""
        peer = self.upstream
        what = f"blob {digest}"
        name = name_from_repository(repository, "latest")
        for repo in repositories(name):
            url = peer.blob_url(repo, digest)
            try:
                with mapped_errors(self.url, what):
                    self.upstream_requests += 1
                    response = await peer.http.head(url, follow_redirects=True)
                    raise_for_status(response, what)
            except PeerNotFoundError:
                continue
            except SyncError as exc:
                raise MirrorError(str(exc)) from None
            length = response.headers.get("content-length", "")
            if not length.isdigit():
                raise MirrorError(f"{url}: no Content-Length for {what}")
            return int(length)
        raise MissingBlobError(f"blob {digest}: not here, nor upstream")

    async def _fetch(self, repository: str, fetch: BlobFetch) -> None:
        digest, size = fetch.digest, fetch.size
        name = name_from_repository(repository, "latest")
        try:
            await self.lease.hold([digest])
            try:
                partial = await open_partial(self.layout, digest, size)
                if partial is None:  # another process (a pull) fetched it meanwhile
                    fetch.land(self.layout.blob(digest))
                    return
                try:
                    if partial.resumed:  # an interrupted pull's: we write front to back
                        await trio.to_thread.run_sync(partial.restart)
                    fetch.path = partial.path
                    fetch.opened.set()
                    stop = threading.Event()
                    self.upstream_requests += 1
                    try:
                        token = trio.lowlevel.current_trio_token()
                        got = await in_thread(
                            self._receive, name, fetch, partial, stop, token, stop=stop
                        )
                    except NeedsHttpx as why:  # before any byte: chunked, compressed, a proxy
                        log.debug("blob %s through httpx: %s", digest, why)
                        got = await self._receive_httpx(name, fetch, partial)
                    if got != digest.hex:
                        raise PeerLiedError(f"{self.url}: blob {digest} arrived with sha256 {got}")
                    await trio.to_thread.run_sync(promote, self.layout, partial)
                    fetch.land(self.layout.blob(digest))
                finally:
                    if not fetch.landed:
                        partial.close()
                        partial.discard()  # any byte of it may be the bad one
                    partial.release()
            finally:
                self.lease.drop([digest])
        except BaseException as exc:
            fetch.fail(exc)
            if not isinstance(exc, trio.Cancelled):
                log.warning("blob %s from %s: %s", digest, self.url, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if self._fetches.get(digest) is fetch:
                del self._fetches[digest]
        self.changed()
        await self._settle()

    def _receive(
        self,
        name: Name,
        fetch: BlobFetch,
        partial: PartialBlob,
        stop: threading.Event,
        token: trio.lowlevel.TrioToken,
    ) -> str:
        """In a worker thread: the blob from one upstream GET into the temp file, front to
        back, hashed as it arrives; the sha256. A writer thread of its own writes each chunk
        (O_DIRECT from page-aligned pool buffers: on this project's VM buffered writes of a
        fresh GiB cost seconds of CPU, sync.partial `_open_direct`) and then tells the
        readers, while this one receives and hashes the next."""
        h = hashlib.sha256()
        size = fetch.size
        if size == 0:
            return h.hexdigest()
        body = self.upstream.open_range(name, fetch.digest, 0, size, size, stop=stop)
        pool = AlignedPool(WRITES_AHEAD + 1, CHUNK)
        writes: queue.Queue[tuple[mmap.mmap, int, int, bytes] | None] = queue.Queue()
        failed: list[BaseException] = []

        def write() -> None:
            while (item := writes.get()) is not None:
                buf, n, at, chunk = item
                try:
                    if not failed:
                        with memoryview(buf) as view:
                            partial.write(view[:n], at)
                        trio.from_thread.run_sync(fetch.advance, at + n, chunk, trio_token=token)
                except BaseException as exc:
                    failed.append(exc)
                finally:
                    pool.put(buf)

        writer = threading.Thread(target=write, name=f"mirror write {fetch.digest.short}")
        writer.start()
        pos = 0
        try:
            while pos < size:
                if failed:
                    raise failed[0]
                buf = pool.get(stop)
                filled = 0
                want = min(CHUNK, size - pos)
                with memoryview(buf) as view:
                    while filled < want:
                        filled += body.readinto(view[filled:want])
                chunk = buf[:filled]
                h.update(chunk)
                writes.put((buf, filled, pos, chunk))
                pos += filled
        finally:
            body.close()
            writes.put(None)
            writer.join()
        if failed:
            raise failed[0]
        os.fsync(partial.fd)
        return h.hexdigest()

    async def _receive_httpx(self, name: Name, fetch: BlobFetch, partial: PartialBlob) -> str:
        """The same through httpx, for an answer the raw receiver does not take."""
        h = hashlib.sha256()
        size, what = fetch.size, f"blob {fetch.digest}"
        url = self.upstream.blob_url(repositories(name)[0], fetch.digest)
        pos, buf = 0, bytearray()
        with mapped_errors(self.url, what):
            async with self.upstream.http.stream("GET", url) as response:
                raise_for_status(response, what)
                async for chunk in response.aiter_bytes():
                    buf += chunk
                    if pos + len(buf) > size:
                        raise PeerLiedError(f"{url}: more than {size} bytes for {what}")
                    while len(buf) >= CHUNK:
                        chunk = bytes(buf[:CHUNK])
                        del buf[:CHUNK]
                        pos = await trio.to_thread.run_sync(_append, partial, h, chunk, pos)
                        fetch.advance(pos, chunk)
        pos = await trio.to_thread.run_sync(_append, partial, h, buf, pos)
        if pos != size:
            raise TruncatedBodyError(f"{url}: truncated body ({pos} of {size} bytes) for {what}")
        await trio.to_thread.run_sync(os.fsync, partial.fd)
        return h.hexdigest()

    def status(self) -> dict[str, object]:
        """For /modelfs/v1/status."""
        return {
            "upstream": self.url,
            "ttl_seconds": self.ttl,
            "fetching": len(self._fetches),
            "tags_looking_up": len(self._tag_locks),
            "pending": sorted(p.name.shortest for p in self._pending.values() if not p.written),
            "upstream_requests": self.upstream_requests,
        }


def _append(partial: PartialBlob, h: hashlib._Hash, data: bytes | bytearray, pos: int) -> int:
    """Write `data` at `pos` of the temp file and hash it; the position after it."""
    done = 0
    while done < len(data):
        done += os.pwrite(partial.fd, data[done:], pos + done)
    h.update(data)
    return pos + len(data)


def _parse(raw: bytes, where: str) -> Manifest | ManifestList:
    try:
        return parse_manifest(raw, where)
    except StoreError as exc:
        raise PeerLiedError(str(exc)) from None


def _all_present(layout: Layout, blobs: dict[Digest, int]) -> bool:
    return all(blob_ok(layout, d, size) for d, size in blobs.items())


def _whole_children(
    layout: Layout, lst: ManifestList, url: str
) -> list[tuple[int, FetchedManifest | None, Manifest]]:
    """The children of a list that are whole in the store (`store.listtag.present_children`),
    as `ManifestWriter.write_list` takes them."""
    return [
        (
            i,
            None
            if m is lst.children[i].inline
            else FetchedManifest(m.raw, MEDIA_MANIFEST, m.digest, url),
            m,
        )
        for i, m in present_children(layout, lst)
    ]
