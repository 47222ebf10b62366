"""What a scan of a store finds (store.scan builds it): every tag as an Entry, its variants and
their ranking, the blobs present, and what is wrong (Problem).

Problems (stray files, broken manifests, missing or misnamed blobs) are data, never
exceptions: one bad file must not hide the rest of the store, and must not be deleted.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import read_file
from modelfs.store.errors import ModelNotFoundError, StoreError
from modelfs.store.index.scancache import ScanCache
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_CONFIG_BYTES,
    ListChild,
    Manifest,
    ManifestList,
    ModelConfig,
    infer_runner,
    parse_config,
)
from modelfs.store.names import Name, parse_name
from modelfs.store.tagid import TagId, tag_ids

log = logging.getLogger(__name__)

DEFAULT_PREFER: tuple[str, ...] = ("llamacpp", "ggml", "mlx")


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong in the store, found by a scan. `path` is relative to the root."""

    kind: str  # stray | removed-tag | bad-manifest | missing-blob | bad-blob | foreign-blob
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


# What `verify` and `gc` call a stray (a file that is no model: kept, reported, GC goes on);
# every command says it in that word.
STRAY_KINDS = frozenset({"stray", "bad-blob", "removed-tag"})


@dataclass(frozen=True, slots=True)
class Variant:
    """One runnable manifest of a tag: the tag itself, or one child of its manifest list."""

    manifest: Manifest
    runner: str | None
    format: str | None
    from_list: bool


# The runner a list child's format implies when the list names none, as Ollama infers it.
_FORMAT_RUNNER = {"safetensors": "mlx", "gguf": "ggml"}


def child_runner(
    child: ListChild, manifest: Manifest | None = None, config: ModelConfig | None = None
) -> str | None:
    """The runner of a list's child: the list's own field, else what its manifest (when at
    hand) targets, else what the list's format implies."""
    if child.runner:
        return child.runner
    manifest = child.inline or manifest
    if manifest is not None:
        inferred = infer_runner(manifest, config)
        if inferred:
            return inferred
    return _FORMAT_RUNNER.get((child.format or "").lower())


def runner_rank(runner: str | None, prefer: Iterable[str]) -> int:
    """Where `runner` stands in `prefer` (case-insensitive); after all of them if absent."""
    return _rank(runner, prefer if isinstance(prefer, tuple) else tuple(prefer))


@functools.lru_cache(maxsize=256)  # a mount's build ranks 7,000 variants of a few runners
def _rank(runner: str | None, prefer: tuple[str, ...]) -> int:
    order = [p.lower() for p in prefer]
    r = (runner or "").lower()
    return order.index(r) if r in order else len(order)


def rank_children(
    lst: ManifestList,
    prefer: Iterable[str] = DEFAULT_PREFER,
    manifests: Mapping[Digest, Manifest] | None = None,
) -> list[int]:
    """Every child's index, best first by `prefer` (list order breaks ties). The one ranking
    of variants: what a pull fetches (its first) and what the mount shows at the plain tag
    (`choose_variant`, the first of those present) agree. `manifests` are the child manifests
    at hand, by digest; a child the list gives no runner is ranked by its manifest's."""
    prefer = tuple(prefer)
    known = manifests or {}

    def key(i: int) -> tuple[int, int]:
        child = lst.children[i]
        return (runner_rank(child_runner(child, known.get(child.digest)), prefer), i)

    return sorted(range(len(lst.children)), key=key)


def child_variant(child: ListChild, manifest: Manifest, config: ModelConfig | None) -> Variant:
    """A list's child as a variant: runner and format from the list, else inferred."""
    runner = child_runner(child, manifest, config)
    fmt = child.format or manifest.format or (config.model_format if config else None)
    return Variant(manifest, runner, fmt or None, True)


def choose_variant(
    variants: Iterable[Variant], prefer: Iterable[str] = DEFAULT_PREFER
) -> Variant | None:
    """The first variant by `prefer` (the ranking of `rank_children`), then any other; None
    when there is none."""
    prefer = tuple(prefer)
    return min(variants, key=lambda v: runner_rank(v.runner, prefer), default=None)


@dataclass(slots=True)
class Entry:
    """A tag in the store and what it resolves to."""

    name: Name
    source: str  # "v2" | "legacy"
    file: str  # the tag file's path, as listed
    rel: str  # the same, relative to the store's root (as problems name it)
    top: Manifest | ManifestList
    mtime_ns: int  # the tag file's (for a `manifests-v2/` link, the manifest blob's)
    variants: tuple[Variant, ...]
    absent_children: tuple[ListChild, ...] = ()
    anchor_mtime_ns: int | None = None  # a `manifests-v2/` tag's legacy anchor's, if any

    @property
    def path(self) -> Path:
        # Made when asked: a Path per tag was a tenth of a scan, and few callers want one.
        return Path(self.file)

    @property
    def modified_ns(self) -> int:
        """The tag's modified time, one for every command (`ls`, `ls --json`, `show`, the
        mount's mtimes): for a tag with a legacy anchor beside its `manifests-v2/` link, the
        anchor's mtime, since the anchor is what Ollama's /api/tags lists for it (ollama/ollama
        fb30760 manifest/manifest.go:175-227, server/model_list_cache.go:311-330); else the
        tag file's."""
        return self.mtime_ns if self.anchor_mtime_ns is None else self.anchor_mtime_ns

    @property
    def digest(self) -> Digest:
        """The digest of the bytes the tag names (a list's own digest for a list)."""
        return self.top.digest

    def preferred(self, prefer: Iterable[str] = DEFAULT_PREFER) -> Variant | None:
        """The variant to show at the plain tag: first by `prefer`, then any other present."""
        return choose_variant(self.variants, prefer)

    def wanted_child(self, prefer: Iterable[str] = DEFAULT_PREFER) -> ListChild | None:
        """For a manifest list, the child a pull by `prefer` fetches; None for a plain tag."""
        if not isinstance(self.top, ManifestList) or not self.top.children:
            return None
        known = {v.manifest.digest: v.manifest for v in self.variants}
        return self.top.children[rank_children(self.top, prefer, known)[0]]

    def tag_ids(self, prefer: Iterable[str] = DEFAULT_PREFER) -> TagId:
        """The tag's ID as every command and log line shows it (store.tagid): for a list,
        with the child `prefer` makes this host use."""
        if not isinstance(self.top, ManifestList):
            return tag_ids(self.digest)
        chosen = self.preferred(prefer)
        if chosen is None:
            return tag_ids(self.digest, is_list=True)
        return tag_ids(
            self.digest, is_list=True, child=chosen.manifest.digest, runner=chosen.runner
        )

    def tag_id(self, prefer: Iterable[str] = DEFAULT_PREFER) -> str:
        """tag_ids as the sentence a table or log line shows."""
        return str(self.tag_ids(prefer))

    def variant(self, runner: str) -> Variant | None:
        for v in self.variants:
            if v.from_list and (v.runner or "").lower() == runner.lower():
                return v
        return None


@dataclass(slots=True)
class BlobInfo:
    size: int
    mtime: float


@dataclass
class StoreIndex:
    layout: Layout
    entries: dict[tuple[str, str, str, str], Entry] = field(default_factory=dict)
    # Legacy files that `entries` does not show: hidden by a v2 tag of the same name (the
    # anchor), or spelled like another one but for case (Ollama lists `Foo` and `foo` both).
    hidden: list[Entry] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    blob_names: set[str] = field(default_factory=set)
    _configs: dict[Digest, ModelConfig | None] = field(default_factory=dict, repr=False)
    _blob_info: dict[str, BlobInfo | None] = field(default_factory=dict, repr=False)  # by hex
    _blobs_fd: int | None = field(default=None, repr=False)  # blobs/, open during the scan
    # Blob sizes by hex from the scan index, while blobs/ is as it was when they were taken (a
    # blob's bytes change only by a rename into blobs/: store.index.scancache); and the sizes
    # for the next: those taken (the tags recalled from the index checked them) and any new.
    _sizes: dict[str, int | None] | None = field(default=None, repr=False)
    _sizes_used: dict[str, int | None] = field(default_factory=dict, repr=False)
    cache: ScanCache | None = field(default=None, repr=False)
    _unread_configs: int = field(default=0, repr=False)  # asked of a listed blob, and None

    # -- lookups -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, name: Name | str) -> Entry:
        """Case-insensitive lookup, as Ollama's getExistingName; raise ModelNotFoundError."""
        parsed = parse_name(name) if isinstance(name, str) else name
        entry = self.entries.get(parsed.key)
        if entry is None:
            raise ModelNotFoundError(f"model {str(name)!r} not found")
        return entry

    def has_blob(self, digest: Digest) -> bool:
        return digest.blob_name in self.blob_names

    def blob_info(self, digest: Digest) -> BlobInfo | None:
        """Size and mtime of a present blob, or None (absent, or not a regular file)."""
        hex_ = digest.hex
        known = self._blob_info
        return known[hex_] if hex_ in known else self._look_at_blob(hex_)

    def blob_size(self, digest: Digest) -> int | None:
        """Size of a present blob, or None (absent, or not a regular file): the scan index's
        while blobs/ is as it listed it (what `missing_blobs` goes by), else `blob_info`'s.
        For counting what the manifests show without a stat per blob; a blob's own size and
        mtime, as shown, are `blob_info`'s."""
        hex_ = digest.hex
        trusted = self._sizes
        if trusted is not None and hex_ in trusted:
            return trusted[hex_]
        info = self.blob_info(digest)
        return None if info is None else info.size

    def _blob(self, name: str) -> tuple[str, int | None]:
        """A blob as the system calls take it: its name in blobs/ while a scan holds that
        directory open (a scan looks at thousands, and each full path is a walk of the
        tree), else its path (a string, not layout.blob(): a Path costs more than the look)."""
        fd = self._blobs_fd
        return (name, fd) if fd is not None else (f"{self.layout.blobs}/{name}", None)

    def _look_at_blob(self, hex_: str) -> BlobInfo | None:
        info: BlobInfo | None = None
        name = "sha256-" + hex_
        if name in self.blob_names:
            try:
                path, fd = self._blob(name)
                st = os.stat(path, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    info = BlobInfo(st.st_size, st.st_mtime)
            except OSError:
                pass
        self._blob_info[hex_] = info
        return info

    def config(self, manifest: Manifest) -> ModelConfig | None:
        """The parsed config blob of a manifest; None when absent or unreadable."""
        if manifest.config is None:
            return None
        digest = manifest.config.digest
        if digest not in self._configs:
            known = self.cache.configs.get(digest) if self.cache is not None else None
            if known is not None and self.has_blob(digest):
                self._configs[digest] = known
            else:
                self._configs[digest] = self._read_config(digest)
        config = self._configs[digest]
        if config is None and self.has_blob(digest):
            self._unread_configs += 1  # a scan keeps nothing it worked out from this answer
        return config

    def _read_config(self, digest: Digest) -> ModelConfig | None:
        if not self.has_blob(digest):
            return None
        try:
            path, fd = self._blob(digest.blob_name)
            raw = read_file(path, MAX_CONFIG_BYTES, dir_fd=fd)
            return parse_config(raw, f"blobs/{digest.blob_name}")
        except (OSError, StoreError) as exc:
            log.warning("config %s: %s", digest, exc)
            return None

    def missing_blobs(self, manifest: Manifest) -> list[Digest]:
        """Blobs the manifest needs that are absent or shorter/longer than it says."""
        # By hex, not by Digest: a str keeps its hash, a Digest computes one per lookup, and
        # a scan asks this of every layer of every model.
        sizes: dict[str, tuple[Digest, int]] = {}
        for layer in manifest.layers:
            sizes[layer.digest.hex] = (layer.digest, layer.size)
        if manifest.config is not None:
            sizes[manifest.config.digest.hex] = (manifest.config.digest, manifest.config.size)
        known, trusted, used = self._blob_info, self._sizes, self._sizes_used
        missing = []
        for hex_, (digest, size) in sizes.items():
            if trusted is not None and hex_ in trusted:
                got = trusted[hex_]
            else:
                info = known[hex_] if hex_ in known else self._look_at_blob(hex_)
                got = None if info is None else info.size
            used[hex_] = got
            if got != size:
                missing.append(digest)
        return missing

    def lacks_wanted(
        self, entry: Entry, prefer: Iterable[str] = DEFAULT_PREFER
    ) -> ListChild | None:
        """The child of a list that a pull by `prefer` wants and this store does not hold
        whole (its manifest, config and layers); None when it does, or for a plain tag."""
        child = entry.wanted_child(prefer)
        if child is None:
            return None
        for v in entry.variants:
            if v.manifest.digest == child.digest and not self.missing_blobs(v.manifest):
                return None
        return child

    def sorted_entries(self) -> list[Entry]:
        """Newest first, as `ollama list`; ties by name for a stable order."""
        return sorted(self.entries.values(), key=lambda e: (-e.modified_ns, e.name.shortest))


def ollama_entries(index: StoreIndex) -> list[Entry]:
    """The tags Ollama's /api/tags would list, newest first by whole seconds, as its
    sortListModelResponses (server/model_list_cache.go:865-870); ties by name.

    Ollama at ollama/ollama fb30760 reads only `manifests/` (manifest/manifest.go:175-227):
    for a tag that is a manifest list, the legacy anchor (the llamacpp child plus references
    to the list's blobs) is what it lists; every legacy spelling (`Foo` and `foo`) is a model
    of its own. A tag only in `manifests-v2/`, which it does not read, is listed after
    Ollama's manifest-list branch: by its preferred child.
    """
    legacy = [e for e in index if e.source == "legacy"] + index.hidden
    anchored = {e.name.key for e in index.hidden}
    v2_only = [e for e in index if e.source == "v2" and e.name.key not in anchored]
    return sorted(
        legacy + v2_only, key=lambda e: (-(e.modified_ns // 1_000_000_000), e.name.shortest)
    )


def listed_tag(index: StoreIndex, entry: Entry) -> Entry:
    """The tag a listed entry stands for: a list's legacy anchor stands for the list, whose
    digest is the ID every other command shows (store.tagid)."""
    if entry.source == "legacy":
        shown = index.entries.get(entry.name.key)
        if shown is not None and shown.source == "v2":
            return shown
    return entry
