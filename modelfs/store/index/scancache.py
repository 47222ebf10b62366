"""What one scan parsed, for the next scan of the same store: in memory for a long-lived view
(a mount's rescans, a server's rebuilds), and on disk under `.modelfs/scan-index` for every
command, so `modelfs ls` re-reads what changed, not 5,000 tag files.

Nothing here is trusted blindly; each item is used only while what it was read from is as it
was, looked at afresh by every scan:

- a tag file (a regular file under `manifests/` or `manifests-v2/`) by its path and stamp,
  (inode, size, mtime_ns, ctime_ns): Ollama rewrites a manifest in place (os.Create and
  os.WriteFile truncate the same inode: ollama/ollama fb30760 manifest/manifest.go:159,
  server/images.go:1107), so the same size and mtime can come back, but the ctime moves;
- a `manifests-v2/` link by its own stamp (a link is never changed in place: a new one is a new
  inode and ctime) and the stamp of the blob it lands on, which the scan stats anyway;
- the listing of `blobs/`, the sizes of the blobs the scan checked, and the list children's
  manifests, by that directory's (inode, mtime_ns, ctime_ns): a name appears or goes, and a
  blob's bytes change, only by a create, rename or unlink in it (Ollama writes a blob under a
  temp name and renames it: manifest/layer.go:32,58, server/download.go:326; so do we), each of
  which moves its mtime and ctime (a restore by `rsync -a` or `tar -x` puts the mtime back,
  never the ctime). A blob truncated or edited in place by hand is `verify`'s to find.
  Blob mtimes are never taken from here (`touchLayer` changes them in place): `blob_info`
  looks each time, and a v2 tag's manifest blob, whose mtime is the tag's, is stat'ed too;
  when `blobs/` changed, a child's manifest is used while its blob's stamp is as it was;
- a config by its digest, while its blob is listed (as before this file existed);
- what the scan worked out of each tag beyond its manifest (its variants' runners and
  formats, absent children, problems, missing blobs: `Recipe`), by the tag file's path, used
  when the tag's manifest came from the index and with the listing of `blobs/` as it was (all
  it depends on: which blobs are present, their sizes, configs, children's manifests);
- each directory of the manifests trees, by its (inode, mtime_ns, ctime_ns): its entries
  and what each is (store.index.dirs), so the walk stats a directory instead of listing it.

Manifests come back unbuilt (store.index.lazy): a warm scan touches none of their layers.

What changed within indexfile.RACY_NS of the scan that read it is not kept (a stamp is only as
fine as the filesystem's clock). The file, how it is trusted, written and rebuilt: indexfile.
It is saved only when the scan found something changed.

A file of the right checksum whose data is not of the shape written here (store.index.shape) is
refused at the load for what the load reads (the listing, links, configs, directories), as a
corrupt one is. What is built only when used (a manifest, a recipe, a fact) is checked there;
found wrong, it is read afresh as if the index had not held it (a manifest from its tag file or
blob: store.index.lazy), the file is removed, with one log line, and the next save writes it
whole again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import marshal
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeVar

from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.disk.fileio import read_file
from modelfs.store.errors import DamagedIndexError, ManifestError, StoreError
from modelfs.store.index.indexfile import Stamp, read_index, write_index
from modelfs.store.index.lazy import Tables, digest_of_hex
from modelfs.store.index.shape import (
    INT_OR_NONE,
    TEXT,
    check,
    columns,
    nested_texts,
    texts,
    tuples_of,
    types_in,
)
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    Layer,
    Manifest,
    ManifestList,
    ModelConfig,
    parse_manifest,
)

log = logging.getLogger(__name__)

Parsed = Manifest | ManifestList
# blobs/'s (inode, mtime_ns, ctime_ns) -> the blob names listed, (kind, path, message) of each
# problem the listing found, and the sizes of the blobs the scan's checks looked at, by hex. Not
# st_dev: hosts sharing a store on NFS number it each their own way, and would rewrite it in turn.
Listing = tuple[
    tuple[int, int, int],
    frozenset[str],
    tuple[tuple[str, str, str], ...],
    dict[str, int | None],
]

# What a scan worked out of a tag beyond its manifest, by the tag file's path: each variant as
# (the child's manifest blob name, None for the tag's own manifest; runner; format), the
# indexes of the list's children absent, (kind, message) of each problem found on the way,
# and the missing-blob messages of its variants (None until asked: a hidden anchor's never
# are). It depends on the tag's manifest, used only when that came from the index too, and on
# blobs/ (which blobs are present, their sizes, configs, children), so it is kept with the
# listing and used only while that is as it was.
Recipe = tuple[
    tuple[tuple[str | None, str | None, str | None], ...],
    tuple[int, ...],
    tuple[tuple[str, str], ...],
    tuple[str, ...] | None,
]
# A directory of a manifests tree, by its path: its (inode, mtime_ns, ctime_ns), and its
# entries' names, sorted, with a letter each for its kind (store.index.dirs).
DirListing = tuple[tuple[int, int, int], tuple[str, ...], str]

# Bumped when the file's shape changes, and when what a scan works out of a tag (Recipe) does:
# an index of another version is rebuilt, never read.
FORMAT_VERSION = 3
MAGIC = b"modelfs scan index\n"
FILE_NAME = "scan-index"
T = TypeVar("T")


@dataclass(slots=True, weakref_slot=True)  # weakly held by its load's tables: _Recovery
class ScanCache:
    """See the module's text. `path`: where it persists; None keeps it in memory only."""

    manifests: dict[str, tuple[Stamp, Parsed]] = field(default_factory=dict)
    links: dict[str, tuple[Stamp, str]] = field(default_factory=dict)  # -> its blob's name
    blob_manifests: dict[str, tuple[Stamp, Parsed]] = field(default_factory=dict)  # by name
    configs: dict[Digest, ModelConfig] = field(default_factory=dict)
    listing: Listing | None = None
    # What a command worked out from a blob's bytes (`ls`: a GGUF header's summary, a
    # template's fields), by kind and hex: held to the listing, as sizes are.
    facts: dict[str, Any] = field(default_factory=dict)
    facts_checked: set[str] = field(default_factory=set)  # found of the shape `fact` wants
    entries: dict[str, Recipe] = field(default_factory=dict)  # held to the listing
    dirs: dict[str, DirListing] = field(default_factory=dict)
    path: Path | None = None
    root: str = ""
    dirty: bool = False  # differs from what `path` holds
    damage: str | None = None  # why the file loaded was found, at a use, not of its shape
    loaded: int | None = None  # the inode of the file loaded, until it is replaced

    @classmethod
    def open(cls, layout: Layout) -> ScanCache:
        """The store's saved index, or an empty one that the next scan fills and saves."""
        path = layout.state / FILE_NAME
        root = str(layout.root)
        cache = cls(path=path, root=root)
        with cycles_uncollected():  # a load makes some 50,000 objects that all live on
            why = _load(cache, path, root)
        if why is not None:
            log.info("scan index %s: %s; a full scan rebuilds it", path, why)
            cache = cls(path=path, root=root, dirty=True)
        return cache

    def keep_listing(self, listing: Listing | None) -> None:
        """Take the listing a scan used; the facts go with the one they were read under."""
        if listing is None or self.listing is None or listing[0] != self.listing[0]:
            self.facts, self.facts_checked = {}, set()
        if listing is None:
            self.entries = {}
        self.listing = listing

    def fact(
        self, kind: str, hex_: str, compute: Callable[[], T | None], valid: Callable[[Any], bool]
    ) -> T | None:
        """`compute()`'s answer about the blob `hex_`, from the index while blobs/ is as the
        last scan listed it; an answer of None (the blob unreadable) is not kept. `valid`:
        whether a kept answer is of the shape `compute` gives (else the index is damaged)."""
        if self.listing is None:
            return compute()
        key = kind + hex_
        if key in self.facts:
            known: T = self.facts[key]
            # Checked once: `ls` asks for a family's template once for each of its models.
            if key in self.facts_checked:
                return known
            if valid(known):
                self.facts_checked.add(key)
                return known
            self.damaged(f"a fact ({kind.rstrip(':')})")
        value = compute()
        if value is not None:
            self.facts[key] = value
            self.dirty = True
        return value

    def save(self) -> None:
        """Write the index when it changed and has a place; never fails a scan."""
        if self.path is None or not self.dirty:
            return
        try:
            _save(self, self.path)
        except OSError as exc:
            # A read-only store, or someone else's: scans there just read everything.
            log.debug("scan index %s not saved: %s", self.path, exc.strerror or exc)
            return
        except StoreError as exc:
            # A manifest of a damaged file, read afresh to be written, that is gone since the
            # scan: the file stays removed, and the next scan reads everything.
            log.debug("scan index %s not saved: %s", self.path, exc)
            return
        self.dirty, self.damage, self.loaded = False, None, None

    def damaged(self, what: str) -> None:
        """`what` the file held, found at its use, is not of the shape written here: said
        once; the file is removed, so that no other command loads it, and the next save
        writes it whole (each manifest then built is read afresh where its data is wrong)."""
        self.dirty = True
        if self.damage is not None:
            return
        self.damage = what
        log.info("scan index %s: corrupt (%s); a full scan rebuilds it", self.path, what)
        # Only the file it came from: not one another command has written since.
        with contextlib.suppress(OSError):
            if self.path is not None and os.stat(self.path).st_ino == self.loaded:
                os.unlink(self.path)
        self.loaded = None

    def drop(self, why: str) -> None:
        """Forget all the file held (a scan then reads everything); see `damaged`."""
        self.damaged(why)
        self.manifests, self.links, self.blob_manifests, self.configs = {}, {}, {}, {}
        self.listing, self.facts, self.entries, self.dirs = None, {}, {}, {}


class _Recovery:
    """store.index.lazy's `recover` for a load's tables: the manifest at `source` (a key of
    `manifests` or `blob_manifests`) read afresh, its data in the file being `why` unusable,
    and the cache told. It holds the cache weakly: a cache dropped (a long-lived view's,
    replaced) is then freed by its count, not left with its whole load (some 100,000
    objects: its manifests hold their tables) to the cycle collector."""

    __slots__ = ("cache", "path", "root")

    def __init__(self, cache: ScanCache) -> None:
        self.cache = weakref.ref(cache)
        self.path, self.root = cache.path, cache.root

    def __call__(self, source: str, why: str, cls: type[Parsed]) -> Parsed:
        cache = self.cache()
        if cache is not None:
            cache.damaged(why)
        found = reread(self.root, source)
        if type(found) is not cls:
            # A kind the file did not hold: the object handed out cannot become the other.
            raise DamagedIndexError(
                f"scan index {self.path}: a manifest in it is not of its file's kind; "
                "the index is rebuilt: run the command again"
            )
        return found


def reread(root: str, source: str) -> Parsed:
    """The manifest at `source` as a scan reads it: a blob by its name (its bytes must hash
    to it), a tag file by its path (ManifestError when it cannot be read)."""
    blob = is_blob_name(source)
    if blob:
        path, rel = str(Layout(root).blobs / source), f"blobs/{source}"
    else:  # only a regular file is kept by its path: a link there now is refused
        path, rel = source, os.path.relpath(source, root)
    try:
        raw = read_file(path, MAX_MANIFEST_BYTES, follow=False)
    except OSError as exc:
        raise ManifestError(f"{rel}: {exc.strerror or exc}") from None
    if blob and hashlib.sha256(raw).hexdigest() != source[7:]:
        raise ManifestError(f"{rel}: bytes do not match the name")
    return parse_manifest(raw, rel)


# -- the file --------------------------------------------------------------------------------
def _load(cache: ScanCache, path: Path, root: str) -> str | None:
    """Fill `cache` from `path`; why it cannot be used, or None (an absent file is no news)."""
    obj, why = read_index(path, MAGIC, FORMAT_VERSION, root)
    if why is not None or obj is None:
        cache.dirty = True
        return why
    try:
        if obj[0] != root:
            # The same store by another path (a link to it, another host's mount point):
            # its keys are paths, so none would match; not news either.
            log.debug("scan index %s: saved for %s", path, obj[0])
            cache.dirty = True
            return None
        _decode(cache, obj)
        with contextlib.suppress(OSError):
            cache.loaded = os.stat(path).st_ino
    except Exception as exc:  # a well-formed file of a shape we never write: rebuild it
        cache.manifests, cache.links, cache.blob_manifests, cache.configs = {}, {}, {}, {}
        cache.listing, cache.facts, cache.entries, cache.dirs = None, {}, {}, {}
        return f"corrupt ({type(exc).__name__}: {exc})"
    return None


def _save(cache: ScanCache, path: Path) -> None:
    write_index(path, MAGIC, FORMAT_VERSION, _encode(cache), cache.root)


# -- the codec: plain tuples, rebuilt into the store's own types --------------------------------
# Digests and layers are written once each, in tables, and named by their place in them: a
# family's template, license and params are in every one of its manifests, and a load then
# makes each object once, with no lookups by value.
class _Encoder:
    def __init__(self) -> None:
        self.digests: dict[str, int] = {}
        self.layers: dict[tuple[Any, ...], int] = {}

    def digest(self, d: Digest) -> int:
        i = self.digests.get(d.hex)
        if i is None:
            i = self.digests[d.hex] = len(self.digests)
        return i

    def layer(self, layer: Layer) -> int:
        media = sys.intern(layer.media_type)  # marshal writes an object met twice once
        t = (media, self.digest(layer.digest), layer.size, layer.name, layer.from_)
        i = self.layers.get(t)
        if i is None:
            i = self.layers[t] = len(self.layers)
        return i

    def packed(self, m: Parsed) -> tuple[int, bytes]:
        return int(isinstance(m, ManifestList)), marshal.dumps(self.manifest(m))

    def manifest(self, m: Parsed) -> tuple[Any, ...]:
        if isinstance(m, ManifestList):
            children = tuple(
                (
                    self.digest(c.digest),
                    c.runner,
                    c.format,
                    None if c.inline is None else self.manifest(c.inline),
                )
                for c in m.children
            )
            return (1, m.raw, self.digest(m.digest), sys.intern(m.media_type), children)
        config = -1 if m.config is None else self.layer(m.config)
        layers = tuple(self.layer(layer) for layer in m.layers)
        media = sys.intern(m.media_type)
        return (0, m.raw, self.digest(m.digest), media, config, layers, m.runner, m.format)


def _config_t(c: ModelConfig) -> tuple[Any, ...]:
    return (
        c.model_format,
        c.model_family,
        c.model_families,
        c.model_type,
        c.file_type,
        c.architecture,
        c.capabilities,
        c.context_length,
        c.extra,
    )


def _encode(cache: ScanCache) -> tuple[Any, ...]:
    enc = _Encoder()
    # Each manifest as marshal data of its own, unpacked when it is first built (lazy).
    manifests = {p: (s, *enc.packed(m)) for p, (s, m) in cache.manifests.items()}
    blob_manifests = {n: (s, *enc.packed(m)) for n, (s, m) in cache.blob_manifests.items()}
    configs = {d.hex: _config_t(c) for d, c in cache.configs.items()}
    return (
        cache.root,
        "\n".join(enc.digests),
        marshal.dumps(tuple(enc.layers)),
        manifests,
        cache.links,
        blob_manifests,
        configs,
        cache.listing and (*cache.listing[:1], tuple(cache.listing[1]), *cache.listing[2:]),
        cache.facts,
        cache.entries if cache.listing else {},
        cache.dirs,
    )


def _decode(cache: ScanCache, obj: Any) -> None:
    """Fill `cache` from the file's object (ValueError, TypeError: not of the shape
    `_encode` gives; what is built only when used is checked then: see the module's text)."""
    _, hexes, layers, manifests, links, blob_manifests, configs, listing, facts = obj[:9]
    entries, dirs = obj[9:]
    tables = Tables(hexes, layers, _Recovery(cache))
    made = tables.manifest  # each built when first used: store.index.lazy
    cache.manifests = {p: (s, made(k, m, p)) for p, (s, k, m) in manifests.items()}
    cache.blob_manifests = {n: (s, made(k, m, n)) for n, (s, k, m) in blob_manifests.items()}
    check(all(isinstance(x, dict) for x in (links, configs, entries, dirs)), "a table's type")
    cache.configs = {digest_of_hex(h): ModelConfig(*c) for h, c in _configs(configs)}
    _check_links(links)
    cache.links = links
    if listing:
        key, names, problems, sizes = listing
        check(type(names) is tuple and isinstance(sizes, dict), "the listing's type")
        texts(names)
        check(types_in(sizes.values(), INT_OR_NONE), "a blob's size")
        check(types_in(chain.from_iterable(tuples_of(problems, 3)), TEXT), "a problem")
        cache.listing = (key, frozenset(names), problems, sizes)
        check(isinstance(facts, dict), "the facts' type")
        cache.facts = facts
        cache.entries = entries  # made under that listing, and of no use without it
    _check_dirs(dirs)
    cache.dirs = dirs


def _configs(configs: dict[Any, Any]) -> tuple[tuple[Any, Any], ...]:
    """The configs' items, each of ModelConfig's fields and types (_config_t)."""
    items = tuple(configs.items())
    cols = columns(tuples_of(map(itemgetter(1), items), 9), 9)
    for i in (0, 1, 3, 4, 5):
        texts(cols[i])
    for i in (2, 6):  # model_families, capabilities
        check(types_in(cols[i], frozenset({tuple})), "a config's list")
        nested_texts(cols[i])
    check(types_in(cols[7], INT_OR_NONE), "a config's context length")
    check(types_in(cols[8], frozenset({dict})), "a config's fields")
    return items


def _check_links(links: dict[Any, Any]) -> None:
    """Each link's value: (its stamp, the name of the blob it lands on)."""
    values = tuples_of(links.values(), 2)
    texts(map(itemgetter(1), values))


def _check_dirs(dirs: dict[Any, Any]) -> None:
    """Each directory's value (DirListing): its key, its entries' names, a kind letter each
    (store.index.dirs); a name is one path component."""
    _, names, kinds = columns(tuples_of(dirs.values(), 3), 3)
    check(types_in(names, frozenset({tuple})) and types_in(kinds, TEXT), "a directory's type")
    check(list(map(len, names)) == list(map(len, kinds)), "a directory's entries")
    check("/" not in "".join(chain.from_iterable(names)), "an entry's name")
    check(not "".join(kinds).strip("dflo"), "an entry's kind")
