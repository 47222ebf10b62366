"""Other tools' layouts of the store in a mount (`.lmstudio/`, `.huggingface/hub/`; see
store.tools.toolviews): made when first looked into, not at a build, and their share of the
blobs' link counts.

A blob a layout shows is the same inode as in the model directories, so its link count holds
the layouts' places too. A build does not lay them out (a fifth of a build of 5,000 models);
a blob's share is counted when its link count is first asked (`count_links`): from the layouts
of the repositories whose tags hold it, which show it as often as the whole store's layouts do
(toolviews.repo_key), or from the whole layouts once a top was looked into. Either way the
count is final before any listing shows it.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from modelfs.fsd.counts import repos_of
from modelfs.fsd.nodes import BlobNode, BytesNode, DirNode, Node
from modelfs.fsd.plan import ModelPlan
from modelfs.store.digest import Digest
from modelfs.store.manifest import Manifest
from modelfs.store.scan import Entry, StoreIndex
from modelfs.store.tools.files import ModelFile
from modelfs.store.tools.toolviews import (
    SHOWN_KINDS,
    ToolFile,
    layout_files,
    repo_key,
    tool_models,
)

log = logging.getLogger(__name__)

# Where the mount shows other tools' layouts of the store (store.toolviews).
TOOL_VIEWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lmstudio", (".lmstudio",)),
    ("hf", (".huggingface", "hub")),
)

Repo = tuple[str, ...]
Shards = tuple[tuple[str, ModelFile], ...]
# Blobs counted one at a time (each from its repositories' layouts, ~0.2 ms) before the whole
# layouts are made instead (~0.2 s for 5,000 models, then a look-up per blob): a listing of a
# model directory or two stays cheap, `ls -l .blobs/` or `ls -lR` does not count 13,000 alone.
COUNT_ALONE = 64


class ToolDirs:
    """The tool layouts of one build (fsd.builder._Build, which holds this state)."""

    index: StoreIndex
    prefer: tuple[str, ...]
    data: str
    blob_nodes: dict[Digest, BlobNode]

    if TYPE_CHECKING:

        def _mkdirs(self, parent: DirNode, rel: Iterable[str], mtime_ns: int) -> DirNode: ...

        def _dir(self, path: tuple[str, ...], mtime_ns: int) -> DirNode: ...

        def _plan(self, manifest: Manifest) -> ModelPlan: ...

        def _layer_blob(self, f: ModelFile, path: str) -> BlobNode | None: ...

        def _bytes(self, path: tuple[str, ...], data: bytes, mtime_ns: int) -> BytesNode: ...

        def _file_node(self, blob: BlobNode) -> Node: ...

        def _known_tensor_names(self, f: ModelFile) -> tuple[list[str], int] | None: ...

        def _index_of(self, shards: Shards) -> bytes | None: ...

        # (file name, its path, the shards, mtime, the directory it goes in)
        _fill_index: Callable[[str, tuple[str, ...], Shards, int, DirNode], None]

    def init_tool_dirs(self, known_names: dict[Digest, tuple[list[str], int] | None]) -> None:
        # One lock for the layouts and the counts: a worker thread counts while the request
        # loop may fill a top, and a blob's share must be added once.
        self.tool_lock = threading.RLock()
        self.tool_files: dict[str, list[ToolFile]] = {}
        self.tool_counts: Counter[Digest] | None = None  # from the whole layouts
        # The repositories holding each blob (by hex): worked out from every manifest's
        # layers, or taken from the last build of the same store (fsd.counts).
        self.blob_repos: Mapping[str, Collection[Repo]] | None = None
        self.repos_kept = False  # blob_repos read from fsd.counts' file: each checked when used
        self.repo_entries: dict[Repo, list[Entry]] | None = None
        self.counted_alone = 0
        # The tensor names known when the build began: a layout made later is the one the
        # build would have made (a header read meanwhile would change an index, or drop
        # shards whose header turned out unreadable).
        self.names_at_build = dict(known_names)
        # What each blob node of the build calls to be counted; weak, as the build holds
        # its blob nodes and a tree is freed by reference counting, never by the collector.
        self.count_ref = weakref.WeakMethod(self.count_tool_links)

    def add_tool_tops(self, root: DirNode, mtime_ns: int) -> None:
        for layout, top in TOOL_VIEWS:
            parent = self._mkdirs(root, top[:-1], mtime_ns)
            d = self._dir((*parent.path, top[-1]), mtime_ns)
            parent._children[top[-1]] = d
            d._prepare = functools.partial(self._tool_layout, layout)
            d._count_subdirs = functools.partial(self._tool_subdirs, layout)
            d._fill = functools.partial(self._fill_tool_view, layout)

    def _names(self, f: ModelFile) -> tuple[list[str], int] | None:
        if f.layer.digest in self.names_at_build:
            return self.names_at_build[f.layer.digest]
        return self._known_tensor_names(f)  # Deferred

    def _files_of(self, manifest: Manifest) -> list[ModelFile]:
        return self._plan(manifest).files

    def _tool_layout(self, layout: str) -> list[ToolFile]:
        """The whole layout, made once per build (in a worker thread when asked by a lookup)."""
        with self.tool_lock:
            files = self.tool_files.get(layout)
            if files is None:
                try:
                    models = tool_models(self.index, self.prefer, self._files_of)
                    for name, _ in TOOL_VIEWS:
                        self.tool_files[name] = layout_files(name, models, self._names)
                except Exception:
                    # Asked for by listings anywhere (a blob's link count counts its places
                    # here): one model's oddity must not fail them; the views are shown empty
                    # and counted as such, so counts and listings still agree.
                    log.exception(
                        "%s: not shown", ", ".join("/".join(top) for _, top in TOOL_VIEWS)
                    )
                    self.tool_files = {name: [] for name, _ in TOOL_VIEWS}
                counts: Counter[Digest] = Counter()
                for name, _ in TOOL_VIEWS:
                    counts.update(self._shown(self.tool_files[name]))
                self.tool_counts = counts
                self.blob_repos, self.repo_entries = {}, None  # counted by `tool_counts` now
                self.repos_kept = False
                files = self.tool_files[layout]
            return files

    def _shown(self, files: list[ToolFile]) -> Iterable[Digest]:
        """The blob of every file of `files` that shows one (a place in its link count). Once
        a path: two tags naming one manifest share a hub snapshot, one place for each file."""
        paths: set[str] = set()
        for f in files:
            if f.source is not None and f.path not in paths:
                paths.add(f.path)
                if self._layer_blob(f.source, f.path) is not None:
                    yield f.source.layer.digest

    def _tool_subdirs(self, layout: str) -> int:
        return len({f.path.partition("/")[0] for f in self._tool_layout(layout) if "/" in f.path})

    def _fill_tool_view(self, layout: str, base: DirNode) -> None:
        """The files `modelfs link --layout` writes, as the same nodes the model directories
        show (one inode per blob: passthrough, leases and xattrs are theirs)."""
        top = base.path
        mtimes = {e.name.key: e.modified_ns for e in self.index}
        indexes: list[tuple[DirNode, str, tuple[str, ...], ToolFile, int]] = []
        for f in self._tool_layout(layout):
            parts = f.path.split("/")
            when = mtimes[f.name.key]
            holder = self._mkdirs(base, parts[:-1], when)
            node: Node
            if f.shards:
                indexes.append((holder, parts[-1], (*top, *parts), f, when))
                continue
            if f.source is None:
                node = self._bytes((*top, *parts), f.data, when)
            else:
                blob = self._layer_blob(f.source, f.path)
                if blob is None:
                    continue
                node = self._file_node(blob)
            holder._children[parts[-1]] = node
        # An index whose shards' headers were not read yet is made when its directory is
        # first looked into: read in a worker thread (`_index_of`), placed by the fill.
        for holder, name, path, f, when in indexes:
            holder._subdirs = sum(isinstance(c, DirNode) for c in holder._children.values())
            holder._prepare = functools.partial(self._index_of, f.shards)
            holder._fill = functools.partial(self._fill_index, name, path, f.shards, when)
        # Counted now, whole layouts being at hand: a test (or a walk) reading `links`
        # without the mount's lookups sees them final too.
        for blob in list(self.blob_nodes.values()):
            blob.count_links()

    # -- link counts ---------------------------------------------------------------------
    def count_tool_links(self, blob: BlobNode) -> None:
        """Add the places the layouts show `blob` in to its link count, once."""
        with self.tool_lock:
            if blob._count is None:
                return
            if self.tool_counts is None and self.counted_alone >= COUNT_ALONE:
                self._tool_layout(TOOL_VIEWS[0][0])  # many asked: the whole layouts are cheaper
            if self.tool_counts is not None:
                blob.links += self.tool_counts[blob.digest]
            else:
                self.counted_alone += 1
                blob.links += self._repo_count(blob.digest)
            blob._count = None

    def _repo_count(self, digest: Digest) -> int:
        """How often the layouts show the blob: laid out for the repositories holding it."""
        got = self.repos_of_blobs().get(digest.hex, ())
        repos: Collection[Repo] | None = repos_of(got) if self.repos_kept and got else got
        if repos is None:  # kept by the last build (fsd.counts), but not as it saves them
            log.debug("%s: repositories kept not of their shape; worked out again", digest)
            self.blob_repos = None
            repos = self.repos_of_blobs().get(digest.hex, ())
        if not repos:
            return 0
        if self.repo_entries is None:
            self.repo_entries = {}
            for entry in self.index:
                self.repo_entries.setdefault(repo_key(entry.name), []).append(entry)
        entries = [e for repo in repos for e in self.repo_entries.get(tuple(repo), ())]
        models = tool_models(self.index, self.prefer, self._files_of, entries)
        return sum(
            d == digest
            for layout, _ in TOOL_VIEWS
            for d in self._shown(layout_files(layout, models, self._names))
        )

    def repos_of_blobs(self) -> Mapping[str, Collection[Repo]]:
        """The repositories whose tags hold each blob (by hex) in a layer a layout may show."""
        if self.blob_repos is None:
            blob_repos: dict[str, set[Repo]] = {}
            for entry in self.index:
                repo = repo_key(entry.name)
                for v in entry.variants:
                    for layer in v.manifest.layers:
                        if layer.kind in SHOWN_KINDS:
                            blob_repos.setdefault(layer.digest.hex, set()).add(repo)
            self.blob_repos, self.repos_kept = blob_repos, False
        return self.blob_repos
