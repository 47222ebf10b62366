"""How a store is read into a StoreIndex (store.index.found): every tag, what it points to,
and what is wrong (as Problems, data, never exceptions: see store.index.found); with a
ScanCache, only what changed since the last scan is read again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from itertools import chain
from pathlib import Path

from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest, forget_parsed, is_blob_name
from modelfs.store.disk.fileio import read_file, read_file_stat
from modelfs.store.disk.prefetch import HEAD, cached, prefetch
from modelfs.store.disk.tree import STRAY_DIRECTORY as STRAY_DIRECTORY
from modelfs.store.disk.tree import walk_manifest_tree as walk_manifest_tree
from modelfs.store.errors import (
    DamagedIndexError,
    InvalidDigestError,
    InvalidNameError,
    ManifestError,
    StoreError,
)
from modelfs.store.index.dirs import Listed, walk_tree_kept
from modelfs.store.index.found import (
    DEFAULT_PREFER,
    STRAY_KINDS,
    BlobInfo,
    Entry,
    Problem,
    StoreIndex,
    Variant,
    child_runner,
    child_variant,
    choose_variant,
    listed_tag,
    ollama_entries,
    rank_children,
    runner_rank,
)
from modelfs.store.index.indexfile import Stamp, dir_key, racy, stamp
from modelfs.store.index.indexfile import started as scan_started
from modelfs.store.index.scancache import DirListing, Listing, Parsed, Recipe
from modelfs.store.index.scancache import ScanCache as ScanCache
from modelfs.store.index.shape import INT, TEXT, TEXT_OR_NONE, tuples_of, types_in
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    ListChild,
    Manifest,
    ManifestList,
    infer_runner,
    parse_manifest,
)
from modelfs.store.names import Name, name_from_path_parts

# What a scan finds is defined beside the index (store.index.found); callers import it here.
__all__ = [
    "DEFAULT_PREFER",
    "STRAY_DIRECTORY",
    "STRAY_KINDS",
    "BlobInfo",
    "Entry",
    "Problem",
    "ScanCache",
    "Scanner",
    "StoreIndex",
    "Variant",
    "child_runner",
    "child_variant",
    "choose_variant",
    "listed_tag",
    "ollama_entries",
    "rank_children",
    "read_limited",
    "removed_tag",
    "runner_rank",
    "scan_store",
    "walk_manifest_tree",
]

log = logging.getLogger(__name__)

DirEntry = os.DirEntry[str] | Listed  # a tag file as the walk gives it
Item = tuple[tuple[str, ...], DirEntry | None, str]

_RUNNER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")


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
        self._recipes: dict[str, Recipe] = {}  # the cache's, while blobs/ is as it was
        self._made: dict[str, Recipe] = {}  # this scan's, for the next
        self._remade = 0  # recipes worked out afresh
        self._dirs: dict[str, DirListing] = {}
        self._blobs_dev = -1  # blobs/'s device when it is as the cache's listing has it

    def scan(self) -> StoreIndex:
        blob_paths = self._list_blobs()
        if self.cache is not None and self.index._sizes is not None:
            self._recipes = self.cache.entries
        trees = [
            (root, v2, self._walk(root))
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
                self._check_entry(entry)
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

    def _walk(self, root: Path) -> list[Item]:
        if self.cache is None:
            return list(walk_manifest_tree(root))
        return list(walk_tree_kept(root, self.cache.dirs, self._dirs, self._started))

    def _keep(self, cache: ScanCache) -> None:
        """Leave in `cache` what this scan met, and mark it for saving when that differs."""
        configs = {d: c for d, c in self.index._configs.items() if c is not None}
        if self._recipes:  # the configs of the entries recalled were not asked again
            configs = {**cache.configs, **configs}
        listing, used = self._listing, self.index._sizes_used
        if listing is not None and used.keys() != listing[3].keys():
            listing = (*listing[:3], used)
        dirs = self._dirs
        # Recipes hold only with the listing they were made under: none without one.
        made, remade = (self._made, self._remade) if listing is not None else ({}, 0)
        same = (
            not self._read
            and not remade
            and listing is cache.listing
            and len(self._met) == len(cache.manifests)
            and len(self._links) == len(cache.links)
            and len(self._blob_met) == len(cache.blob_manifests)
            and len(made) == len(cache.entries)
            and configs.keys() == cache.configs.keys()
            and len(dirs) == len(cache.dirs)
            and all(v is cache.dirs.get(k) for k, v in dirs.items())
        )
        cache.manifests, cache.links, cache.blob_manifests = self._met, self._links, self._blob_met
        cache.configs, cache.dirty = configs, cache.dirty or not same
        cache.entries, cache.dirs = made, dirs
        cache.keep_listing(listing)

    # -- blobs ---------------------------------------------------------------------------
    def _list_blobs(self) -> list[str]:
        """Note every blob name; the paths of the regular ones (none when taken from the cache)."""
        paths: list[str] = []
        dst = None  # if so, the listing says why
        with contextlib.suppress(OSError):
            dst = os.stat(self.layout.blobs)
        key = None if dst is None else dir_key(dst, self._started)  # as Listing says
        known = self.cache.listing if self.cache is not None else None
        if key is not None and known is not None and known[0] == key:
            assert dst is not None
            self._blobs_dev = dst.st_dev
            self._listing, self.index._sizes, self.index.blob_names = known, known[3], set(known[1])
            self.index._sizes_used = dict(known[3])  # the recalled entries' checks used them
            self.index.problems += [Problem(*p) for p in known[2]]
            return paths
        first = len(self.index.problems)
        self._list_blob_dir(paths)
        if self.cache is not None and key is not None:
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
    def _scan_tree(self, root: Path, items: list[Item], *, v2: bool) -> None:
        top = root.name
        entries = self.index.entries
        for parts, de, problem in items:
            if problem:
                rel = "/".join((top, *parts))
                self._problem("stray", rel, problem)
                continue
            assert de is not None
            try:
                name = name_from_path_parts(parts, v2=v2)
            except InvalidNameError:
                self._problem("stray", "/".join((top, *parts)), "not a valid model name")
                continue
            key = name.key
            shown = entries.get(key)
            if shown is not None and v2:
                self._problem("stray", "/".join((top, *parts)), f"duplicate of {shown.file}")
                continue
            try:
                entry = self._read_entry(name, de, v2=v2)
            except DamagedIndexError:
                raise  # not this tag's: scan_store starts again without the index
            except StoreError as exc:
                rel = "/".join((top, *parts))
                removed = removed_tag(self.layout, de.path) if v2 else None
                if removed is not None:
                    # The legacy file of the same name, if any (Ollama's re-pull), is the tag.
                    self._problem("removed-tag", rel, removed)
                else:
                    self._problem("bad-manifest", rel, str(exc).removeprefix(f"{rel}: "))
                continue
            except Exception as exc:
                rel = "/".join((top, *parts))
                # Whatever a hostile file does, it costs only its own entry, never the scan.
                log.exception("%s: unexpected error", rel)
                self._problem("bad-manifest", rel, f"unreadable ({type(exc).__name__}: {exc})")
                continue
            if shown is None:
                entries[key] = entry
                continue
            # v2 hides legacy for the same name (the legacy file is an anchor); two legacy
            # spellings of one name are one model here, two for Ollama.
            self.index.hidden.append(entry)
            if shown.source == "legacy":
                self._problem("stray", entry.rel, f"duplicate of {shown.file}")
            elif shown.anchor_mtime_ns is None or entry.mtime_ns > shown.anchor_mtime_ns:
                # Two legacy spellings of one anchor (Ollama lists both): the newer is its time.
                shown.anchor_mtime_ns = entry.mtime_ns

    def _read_entry(self, name: Name, de: DirEntry, *, v2: bool) -> Entry:
        # Strings in this loop: it runs once per tag, and Path arithmetic was a fifth of it.
        path = de.path
        rel = path[len(self._prefix) :]  # walk_manifest_tree's paths are below the root
        top, mtime_ns, hit = self._parsed_manifest_file(de, rel, v2=v2)
        recipe = self._recipes.get(path) if hit else None
        recalled = None
        if recipe is not None:
            try:
                recalled = self._recalled(top, rel, recipe)
            except DamagedIndexError:
                raise
            except Exception as exc:  # a recipe of a shape never written: work it out
                assert self.cache is not None
                self.cache.damaged(f"a tag's recipe ({type(exc).__name__})")
        if recalled is not None:
            variants, absent = recalled
            self._made[path] = recipe  # type: ignore[assignment]  # not None with recalled
        else:
            variants, absent = self._worked_out(top, rel, path)
        return Entry(name, "v2" if v2 else "legacy", path, rel, top, mtime_ns, variants, absent)

    def _worked_out(
        self, top: Parsed, rel: str, path: str
    ) -> tuple[tuple[Variant, ...], tuple[ListChild, ...]]:
        """A tag's variants and absent children, read; a recipe of them for the next scan."""
        first, unread = len(self.index.problems), self.index._unread_configs
        if isinstance(top, ManifestList):
            variants, absent, spec, absent_at = self._resolve_list(top, rel)
        else:
            config = self.index.config(top)
            runner = infer_runner(top, config)
            fmt = top.format or (config.model_format if config else None) or None
            variants, absent = (Variant(top, runner, fmt, False),), ()
            spec, absent_at = ((None, runner, fmt),), ()
        if spec is not None and self.cache is not None and self.index._unread_configs == unread:
            found = tuple((p.kind, p.message) for p in self.index.problems[first:])
            self._made[path] = (spec, absent_at, found, None)
            self._remade += 1
        return variants, absent

    def _recalled(
        self, top: Parsed, rel: str, recipe: Recipe
    ) -> tuple[tuple[Variant, ...], tuple[ListChild, ...]] | None:
        """A tag's variants and absent children as its recipe has them (scancache.Recipe),
        touching no manifest: their layers and digests are built when someone asks. None
        when the recipe does not fit the manifest; raises when it is not of a recipe's shape
        (and then has done nothing)."""
        spec, absent_at, problems, missing = recipe
        # What the recipe hands on as it is is checked here (in this per-tag loop, only what
        # is there); anything else wrong in it raises below, before anything is done.
        if missing is not None and (
            type(missing) is not tuple or (missing and not types_in(missing, TEXT))
        ):
            raise TypeError("a recipe's messages")
        if problems and not types_in(chain.from_iterable(tuples_of(problems, 2)), TEXT):
            raise TypeError("a recipe's problems")
        absent: tuple[ListChild, ...] = ()
        met: list[tuple[str, tuple[Stamp, Parsed]]] = []
        if isinstance(top, ManifestList):
            assert self.cache is not None
            known, variants = self.cache.blob_manifests, []
            for blob, runner, fmt in spec:
                hit = None if blob is None else known.get(blob)
                if hit is None or not isinstance(hit[1], Manifest):
                    return None
                if type(runner) not in TEXT_OR_NONE or type(fmt) not in TEXT_OR_NONE:
                    raise TypeError("a recipe's runner")
                met.append((blob, hit))  # type: ignore[arg-type]  # not None with a hit
                variants.append(Variant(hit[1], runner, fmt, True))
            if absent_at:
                if not types_in(absent_at, INT) or min(absent_at) < 0:
                    raise TypeError("a recipe's absent children")
                absent = tuple(top.children[i] for i in absent_at)
            made = tuple(variants)
        elif len(spec) == 1 and spec[0][0] is None:
            _, runner, fmt = spec[0]
            if not ((runner is None or type(runner) is str) and (fmt is None or type(fmt) is str)):
                raise TypeError("a recipe's runner")
            made = (Variant(top, runner, fmt, False),)
        else:
            return None
        if met:
            self._blob_met.update(met)
        for kind, message in problems:
            self._problem(kind, rel, message)
        return made, absent

    def _parsed_manifest_file(
        self, de: DirEntry, rel: str, *, v2: bool
    ) -> tuple[Manifest | ManifestList, int, bool]:
        """A tag file's manifest and mtime, from the cache when the file is as it was (and
        then True)."""
        path = de.path
        lst = None
        if self.cache is not None:
            try:  # not contextlib.suppress: no context manager in this per-tag loop
                lst = os.lstat(path)
            except OSError:
                lst = None  # _read_manifest_file says why
            if lst is not None and stat.S_ISREG(lst.st_mode):
                known = self.cache.manifests.get(path)
                if known is not None and known[0] == (
                    lst.st_ino,
                    lst.st_size,
                    lst.st_mtime_ns,
                    lst.st_ctime_ns,
                ):
                    self._met[path] = known
                    return known[1], lst.st_mtime_ns, True
            elif lst is not None and v2 and stat.S_ISLNK(lst.st_mode):
                hit = self._cached_link(de, lst)
                if hit is not None:
                    return (*hit, True)
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
        return top, st.st_mtime_ns, False

    def _cached_link(
        self, de: DirEntry, lst: os.stat_result
    ) -> tuple[Manifest | ManifestList, int] | None:
        """A `manifests-v2/` link's manifest from the cache: the link as it was, on the blob
        file it was on (_read_manifest_file's checks, less the hash)."""
        assert self.cache is not None
        known = self.cache.links.get(de.path)
        if known is None or known[0] != stamp(lst) or known[1] not in self.index.blob_names:
            return None
        try:
            st = de.stat()
        except OSError:
            return None
        blob = self.cache.blob_manifests.get(known[1])
        if (
            blob is not None
            and st.st_dev == self._blobs_dev
            and blob[0] == stamp(st)
            and stat.S_ISREG(st.st_mode)
        ):
            # blobs/ as the last scan left it, which found this file (inode, ctime) at that
            # name: the name is still this file's (only a rename or unlink there moves it).
            self._blob_met[known[1]] = blob
            self._links[de.path] = known
            return blob[1], st.st_mtime_ns
        hit = self._cached_blob_manifest(known[1])
        if hit is None:
            return None
        bst, top = hit
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
        self, de: DirEntry, rel: str, *, v2: bool
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
    ) -> tuple[
        tuple[Variant, ...],
        tuple[ListChild, ...],
        tuple[tuple[str | None, str | None, str | None], ...] | None,
        tuple[int, ...],
    ]:
        """The variants and absent children of a list; and as a recipe has them (none
        when a child is inline: the recipe names each child's manifest by its blob)."""
        variants: list[Variant] = []
        absent: list[ListChild] = []
        spec: list[tuple[str | None, str | None, str | None]] | None = []
        absent_at: list[int] = []
        for i, child in enumerate(top.children):
            if child.inline is not None:
                manifest: Manifest | ManifestList | StoreError = child.inline
                spec = None
            else:
                manifest = self._manifest_blob(child.digest)
            if isinstance(manifest, ManifestList):
                # One from the index is built first: a kind its data does not hold raises
                # (store.index.lazy), and the scan starts again without the index.
                _ = manifest.children
                self._problem("bad-manifest", rel, f"child {child.digest} is itself a list")
                continue
            if isinstance(manifest, StoreError):
                # A pull fetches only the chosen child, so an absent child is normal; a present
                # but broken one is not.
                if self.index.has_blob(child.digest):
                    self._problem("bad-manifest", rel, f"child {child.digest}: {manifest}")
                absent.append(child)
                absent_at.append(i)
                continue
            if child.runner is not None and _RUNNER.fullmatch(child.runner) is None:
                # A runner becomes part of a directory name (`26b@mlx`).
                self._problem("bad-manifest", rel, f"child {child.digest}: bad runner name")
                continue
            variant = child_variant(child, manifest, self.index.config(manifest))
            variants.append(variant)
            if spec is not None:
                spec.append((child.digest.blob_name, variant.runner, variant.format))
        return (
            tuple(variants),
            tuple(absent),
            spec if spec is None else tuple(spec),
            tuple(absent_at),
        )

    def _check_entry(self, entry: Entry) -> None:
        """The missing-blob problems of a shown tag, from its recipe when it has them."""
        made = self._made.get(entry.file)
        found = None if made is None else made[3]
        if found is None:
            found = tuple(
                f"blob {digest} {self._lack(digest)}"
                for variant in entry.variants
                for digest in self.index.missing_blobs(variant.manifest)
            )
            if made is not None:
                self._made[entry.file] = (*made[:3], found)
                self._remade += 1
        for message in found:
            self._problem("missing-blob", entry.rel, message)

    def _lack(self, digest: Digest) -> str:
        info = self.index.blob_info(digest)
        return "missing" if info is None else f"wrong size ({info.size} bytes)"

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
        try:
            index = Scanner(layout, cache).scan()
        except DamagedIndexError:
            if cache is None:
                raise
            cache.drop("a manifest not of its file's kind")  # a full scan, saved below
            index = Scanner(layout, cache).scan()
    if cache is not None:
        cache.save()
    return index
