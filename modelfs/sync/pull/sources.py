"""A pull's sources: which peer to ask next, failing over, and naming one that lies.

    await fetch_manifest(name, ref, peers, expect) -> (FetchedManifest, Manifest | ManifestList)
    await fetch_child(name, digest, peers, top) -> (FetchedManifest, Manifest)
    order(peers, first) -> peers, `first` first
    Sources(peers, rounds): .next(), .failed(peer, exc), .avoid(peer, exc, avoided, digest)

A manifest comes from the first source that answers (`GET /v2/<repo>/manifests/<tag>` with
`Accept` naming Ollama's list type first): a source that is unreachable, answers 5xx, 401,
404 or sends bytes that do not hash to its `Docker-Content-Digest` is passed over, and named in
the error if none answers. A child of a manifest list is fetched by digest and checked
against it.

Each blob tries the source that served the manifest first, then the others in the order
given. A source that is unreachable, times out, stalls for `read_timeout` seconds or answers
5xx is passed over and may be tried once more after the others (the bytes it sent are kept);
one that answers 401/403/404 is not asked again for that blob; one that sends wrong bytes (a
digest mismatch, a wrong Content-Length or Content-Range, a truncated body) is named in a
warning and in the report and is not used again for that blob.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.manifest import MEDIA_LIST, Manifest, ManifestList, parse_manifest
from modelfs.store.names import Name
from modelfs.sync.client.peer import FetchedManifest, PeerClient
from modelfs.sync.errors import (
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    PeerUnreachableError,
    SyncError,
)
from modelfs.sync.wire.ocirepr import decode_list, parse_carrier

log = logging.getLogger(__name__)


def one_error(errors: list[tuple[str, SyncError]], what: str) -> SyncError:
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


class Sources:
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

    def avoid(
        self, peer: PeerClient, exc: SyncError, avoided: dict[str, str], digest: Digest
    ) -> None:
        """`failed`, for a blob; a peer that lied is named in `avoided` (the model's report)
        and in a warning."""
        self.failed(peer, exc)
        if isinstance(exc, PeerLiedError):
            avoided[peer.url] = str(exc)
            log.warning("%s; not asking %s for %s again in this try", exc, peer.url, digest)
        else:
            log.info("%s", exc)


def order(peers: Sequence[PeerClient], first: str) -> list[PeerClient]:
    """`peers` with the one at URL `first` (the one that served the manifest) first."""
    return sorted(peers, key=lambda p: p.url != first)


async def fetch_manifest(
    name: Name, ref: str | Digest, peers: Sequence[PeerClient], expect: Digest | None
) -> tuple[FetchedManifest, Manifest | ManifestList]:
    sources = Sources(peers, 1)
    while (peer := sources.next()) is not None:
        try:
            fetched = await peer.manifest(name, ref, expect=expect)
            try:
                if expect is None:
                    fetched = await _uncarry(peer, name, fetched)
                parsed = parse_manifest(fetched.raw, f"{peer.url}: manifest {ref}")
            except StoreError as exc:
                raise PeerLiedError(str(exc)) from None
            return fetched, parsed
        except SyncError as exc:
            log.debug("%s: %s", peer.url, exc)
            sources.failed(peer, exc)
    what = f"manifest {name.shortest}" if expect is None else f"manifest {ref}"
    raise one_error(sources.errors, what)


async def _uncarry(peer: PeerClient, name: Name, fetched: FetchedManifest) -> FetchedManifest:
    """A manifest list that `modelfs push` stored in a registry as a carrier manifest
    (sync.ocirepr): the list's own bytes, from the carrier's config blob, verified."""
    carrier = parse_carrier(fetched.raw, fetched.media_type)
    if carrier is None:
        return fetched
    ref = carrier.list_ref
    the_list = decode_list(carrier, await peer.blob(name, ref.digest, ref.size))
    return FetchedManifest(the_list.raw, MEDIA_LIST, the_list.digest, peer.url)


async def fetch_child(
    name: Name, digest: Digest, peers: Sequence[PeerClient], top: FetchedManifest
) -> tuple[FetchedManifest, Manifest]:
    """A child manifest of the list `top`, by digest, checked against it."""
    fetched, manifest = await fetch_manifest(name, digest, peers, digest)
    if isinstance(manifest, ManifestList):
        raise PeerError(f"{fetched.url}: manifest list {top.digest} nests a list")
    return fetched, manifest
