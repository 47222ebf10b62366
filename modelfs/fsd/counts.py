"""A build's link counts, kept under `.modelfs/mount-counts` for the next mount start.

Every file a mount shows has the link count of the places that show it, so that `du` and
`find -links` see one file; a blob's count needs what every model directory will show, which
is every manifest's layers: a fifth of a start on 5,000 models (fsd.counting).
They depend only on what a build is given, so they are kept with a fingerprint of exactly that:
the tags in the order the build places them, the manifest each names (a list's own digest
names directories in .by-digest/) and each of their variants serves (by digest, so a tag
rewritten in place is a new fingerprint), their runners, the mount's
`--prefer` and `--data`, and `blobs/`'s (inode, mtime_ns, ctime_ns), by which the scan index
trusts blob sizes (a blob appears, goes or changes size only by a create, rename or unlink in
it: store.index.scancache). A scan that did not list `blobs/` as it is, settled (changed within
the racy margin, or no index), gives no fingerprint, and the counts are worked out.

The file is read and written as the scan index is (store.index.indexfile: owned by us alone,
checked, replaced whole); anything wrong with it costs the counting, never a wrong count of
a store whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.index.indexfile import read_index, write_index
from modelfs.store.index.lazy import digest_of_hex, manifest_hex
from modelfs.store.manifest import Manifest, ManifestList
from modelfs.store.scan import Entry, StoreIndex

log = logging.getLogger(__name__)

MAGIC = b"modelfs mount counts\n"
FORMAT_VERSION = 1
FILE_NAME = "mount-counts"
MAX_COUNT = (1 << 31) - 1


@dataclass(slots=True)
class Counts:
    """What a build counted (fsd.builder._Build's fields of the same names), by digest hex."""

    place_links: dict[str, int] = field(default_factory=dict)  # model directories per blob
    media: dict[str, str] = field(default_factory=dict)  # the media type a blob is first met as
    gguf_blobs: set[str] = field(default_factory=set)  # shown as a .gguf file somewhere
    merged_links: dict[tuple[Digest, ...], int] = field(default_factory=dict)
    gguf_places: dict[Digest, int] = field(default_factory=dict)
    projector_places: dict[Digest, list[Digest]] = field(default_factory=dict)
    # The tensor blobs of each manifest (by hex) that has any: its model directory reads
    # their headers before it is filled (`_prepare`).
    tensors: dict[str, tuple[Digest, ...]] = field(default_factory=dict)
    # The directories in .by-name/ and .by-digest/, placed when those are first looked into.
    hidden_subdirs: tuple[int, int] = (0, 0)
    # The repositories (toolviews.repo_key) holding each blob (by hex) in a layer the tool
    # layouts may show: a blob's places there are counted from theirs (fsd.tool_dirs).
    blob_repos: Mapping[str, Collection[tuple[str, ...]]] = field(default_factory=dict)


def fingerprint(
    index: StoreIndex,
    entries: Iterable[Entry],
    prefer: tuple[str, ...],
    data: str,
    hex_of: Callable[[Manifest | ManifestList], str] = manifest_hex,
) -> bytes | None:
    """What the counts of a build of `entries` (in its order) depend on; None when the scan
    did not take `blobs/` as settled."""
    listing = index.cache.listing if index.cache is not None else None
    if listing is None:
        return None
    parts = [f"{FORMAT_VERSION}\0{data}\0{','.join(prefer)}\0{listing[0]}"]
    add = parts.append
    for entry in entries:
        # The tag's own digest too: a list's names .by-digest/ directories of its own, and a
        # tag moved to another list of the same children moves no other part of the key.
        add(f"{entry.name.full}\0{hex_of(entry.top)}")
        for v in entry.variants:
            add(f"{hex_of(v.manifest)}\0{v.runner}\0{v.from_list:d}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()


def _path(index: StoreIndex) -> Any:
    return index.layout.state / FILE_NAME


def load(index: StoreIndex, key: bytes) -> Counts | None:
    """The counts saved under `key`, or None (another key, or no usable file)."""
    obj, why = read_index(_path(index), MAGIC, FORMAT_VERSION, index.layout.root)
    if why is not None:
        log.debug("mount counts %s: %s", _path(index), why)
    if obj is None:
        return None
    try:
        saved, links, media, gguf, merged, places, projectors, tensors, hidden, repos = obj
        if saved != key:
            return None
        counts = Counts(dict(links), dict(media), set(gguf))
        hexes = _Digests()
        counts.merged_links = {tuple(map(hexes, k)): _count(n) for k, n in merged.items()}
        counts.gguf_places = {hexes(k): _count(n) for k, n in places.items()}
        counts.projector_places = {hexes(k): list(map(hexes, v)) for k, v in projectors.items()}
        counts.tensors = {str(k): tuple(map(hexes, v)) for k, v in tensors.items()}
        by_name, by_digest = hidden
        counts.hidden_subdirs = (_count(by_name), _count(by_digest))
        if type(repos) is not dict:
            raise TypeError("blob_repos")
        counts.blob_repos = repos  # each checked when a blob is first counted (`repos_of`)
        if not all(
            type(k) is str and type(n) is int and 0 <= n <= MAX_COUNT
            for k, n in counts.place_links.items()
        ):
            raise TypeError("place_links")
        if not all(type(k) is str and type(v) is str for k, v in counts.media.items()):
            raise TypeError("media")
    except (TypeError, ValueError, AttributeError) as exc:  # not the shape `save` writes
        log.debug("mount counts %s: corrupt (%s)", _path(index), type(exc).__name__)
        return None
    return counts


def save(index: StoreIndex, key: bytes, counts: Counts) -> None:
    """Keep `counts` for the next start; never fails a build (a store not ours is not written)."""
    obj = (
        key,
        counts.place_links,
        counts.media,
        sorted(counts.gguf_blobs),
        {tuple(d.hex for d in k): n for k, n in counts.merged_links.items()},
        {d.hex: n for d, n in counts.gguf_places.items()},
        {d.hex: [m.hex for m in v] for d, v in counts.projector_places.items()},
        {k: tuple(d.hex for d in v) for k, v in counts.tensors.items()},
        counts.hidden_subdirs,
        {k: list(v) for k, v in counts.blob_repos.items()},
    )
    try:
        write_index(_path(index), MAGIC, FORMAT_VERSION, obj, index.layout.root)
    except (OSError, ValueError) as exc:
        log.debug("mount counts not saved: %s", exc)


def _count(n: object) -> int:
    """A count as `save` writes one (a link count past MAX_COUNT overflows a stat's)."""
    if type(n) is not int or not 0 <= n <= MAX_COUNT:
        raise ValueError("not a count")
    return n


def repos_of(saved: object) -> list[tuple[str, ...]] | None:
    """A blob's repositories as `save` writes them (in `Counts.blob_repos`, not checked at the
    load: 20,000 blobs a start, and few are asked); None for anything else, which its caller
    works out afresh."""
    if type(saved) is not list:
        return None
    repos = [r for r in saved if type(r) is tuple and all(type(p) is str for p in r)]
    return repos if len(repos) == len(saved) else None


class _Digests:
    """Each hex made a Digest once."""

    def __init__(self) -> None:
        self._made: dict[str, Digest] = {}

    def __call__(self, hex_: object) -> Digest:
        if type(hex_) is not str:
            raise TypeError("not a digest")
        d = self._made.get(hex_)
        if d is None:
            d = self._made[hex_] = digest_of_hex(hex_)
        return d
