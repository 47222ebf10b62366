"""A read-only snapshot of a store: every tag, what it points to, and what is wrong.

Problems (stray files, broken manifests, missing or misnamed blobs) are data, never
exceptions: one bad file must not hide the rest of the store, and must not be deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest, forget_parsed, is_blob_name
from modelfs.store.disk.fileio import read_file, read_file_stat
from modelfs.store.disk.prefetch import HEAD, cached, prefetch
from modelfs.store.disk.tree import STRAY_DIRECTORY as STRAY_DIRECTORY
from modelfs.store.disk.tree import TreeItem
from modelfs.store.disk.tree import walk_manifest_tree as walk_manifest_tree
from modelfs.store.errors import (
    InvalidDigestError,
    InvalidNameError,
    ManifestError,
    ModelNotFoundError,
    StoreError,
)
from modelfs.store.index.indexfile import Stamp, racy, stamp
from modelfs.store.index.indexfile import started as scan_started
from modelfs.store.index.scancache import Listing, Parsed
from modelfs.store.index.scancache import ScanCache as ScanCache
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    ListChild,
    Manifest,
    ManifestList,
    ModelConfig,
    infer_runner,
    parse_config,
    parse_manifest,
)
from modelfs.store.names import Name, name_from_path_parts, parse_name
from modelfs.store.tagid import TagId, tag_ids

log = logging.getLogger(__name__)

DEFAULT_PREFER: tuple[str, ...] = ("llamacpp", "ggml", "mlx")
_RUNNER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")


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
    # this index's checks used, for the next.
    _sizes: dict[str, int | None] | None = field(default=None, repr=False)
    _sizes_used: dict[str, int | None] = field(default_factory=dict, repr=False)
    cache: ScanCache | None = field(default=None, repr=False)

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
        return self._configs[digest]

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


def read_limited(path: Path | str, limit: int) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path` (store.fileio's rule)."""
    return read_file(path, limit)


def removed_tag(layout: Layout, path: str | os.PathLike[str]) -> str | None:
    """Why a `manifests-v2/` link stands for a removed tag, or None when it does not.

    `ollama rm` (ollama/ollama fb30760 server/routes.go:1287-1297, manifest/manifest.go:61-110)
    deletes the legacy file and every blob no legacy manifest names, the list blob a v2 link
    points at included, and leaves the link: a link to a blob that is gone is a tag removed,
    not a manifest half-written. One whose blob is in `.modelfs/trash/` is not: that blob was
    taken by our GC and is put back when a tag wants it.
    """
    try:
        link = os.readlink(path)
    except OSError:
        return None
    blob = os.path.basename(link)
    if not is_blob_name(blob) or os.path.lexists(os.path.join(layout.blobs, blob)):
        return None
    try:
        with os.scandir(layout.trash) as stamps:
            if any(os.path.lexists(os.path.join(s.path, blob)) for s in stamps):
                return None
    except FileNotFoundError:
        pass
    except OSError:
        return None  # the trash cannot be looked at: not known to be removed
    return f"removed tag: its manifest blob {blob} is gone (as `ollama rm` leaves the link)"


class Scanner:
    """Builds a StoreIndex. Reads manifests only; blobs are listed, not hashed, except the
    manifest blobs a v2 tag or a list points at, which must hash to their names."""

    def __init__(self, layout: Layout, cache: ScanCache | None = None) -> None:
        self.layout = layout
        self.index = StoreIndex(layout, cache=cache)
        self.cache = cache
        # What this scan met, of the cache's kinds: the cache it leaves for the next.
        self._met: dict[str, tuple[Stamp, Parsed]] = {}
        self._links: dict[str, tuple[Stamp, str]] = {}
        self._blob_met: dict[str, tuple[Stamp, Parsed]] = {}
        self._listing: Listing | None = None
        self._read = 0  # files read, parsed and kept for the cache: it differs from the last
        self._started = scan_started()
        self._prefix = str(layout.root).rstrip("/") + "/"
        self._manifest_blobs: dict[Digest, Manifest | ManifestList | StoreError] = {}

    def scan(self) -> StoreIndex:
        blob_paths = self._list_blobs()
        trees = [
            (root, v2, list(walk_manifest_tree(root)))
            for root, v2 in ((self.layout.manifests_v2, True), (self.layout.manifests, False))
        ]
        # The first scan of a long-lived view (a mount, a server) reads everything and waits on
        # the disk; a rescan finds it in memory, and a command's one scan reads less.
        if self.cache is not None and not self.cache.manifests:
            tag_paths = [
                de.path
                for _, _, items in trees
                for _, de, problem in items
                if de is not None and not problem and de.is_file(follow_symlinks=False)
            ]
            if not (cached(tag_paths) and cached(blob_paths)):
                prefetch(tag_paths)
                prefetch(blob_paths, HEAD)
        with contextlib.suppress(OSError):  # without it, blobs go by path (and are missing)
            self.index._blobs_fd = os.open(
                self.layout.blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            )
        try:
            for root, v2, items in trees:
                self._scan_tree(root, items, v2=v2)
            for entry in self.index.entries.values():
                for variant in entry.variants:
                    self._check_blobs(entry, variant)
        finally:
            if self.index._blobs_fd is not None:
                os.close(self.index._blobs_fd)
                self.index._blobs_fd = None
        if self.cache is not None:
            self._keep(self.cache)
            # Its next scan parses only the tag files that changed; the memo would meanwhile
            # keep the digests of every manifest replaced since the view began.
            forget_parsed()
        return self.index

    def _keep(self, cache: ScanCache) -> None:
        """Leave in `cache` what this scan met, and mark it for saving when that differs."""
        configs = {d: c for d, c in self.index._configs.items() if c is not None}
        listing, used = self._listing, self.index._sizes_used
        if listing is not None and used.keys() != listing[3].keys():
            listing = (*listing[:3], used)
        same = (
            not self._read
            and listing is cache.listing
            and len(self._met) == len(cache.manifests)
            and len(self._links) == len(cache.links)
            and len(self._blob_met) == len(cache.blob_manifests)
            and configs.keys() == cache.configs.keys()
        )
        cache.manifests, cache.links, cache.blob_manifests = self._met, self._links, self._blob_met
        cache.configs, cache.dirty = configs, cache.dirty or not same
        cache.keep_listing(listing)

    # -- blobs ---------------------------------------------------------------------------
    def _list_blobs(self) -> list[str]:
        """Note every blob name; the paths of the regular ones (none when taken from the cache)."""
        paths: list[str] = []
        dst = None  # if so, the listing says why
        with contextlib.suppress(OSError):
            dst = os.stat(self.layout.blobs)
        key = None if dst is None else (dst.st_ino, dst.st_mtime_ns)  # as Listing says
        known = self.cache.listing if self.cache is not None else None
        if known is not None and known[0] == key:
            self._listing, self.index._sizes, self.index.blob_names = known, known[3], set(known[1])
            self.index.problems += [Problem(*p) for p in known[2]]
            return paths
        first = len(self.index.problems)
        self._list_blob_dir(paths)
        fresh = dst is not None and not racy(max(dst.st_mtime_ns, dst.st_ctime_ns), self._started)
        if self.cache is not None and key is not None and fresh:
            found = tuple((p.kind, p.path, p.message) for p in self.index.problems[first:])
            self._listing = (key, frozenset(self.index.blob_names), found, {})
        return paths

    def _list_blob_dir(self, paths: list[str]) -> None:
        try:
            it = os.scandir(self.layout.blobs)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._problem("bad-blob", "blobs", f"cannot list: {exc.strerror}")
            return
        with it:
            for de in it:
                if is_blob_name(de.name):
                    if de.is_symlink() or not de.is_file(follow_symlinks=False):
                        # A blob that is a link could point anywhere (/etc/passwd); never serve it.
                        self._problem("bad-blob", f"blobs/{de.name}", "not a regular file")
                    else:
                        self.index.blob_names.add(de.name)
                        paths.append(de.path)
                elif de.name.startswith("sha256:"):
                    self._problem(
                        "foreign-blob",
                        f"blobs/{de.name}",
                        "named with ':' (copied from another OS); rename it to sha256-…",
                    )
                elif de.name.startswith("sha256-") and _is_upper_blob(de.name):
                    self._problem("foreign-blob", f"blobs/{de.name}", "uppercase hex in name")
                else:
                    # Ollama's own partials and temp files live here too; they are not ours to
                    # judge, but a user asking "what is this 40 GB file" deserves a line.
                    self._problem("stray", f"blobs/{de.name}", "not a blob name")

    # -- manifests -----------------------------------------------------------------------
    def _scan_tree(self, root: Path, items: list[TreeItem], *, v2: bool) -> None:
        top = root.name
        for parts, de, problem in items:
            rel = "/".join((top, *parts))
            if problem:
                self._problem("stray", rel, problem)
                continue
            assert de is not None
            try:
                name = name_from_path_parts(parts, v2=v2)
            except InvalidNameError:
                self._problem("stray", rel, "not a valid model name")
                continue
            key = name.key
            shown = self.index.entries.get(key)
            if shown is not None and v2:
                self._problem("stray", rel, f"duplicate of {shown.file}")
                continue
            try:
                entry = self._read_entry(name, de, v2=v2)
            except StoreError as exc:
                removed = removed_tag(self.layout, de.path) if v2 else None
                if removed is not None:
                    # The legacy file of the same name, if any (Ollama's re-pull), is the tag.
                    self._problem("removed-tag", rel, removed)
                else:
                    self._problem("bad-manifest", rel, str(exc).removeprefix(f"{rel}: "))
                continue
            except Exception as exc:
                # Whatever a hostile file does, it costs only its own entry, never the scan.
                log.exception("%s: unexpected error", rel)
                self._problem("bad-manifest", rel, f"unreadable ({type(exc).__name__}: {exc})")
                continue
            if shown is None:
                self.index.entries[key] = entry
                continue
            # v2 hides legacy for the same name (the legacy file is an anchor); two legacy
            # spellings of one name are one model here, two for Ollama.
            self.index.hidden.append(entry)
            if shown.source == "legacy":
                self._problem("stray", rel, f"duplicate of {shown.file}")
            elif shown.anchor_mtime_ns is None or entry.mtime_ns > shown.anchor_mtime_ns:
                # Two legacy spellings of one anchor (Ollama lists both): the newer is its time.
                shown.anchor_mtime_ns = entry.mtime_ns

    def _read_entry(self, name: Name, de: os.DirEntry[str], *, v2: bool) -> Entry:
        # Strings in this loop: it runs once per tag, and Path arithmetic was a fifth of it.
        path = de.path
        rel = path[len(self._prefix) :]  # walk_manifest_tree's paths are below the root
        top, mtime_ns = self._parsed_manifest_file(de, rel, v2=v2)
        if isinstance(top, ManifestList):
            variants, absent = self._resolve_list(top, rel)
        else:
            config = self.index.config(top)
            runner = infer_runner(top, config)
            fmt = top.format or (config.model_format if config else None) or None
            variants, absent = (Variant(top, runner, fmt, False),), ()
        return Entry(
            name=name,
            source="v2" if v2 else "legacy",
            file=path,
            rel=rel,
            top=top,
            mtime_ns=mtime_ns,
            variants=variants,
            absent_children=absent,
        )

    def _parsed_manifest_file(
        self, de: os.DirEntry[str], rel: str, *, v2: bool
    ) -> tuple[Manifest | ManifestList, int]:
        """A tag file's manifest and mtime, from the cache when the file is as it was."""
        path = de.path
        lst = None
        if self.cache is not None:
            with contextlib.suppress(OSError):  # if so, _read_manifest_file says why
                lst = os.lstat(path)
            if lst is not None and stat.S_ISREG(lst.st_mode):
                known = self.cache.manifests.get(path)
                if known is not None and known[0] == stamp(lst):
                    self._met[path] = known
                    return known[1], lst.st_mtime_ns
            elif lst is not None and v2 and stat.S_ISLNK(lst.st_mode):
                hit = self._cached_link(de, lst)
                if hit is not None:
                    return hit
        raw, st, blob_name = self._read_manifest_file(de, rel, v2=v2)
        top = parse_manifest(raw, rel)
        if lst is not None and not racy(st.st_ctime_ns, self._started):
            if blob_name is None:
                if stat.S_ISREG(lst.st_mode):  # a legacy link is read, not kept
                    self._met[path] = (stamp(st), top)
                    self._read += 1
            elif stat.S_ISLNK(lst.st_mode) and not racy(lst.st_ctime_ns, self._started):
                # lstat before readlink: a link replaced meanwhile has another stamp now.
                self._links[path] = (stamp(lst), blob_name)
                self._blob_met[blob_name] = (stamp(st), top)
                self._read += 1
        return top, st.st_mtime_ns

    def _cached_link(
        self, de: os.DirEntry[str], lst: os.stat_result
    ) -> tuple[Manifest | ManifestList, int] | None:
        """A `manifests-v2/` link's manifest from the cache: the link as it was, on the blob
        file it was on (_read_manifest_file's checks, less the hash)."""
        assert self.cache is not None
        known = self.cache.links.get(de.path)
        if known is None or known[0] != stamp(lst) or known[1] not in self.index.blob_names:
            return None
        hit = self._cached_blob_manifest(known[1])
        if hit is None:
            return None
        bst, top = hit
        try:
            st = de.stat()
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != (bst.st_dev, bst.st_ino):
            return None
        self._links[de.path] = known
        return top, bst.st_mtime_ns

    def _cached_blob_manifest(
        self, name: str
    ) -> tuple[os.stat_result, Manifest | ManifestList] | None:
        """A manifest blob's parse from the cache, when the blob is the file it was read from."""
        assert self.cache is not None
        known = self.cache.blob_manifests.get(name)
        if known is None:
            return None
        path, fd = self.index._blob(name)
        try:
            bst = os.stat(path, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(bst.st_mode) or stamp(bst) != known[0]:
            return None
        self._blob_met[name] = known
        return bst, known[1]

    def _read_manifest_file(
        self, de: os.DirEntry[str], rel: str, *, v2: bool
    ) -> tuple[bytes, os.stat_result, str | None]:
        """Read a tag file by store.fileio's rule (a regular file, or refused by its kind). A
        `manifests-v2/` link must land on a blob whose bytes hash to its name; a legacy file
        that is a link is followed, as Ollama's os.Open does (ollama/ollama fb30760
        manifest/manifest.go:189,125)."""
        path = de.path
        try:
            if not (v2 and de.is_symlink()):
                # Not followed under manifests-v2/: a link there is judged below, and a
                # file that became one since the listing is refused (ELOOP).
                return (*read_file_stat(path, MAX_MANIFEST_BYTES, follow=not v2), None)
            # The link must land on blobs/<its own name>: the same file as that blob, which
            # the blob listing already knows to be a regular file inside the store.
            link = os.readlink(path)
            blob_name = os.path.basename(link)
            outside = ManifestError(f"{rel}: link points outside blobs/ ({link})")
            if not is_blob_name(blob_name):
                raise outside
            if blob_name not in self.index.blob_names:
                if os.path.lexists(os.path.join(self.layout.blobs, blob_name)):
                    raise outside  # present, but not a regular file
                raise ManifestError(f"{rel}: manifest blob {blob_name} is missing")
            # The blob is opened by its own name, not through the link, and must be the
            # file the link reaches (the walk's stat of it, which the DirEntry keeps).
            blob, fd = self.index._blob(blob_name)
            raw, bst = read_file_stat(blob, MAX_MANIFEST_BYTES, follow=False, dir_fd=fd)
            st = de.stat()
            if (st.st_dev, st.st_ino) != (bst.st_dev, bst.st_ino):
                raise outside
            if hashlib.sha256(raw).hexdigest() != blob_name[7:]:
                raise ManifestError(f"{rel}: linked blob {blob_name} does not match its hash")
            return raw, bst, blob_name
        except OSError as exc:
            raise ManifestError(f"{rel}: {exc.strerror or exc}") from None

    def _manifest_blob(self, digest: Digest) -> Manifest | ManifestList | StoreError:
        """A manifest stored as a blob, verified against its name; errors are cached too."""
        if digest in self._manifest_blobs:
            return self._manifest_blobs[digest]
        rel = f"blobs/{digest.blob_name}"
        result: Manifest | ManifestList | StoreError
        known = None
        if self.cache is not None and self.index.has_blob(digest):
            known = self.cache.blob_manifests.get(digest.blob_name)
            if known is not None and self.index._sizes is None:
                hit = self._cached_blob_manifest(digest.blob_name)
                known = None if hit is None else (known[0], hit[1])
        if known is not None:
            # With blobs/ as it was, so are the bytes under this name (as for sizes); a v2
            # tag's blob is still looked at (_cached_link), for its mtime.
            self._blob_met[digest.blob_name] = known
            result = known[1]
        elif not self.index.has_blob(digest):
            result = ManifestError(f"{rel}: missing")
        else:
            try:
                path, fd = self.index._blob(digest.blob_name)
                # Not followed: the listing took it for a regular file.
                raw, st = read_file_stat(path, MAX_MANIFEST_BYTES, follow=False, dir_fd=fd)
                if hashlib.sha256(raw).hexdigest() != digest.hex:
                    result = ManifestError(f"{rel}: bytes do not match the name")
                else:
                    result = parse_manifest(raw, rel)
                    if self.cache is not None and not racy(st.st_ctime_ns, self._started):
                        self._blob_met[digest.blob_name] = (stamp(st), result)
                        self._read += 1
            except OSError as exc:
                result = ManifestError(f"{rel}: {exc.strerror}")
            except StoreError as exc:
                result = exc
        self._manifest_blobs[digest] = result
        return result

    def _resolve_list(
        self, top: ManifestList, rel: str
    ) -> tuple[tuple[Variant, ...], tuple[ListChild, ...]]:
        variants: list[Variant] = []
        absent: list[ListChild] = []
        for child in top.children:
            if child.inline is not None:
                manifest: Manifest | ManifestList | StoreError = child.inline
            else:
                manifest = self._manifest_blob(child.digest)
            if isinstance(manifest, ManifestList):
                self._problem("bad-manifest", rel, f"child {child.digest} is itself a list")
                continue
            if isinstance(manifest, StoreError):
                # A pull fetches only the chosen child, so an absent child is normal; a present
                # but broken one is not.
                if self.index.has_blob(child.digest):
                    self._problem("bad-manifest", rel, f"child {child.digest}: {manifest}")
                absent.append(child)
                continue
            if child.runner is not None and _RUNNER.fullmatch(child.runner) is None:
                # A runner becomes part of a directory name (`26b@mlx`).
                self._problem("bad-manifest", rel, f"child {child.digest}: bad runner name")
                continue
            variants.append(child_variant(child, manifest, self.index.config(manifest)))
        return tuple(variants), tuple(absent)

    def _check_blobs(self, entry: Entry, variant: Variant) -> None:
        for digest in self.index.missing_blobs(variant.manifest):
            info = self.index.blob_info(digest)
            what = "missing" if info is None else f"wrong size ({info.size} bytes)"
            self._problem("missing-blob", entry.rel, f"blob {digest} {what}")

    def _problem(self, kind: str, path: str, message: str) -> None:
        self.index.problems.append(Problem(kind, path, message))


def _is_upper_blob(name: str) -> bool:
    try:
        Digest.parse(name)
    except InvalidDigestError:
        return False
    return True


def scan_store(root: str | os.PathLike[str] | Layout, cache: ScanCache | None = None) -> StoreIndex:
    layout = root if isinstance(root, Layout) else Layout(root)
    with cycles_uncollected():
        index = Scanner(layout, cache).scan()
    if cache is not None:
        cache.save()
    return index
