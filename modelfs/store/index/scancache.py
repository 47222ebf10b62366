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
"""

from __future__ import annotations

import logging
import marshal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest
from modelfs.store.index.indexfile import Stamp, read_index, write_index
from modelfs.store.index.lazy import Tables, digest_of_hex
from modelfs.store.layout import Layout
from modelfs.store.manifest import Layer, Manifest, ManifestList, ModelConfig

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


@dataclass(slots=True)
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
    entries: dict[str, Recipe] = field(default_factory=dict)  # held to the listing
    dirs: dict[str, DirListing] = field(default_factory=dict)
    path: Path | None = None
    root: str = ""
    dirty: bool = False  # differs from what `path` holds

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
            self.facts = {}
        if listing is None:
            self.entries = {}
        self.listing = listing

    def fact(self, kind: str, hex_: str, compute: Callable[[], T | None]) -> T | None:
        """`compute()`'s answer about the blob `hex_`, from the index while blobs/ is as the
        last scan listed it; an answer of None (the blob unreadable) is not kept."""
        if self.listing is None:
            return compute()
        key = kind + hex_
        if key in self.facts:
            known: T = self.facts[key]
            return known
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
        self.dirty = False


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
    except Exception as exc:  # a well-formed file of a shape we never write: rebuild it
        cache.manifests, cache.links, cache.blob_manifests, cache.configs = {}, {}, {}, {}
        cache.listing, cache.facts, cache.entries, cache.dirs = None, {}, {}, {}
        return f"corrupt ({type(exc).__name__})"
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
    _, hexes, layers, manifests, links, blob_manifests, configs, listing, facts = obj[:9]
    entries, dirs = obj[9:]
    tables = Tables(hexes, layers)
    made = tables.manifest  # each built when first used: store.index.lazy
    cache.manifests = {p: (s, made(k, m)) for p, (s, k, m) in manifests.items()}
    cache.links = links
    cache.blob_manifests = {n: (s, made(k, m)) for n, (s, k, m) in blob_manifests.items()}
    cache.configs = {digest_of_hex(h): ModelConfig(*c) for h, c in configs.items()}
    if not isinstance(links, dict) or not isinstance(entries, dict) or not isinstance(dirs, dict):
        raise TypeError("links, entries or dirs")
    if listing:
        key, names, problems, sizes = listing
        if not isinstance(sizes, dict):
            raise TypeError("sizes")
        cache.listing = (key, frozenset(names), problems, sizes)
        if not isinstance(facts, dict):
            raise TypeError("facts")
        cache.facts = facts
        cache.entries = entries  # made under that listing, and of no use without it
    cache.dirs = dirs
