"""The nodes of the name tree a mount shows, and the inode numbers they carry.

Inode numbers come from an `InodeTable` that lives as long as the mount, keyed by what a node
*is* (a directory's path, a blob's digest, a small file's path and bytes), so an unchanged path
keeps its inode across rebuilds and an inode never changes meaning, which lets an open file keep
its bytes when its tag moves. Numbers the served tree does not use and the kernel has forgotten
are let go (`InodeTable.retain`), so a mount that runs for months through many re-tags stays its
size.
"""

from __future__ import annotations

import functools
import itertools
import stat
import threading
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from modelfs.store.digest import Digest
from modelfs.store.tools.views import MergedSafetensors, read_merged

if TYPE_CHECKING:  # imported when a view is first made (store.compat)
    from modelfs.store.compat import ComputeCache, GGUFView

ROOT_INODE = 1


class InodeTable:
    """Stable inode numbers for the life of a mount; never reused. Safe across threads (a
    rebuild in a worker thread, a lazy directory filled in the request loop, a plan made in a
    worker thread for a link count): `next` on a count and `dict.setdefault` are atomic, and
    a number lost to a race is just never used; a new key waits for a `retain` under way,
    which walks the table (a key added meanwhile would change its size mid-walk)."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, int] = {}
        self._numbers = itertools.count(ROOT_INODE + 1)
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> int:
        ino = self._by_key.get(key)
        if ino is None:
            with self._lock:
                ino = self._by_key.setdefault(key, next(self._numbers))
        return ino

    def retain(self, live: Container[int], keep: Callable[[Hashable], bool] | None = None) -> None:
        """Forget the keys of inodes not in `live`, unless `keep(key)`. Called between builds
        only (from the mount's loop, after a build finished): a key dropped here and met again
        later gets a new number, which is right, as nothing that knew the old one is left."""
        with self._lock:
            self._by_key = {
                k: ino
                for k, ino in self._by_key.items()
                if ino in live or (keep is not None and keep(k))
            }

    def __len__(self) -> int:
        return len(self._by_key)


@dataclass(eq=False)
class Node:
    inode: int
    mtime_ns: int
    xattrs: dict[str, bytes] = field(default_factory=dict)
    links: int = 1  # how many places show it, so `du` and `rsync -H` count a blob once

    mode = stat.S_IFREG | 0o444

    @property
    def size(self) -> int:
        return 0


@dataclass(eq=False)
class DirNode(Node):
    path: tuple[str, ...] = ()
    is_model: bool = False
    # A lazy directory has `_fill` set until first use, and `_subdirs` says what its link
    # count will be (or `_count_subdirs` works it out when first asked: a model directory's
    # `llama.cpp/` depends on its GGUF's header); `children` fills it.
    _children: dict[str, Node] = field(default_factory=dict, repr=False)
    _fill: Callable[[DirNode], None] | None = field(default=None, repr=False)
    _subdirs: int = 0
    _count_subdirs: Callable[[], int] | None = field(default=None, repr=False)
    # Slow work the fill needs (a merged header of a huge safetensors blob), to be run in a
    # worker thread before the first look inside, so the request loop never waits for it.
    _prepare: Callable[[], object] | None = field(default=None, repr=False)
    mode = stat.S_IFDIR | 0o555

    @property
    def size(self) -> int:
        return 4096

    @property
    def children(self) -> dict[str, Node]:
        fill = self._fill
        if fill is not None:
            self._fill = None
            fill(self)
        return self._children

    @property
    def loaded(self) -> bool:
        """False for a lazy directory nobody has looked into yet."""
        return self._fill is None

    @property
    def needs_prepare(self) -> bool:
        """True until `prepare` has run: filling it now would do slow work in the caller."""
        return self._prepare is not None

    def prepare(self) -> None:
        """Do the slow part of filling it (safe in a worker thread: it only fills caches)."""
        prepare = self._prepare
        if prepare is not None:
            prepare()
            self._prepare = None

    @property
    def nlink_pending(self) -> bool:
        """True while its link count is still to be worked out (which may read a blob)."""
        return self._fill is not None and self._count_subdirs is not None

    @property
    def nlink(self) -> int:
        if self._fill is not None:
            count = self._count_subdirs
            if count is not None:
                self._subdirs = count()
                self._count_subdirs = None
            return 2 + self._subdirs
        return 2 + sum(isinstance(c, DirNode) for c in self._children.values())


@dataclass(eq=False)
class BlobNode(Node):
    """A file whose bytes are one blob, served from the blob file."""

    digest: Digest = field(default=Digest("0" * 64))
    blobs_dir: Path = field(default=Path())
    blob_size: int = 0
    media_type: str = ""
    gguf: bool = False
    # Set while the places other tools' layouts show it in are still to be added to `links`
    # (fsd.tool_dirs): what it calls to count them, held weakly (None once its build is gone).
    _count: Callable[[], Callable[[BlobNode], None] | None] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.blob_size

    @property
    def links_pending(self) -> bool:
        """True while its link count is still to be worked out (which may lay out repos)."""
        return self._count is not None

    def count_links(self) -> int:
        """Its link count, worked out first if still pending."""
        ref = self._count
        if ref is not None:
            count = ref()
            if count is None:
                self._count = None
            else:
                count(self)
        return self.links

    @functools.cached_property
    def path(self) -> Path:
        # Made on first use: a Path per blob was a fifth of a build.
        return self.blobs_dir / self.digest.blob_name


@dataclass(eq=False)
class BytesNode(Node):
    """A small file synthesized in memory."""

    data: bytes = b""

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(eq=False)
class MergedNode(Node):
    """`model.safetensors`: a merged header, data read from many blobs.

    A single tensor blob is its own merge, served as it is; when its header is big (a million
    tensors, 100 MB), it is shown unread, at the blob's size, and checked at the first open
    (`check`, run in a worker thread), so neither the mount's start nor a listing reads it.
    """

    merged: MergedSafetensors | None = None
    # Raises OSError(EIO) naming what is wrong; every open runs it (the outcome is cached).
    check: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.merged.size if self.merged else 0

    @functools.cached_property
    def digests(self) -> tuple[Digest, ...]:
        """The tensor blobs it reads from, each once (segments are `blobs/sha256-<hex>`)."""
        assert self.merged is not None
        return tuple(dict.fromkeys(Digest.parse(s.path.name) for s in self.merged.segments))

    def read(self, fds: dict[Path, int], offset: int, size: int) -> bytes:
        assert self.merged is not None
        return read_merged(self.merged, fds, offset, size)


@dataclass(eq=False)
class CompatNode(Node):
    """`llama.cpp/model.gguf` or `llama.cpp/mmproj.gguf`: a synthesized GGUF whose data are
    ranges of one blob (and computed tensors, cached under `.modelfs/compat/`)."""

    digest: Digest = field(default=Digest("0" * 64))
    path: Path = field(default=Path())
    view: GGUFView | None = None
    cache: ComputeCache | None = None

    @property
    def size(self) -> int:
        return self.view.size if self.view else 0

    def touches_compute(self, offset: int, size: int) -> bool:
        """True if [offset, offset+size) holds a computed tensor (a slow first read)."""
        assert self.view is not None
        end = offset + size
        return any(p.start < end and offset < p.start + p.length for p in self.view.computed_pieces)

    def read(self, fd: int, offset: int, size: int) -> bytes:
        assert self.view is not None
        return self.view.read(fd, offset, size, self.cache)


@dataclass(eq=False)
class SymlinkNode(Node):
    target: bytes = b""
    mode = stat.S_IFLNK | 0o777

    @property
    def size(self) -> int:
        return len(self.target)


class NodeSink(Protocol):
    """Where nodes made after a build (by filling a lazy directory) are registered: the mount's
    inode -> node table."""

    def place(self, node: Node, current: Callable[[], bool]) -> None:
        """Register `node`; if `current()` (asked under the sink's lock, so that no swap of
        trees comes between the answer and the placing) the tree that made it is the one
        served and its node wins, else it is placed only if nothing holds the inode yet (a
        replaced tree the kernel still walks; the content of an inode is the same in both by
        construction)."""
