"""Which blobs the manifests of a store keep alive, for GC and `verify`.

Unlike the scan, which shows one entry per name, this reads every manifest file there is:
legacy files that a v2 tag hides (Ollama's downgrade anchor), duplicates, shadow tags. A blob
named by any of them, in any form, is reachable:

- the config and layers of a manifest;
- the manifest's own bytes as a blob (v2 tags are links to them; a pull stores them too);
- every child of a manifest list, present or not, and the blobs of each present child.

A manifest blob that GC moved to `.modelfs/trash/` while something still names it (a v2 link,
a list, a lease) is read from there when the caller passes the trash's contents: what it names
is reachable, and GC puts it back, rather than refusing over a link it left dangling itself.

A file where a manifest should be (depth 4 of a manifests tree) that cannot be read as one
makes the answer unsafe: it may be a manifest half-written by another host, naming blobs
nothing else names. Such files are listed in `unreadable`, and GC refuses to delete anything
while there are any, as Ollama's own prune does ("corrupt manifests detected").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.errors import InvalidNameError, ManifestError, StoreError
from modelfs.store.index.reachcache import Key, ReachCache
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    ManifestList,
    ManifestRefs,
    parse_manifest_refs,
)
from modelfs.store.names import name_from_path_parts
from modelfs.store.scan import (
    STRAY_DIRECTORY,
    Problem,
    read_limited,
    removed_tag,
    walk_manifest_tree,
)


@dataclass
class Reach:
    """The reachable digests of a store, and what made the answer incomplete."""

    # By file name under blobs/ (`sha256-<hex>`), what GC compares with that directory's
    # listing: a large store names 100,000 blobs, and needs no Digest object for each.
    blob_names: set[str] = field(default_factory=set)
    manifests: int = 0  # manifest files read
    tags: int = 0  # files where a tag would be (depth 4 of a manifests tree), of any name
    unreadable: list[Problem] = field(default_factory=list)  # GC must not delete while any
    strays: list[Problem] = field(default_factory=list)  # harmless: no manifest can be there
    removed: list[Problem] = field(default_factory=list)  # v2 links `ollama rm` left: no roots

    @property
    def complete(self) -> bool:
        return not self.unreadable

    @property
    def digests(self) -> set[Digest]:
        return {Digest(name[7:]) for name in self.blob_names}

    def keep(self, digests: Iterable[Digest]) -> None:
        """Count `digests` as reachable too (tag history's roots)."""
        self.blob_names.update(d.blob_name for d in digests)


class _Reader:
    def __init__(
        self, layout: Layout, trash: Mapping[Digest, Path], cache: ReachCache | None = None
    ) -> None:
        self.layout = layout
        self.trash = trash
        self.cache = cache
        self.reach = Reach()
        self._children: dict[Digest, ManifestRefs | StoreError | None] = {}

    def tree(self, root: Path, *, v2: bool) -> None:
        top, cache = root.name, self.cache
        for parts, de, problem in walk_manifest_tree(root):
            key = None
            if not problem:
                self.reach.tags += 1
            if cache is not None and not problem:
                assert de is not None
                # As it was when its name was found valid and its manifest read: so it stays.
                key = cache.key(de.path, is_link=de.is_symlink())  # before any read
                names = None if key is None else cache.names(de.path, key)
                if names is not None:
                    self.reach.blob_names.update(names)
                    self.reach.manifests += 1
                    continue
            rel = "/".join((top, *parts))
            if problem:
                # Above tag depth, or a directory at it: no manifest can be there, so nothing
                # is unknown (a listing that failed is, and stops GC).
                harmless = de is not None and (len(parts) < 4 or problem == STRAY_DIRECTORY)
                kind = "stray" if harmless else "bad-manifest"
                target = self.reach.strays if kind == "stray" else self.reach.unreadable
                target.append(Problem(kind, rel, problem))
                continue
            assert de is not None
            try:
                name_from_path_parts(parts, v2=v2)
            except InvalidNameError:
                self._invalid_name(Path(de.path), rel)
                continue
            try:
                self.manifest_file(de.path, rel, is_link=de.is_symlink(), key=key)
            except (StoreError, OSError) as exc:
                removed = removed_tag(self.layout, de.path) if v2 else None
                if removed is not None:
                    self.reach.removed.append(Problem("removed-tag", rel, removed))
                elif isinstance(exc, OSError):
                    self._unreadable(rel, exc.strerror or str(exc))
                else:
                    self._unreadable(rel, str(exc).removeprefix(f"{rel}: "))

    def _invalid_name(self, path: Path, rel: str) -> None:
        """A file where a tag would be whose name no tag can have (`.DS_Store`, `._latest`
        from a Mac, `latest~` from an editor). No tool names a model so, yet one might be a
        manifest copied under an odd name: one whose bytes are a manifest keeps its blobs,
        and either way it is a stray, reported and kept, and GC goes on."""
        try:
            raw = read_limited(path, MAX_MANIFEST_BYTES)
            self.manifest_bytes(raw, rel)
        except (StoreError, OSError):
            message = "not a valid model name, and no manifest"
        else:
            message = "not a valid model name, but a manifest: its blobs are kept"
        self.reach.strays.append(Problem("stray", rel, message))

    def manifest_file(self, path: str, rel: str, *, is_link: bool, key: Key | None = None) -> None:
        """Read a tag file; `is_link`: the listing found a symlink there; `key`: its reach
        index key, taken before the read (a change after it shows), to remember it by."""
        cache, trashed = self.cache, None
        target = ""
        if is_link:
            # The link's target is kept whatever it holds: it is what the tag names.
            try:
                target = os.path.basename(os.readlink(path))
            except FileNotFoundError:
                return  # removed since it was listed (another host's `ollama rm`): names nothing
            except OSError:
                target = ""  # no longer a link: read as whatever it is now
            if is_blob_name(target):
                self.reach.blob_names.add(target)
                trashed = self.trash.get(Digest(target.removeprefix("sha256-")))
        try:
            raw = read_limited(path, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            if trashed is None:
                if not os.path.lexists(path):
                    return  # removed between the look and the open: names nothing, as above
                raise
            raw = read_limited(trashed, MAX_MANIFEST_BYTES)  # dangling into the trash
            key = None
        kept = self.manifest_bytes(raw, rel)
        if cache is not None and key is not None and kept is not None:
            cache.keep(path, key, (target, *kept) if is_blob_name(target) else kept)

    def manifest_bytes(self, raw: bytes, rel: str) -> tuple[str, ...] | None:
        """Count what the manifest `raw` keeps; for a plain one, return those blob names."""
        parsed = parse_manifest_refs(raw, rel)
        self.reach.manifests += 1
        names = self.reach.blob_names
        names.add(parsed.digest.blob_name)
        if isinstance(parsed, ManifestRefs):
            names.update(parsed.blob_names)
            return (parsed.digest.blob_name, *parsed.blob_names)
        for child in parsed.children:
            names.add(child.digest.blob_name)
            if child.inline is not None:
                names.update(d.blob_name for d in child.inline.blob_digests())
                continue
            refs = self._child(child.digest)
            if isinstance(refs, StoreError):
                raise ManifestError(f"{rel}: child {child.digest}: {refs}")
            if refs is not None:
                names.update(refs.blob_names)
        return None

    def _child(self, digest: Digest) -> ManifestRefs | StoreError | None:
        """A list child's manifest blob: None when absent (a pull takes only some children)."""
        if digest not in self._children:
            self._children[digest] = self._read_child(digest)
        return self._children[digest]

    def _read_child(self, digest: Digest) -> ManifestRefs | StoreError | None:
        rel = f"blobs/{digest.blob_name}"
        try:
            raw = self.manifest_blob(digest)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return ManifestError(f"{rel}: {exc.strerror}")
        try:
            parsed = parse_manifest_refs(raw, rel)
        except StoreError as exc:
            return exc
        if isinstance(parsed, ManifestList):
            return ManifestError(f"{rel}: a list inside a list")
        return parsed

    def manifest_blob(self, digest: Digest) -> bytes:
        """A manifest blob's bytes, from `blobs/` or else from the trash."""
        try:
            return read_limited(self.layout.blob(digest), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            if digest not in self.trash:
                raise
            return read_limited(self.trash[digest], MAX_MANIFEST_BYTES)

    def _unreadable(self, rel: str, message: str) -> None:
        self.reach.unreadable.append(Problem("bad-manifest", rel, message))


def reachable(
    layout: Layout,
    manifests: Iterable[Digest] = (),
    trash: Mapping[Digest, Path] | None = None,
    cache: ReachCache | None = None,
) -> Reach:
    """Every digest some manifest of the store keeps alive; `manifests` are extra roots (from
    leases and tag history): manifest blobs whose blobs count as reachable while they exist.
    `trash`: the blobs in GC's trash, where a manifest blob missing from `blobs/` is read.
    `cache`: what the last look read from tag files unchanged since (a plan's, never the look
    before a move), left updated for the caller to save."""
    with cycles_uncollected():
        return _reach(layout, manifests, trash or {}, cache)


def _reach(
    layout: Layout,
    manifests: Iterable[Digest],
    trash: Mapping[Digest, Path],
    cache: ReachCache | None,
) -> Reach:
    reader = _Reader(layout, trash, cache)
    reader.tree(layout.manifests_v2, v2=True)
    reader.tree(layout.manifests, v2=False)
    for digest in manifests:
        reader.reach.blob_names.add(digest.blob_name)
        rel = f"blobs/{digest.blob_name}"
        try:
            raw = reader.manifest_blob(digest)
            reader.manifest_bytes(raw, rel)
        except FileNotFoundError:
            continue  # gone already: it keeps nothing
        except StoreError as exc:
            reader._unreadable(rel, str(exc).removeprefix(f"{rel}: "))
        except OSError as exc:
            reader._unreadable(rel, exc.strerror or str(exc))
    return reader.reach
