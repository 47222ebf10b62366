"""What the registry server answers from: a `View` of one store snapshot (its manifests, blob
sizes, repositories and tags), the manifest a tag or digest stands for, and listings a page at
a time (OCI pagination)."""

from __future__ import annotations

import bisect
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlencode

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_fd
from modelfs.store.errors import ModelNotFoundError, StoreError
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
from modelfs.store.scan import ScanCache, StoreIndex, scan_store
from modelfs.sync.registry.http import DIGITS, HTTPError, accepts
from modelfs.sync.wire.protocol import name_from_repository
from modelfs.sync.wire.registry_names import RegistryNameError, repository_for

MAX_PAGE = 10_000
COMPRESSIBLE_KINDS = frozenset(
    {"template", "prompt", "system", "params", "messages", "license", "json"}
)


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


def check_repository(repository: str) -> None:
    name_from_repository(repository, "latest")


def resolve_tag(
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


def stored_digest(view: View, name: Name) -> Digest | None:
    """The digest of the store's manifest for a tag, or None."""
    try:
        return view.index.lookup(name).top.digest
    except ModelNotFoundError:
        return None


def manifest_blob(layout: Layout, digest: Digest) -> Manifest | ManifestList:
    """A manifest held only as a blob (no tag names it): read, verified, parsed."""
    missing = ModelNotFoundError(f"manifest {digest} not found")
    try:
        fd = open_fd(layout.blob(digest), follow=False)
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


# -- listings, a page at a time ---------------------------------------------------------------
def page(items: Sequence[str], query: Mapping[str, str]) -> tuple[list[str], bool]:
    """OCI pagination: names after `last` (case-insensitive order), at most `n` of them."""
    n_text = query.get("n")
    limit = MAX_PAGE
    if n_text is not None:
        if not DIGITS.fullmatch(n_text):
            raise HTTPError(400, "PAGINATION_NUMBER_INVALID", f"invalid n {n_text[:20]!r}")
        limit = min(int(n_text), MAX_PAGE)
    last = query.get("last")
    start = bisect.bisect_right(items, _sort_key(last), key=_sort_key) if last else 0
    chunk = list(items[start : start + limit])
    more = start + limit < len(items)
    return chunk, more and bool(chunk)


def _sort_key(text: str) -> tuple[str, str]:
    return (text.lower(), text)


def next_link(
    path: str, query: Mapping[str, str], items: list[str], more: bool
) -> list[tuple[str, str]]:
    if not more:
        return []
    params = {"last": items[-1]}
    if "n" in query:
        params["n"] = query["n"]
    return [("Link", f'<{path}?{urlencode(params)}>; rel="next"')]
