"""The name tree a mount shows, built from a store scan (README, "The mount").

A tree is immutable once built; a change in the store builds a new one. Its nodes and their
inode numbers are in fsd.nodes; the `llama.cpp/` directories it holds are made by
fsd.compat_dirs.

A build reads no blob and makes no model directory's content, nor its plan or its blobs'
nodes (it counts what each model directory will show from its manifest's layers, or takes
those counts from the last build of the same store: fsd.counting): the names under the root
are placed, the model directories under each made when it is first looked into and filled on
first use; `.by-name/`, `.by-digest/` and `.blobs/` are filled on first use, and so are the
model directories in them; other tools' layouts (`.lmstudio/`, `.huggingface/hub/`) are laid
out when first looked into (fsd.tool_dirs). What a listing shows of a directory not filled yet
(inode, mtime, link count, the link counts of the blobs inside) is settled when the build
ends, or worked out when first asked: a model directory's own link count, which depends on
whether its GGUF gets a `llama.cpp/` view, and a blob's places in the tool layouts; filling
one changes nothing that was shown, it only makes what is inside.
"""

from __future__ import annotations

import errno
import functools
import gc
import logging
import threading
import weakref
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelfs.fsd import counts, heap
from modelfs.fsd.compat_dirs import CompatDirs
from modelfs.fsd.counting import Counting
from modelfs.fsd.nodes import (
    ROOT_INODE,
    BlobNode,
    BytesNode,
    CompatNode,
    DirNode,
    InodeTable,
    MergedNode,
    Node,
    NodeSink,
    SymlinkNode,
)
from modelfs.fsd.plan import ModelPlan
from modelfs.fsd.tool_dirs import ToolDirs
from modelfs.store.compat.decisions import Decisions
from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import StoreError
from modelfs.store.formats.safetensors import read_header_length, read_safetensors_header_path
from modelfs.store.index.lazy import HexOf
from modelfs.store.manifest import Manifest, clean_text
from modelfs.store.names import Name
from modelfs.store.scan import DEFAULT_PREFER, Entry, StoreIndex, Variant
from modelfs.store.tools.files import ModelFile, model_files
from modelfs.store.tools.toolviews import Deferred, safetensors_index
from modelfs.store.tools.views import (
    MergedSafetensors,
    Segment,
    merge_safetensors,
    render_modelfile,
)

if TYPE_CHECKING:  # imported when a view is first made (store.compat)
    from modelfs.store.compat import CompatViews, ComputeCache, GGUFView

log = logging.getLogger(__name__)

MAX_TEXT_BYTES = 1 << 20  # templates, licenses, params shown inside a Modelfile
# A model whose tensor blobs' headers add up to more than this gets its `model.safetensors`
# made in a worker thread when its directory is first looked into, never in a build: a
# 100 MB header (a million tensors, legal) takes seconds to read and merge.
EAGER_HEADER_BYTES = 4 << 20


@dataclass
class NameTree:
    root: DirNode
    nodes: dict[int, Node]  # every node made by the build itself
    blob_nodes: dict[Digest, BlobNode]
    _build: _Build | None = field(default=None, repr=False)

    def attach(self, sink: NodeSink) -> None:
        """Register the nodes lazy directories make, now and from now on, in `sink.nodes`."""
        if self._build is not None:
            self._build.attach(sink)

    def has_blob(self, digest: Digest) -> bool:
        """Whether the scan this tree was built from found the blob (a tree built without one,
        in tests, has every blob)."""
        return self._build is None or self._build.index.has_blob(digest)

    def make_views(self) -> int:
        """Make the llama.cpp views this tree will show, ahead of their first use (in a worker
        thread, after the mount is ready): filling `llama.cpp/` in the request loop is then
        only placing nodes. Returns how many were made."""
        return self._build.make_views() if self._build is not None else 0

    def save_decisions(self) -> None:
        """Write the llama.cpp decisions made since the build (directories are filled and
        their link counts asked after it): at the next build, and when the mount ends."""
        if self._build is not None and self._build.builder.decisions is not None:
            self._build.builder.decisions.save()

    def retain_inodes(self, live: Container[int]) -> None:
        """Let the inode table forget numbers not in `live` (see InodeTable.retain), but a
        blob's while the store has it: its node is made when first shown, and keeps its number
        from tree to tree as when every blob's node was made by the build."""
        build = self._build
        if build is not None:
            has = build.index.has_blob
            build.inodes.retain(live, lambda k: type(k) is tuple and k[0] == "blob" and has(k[1]))

    def retire(self) -> None:
        """A newer tree is served: what this one still makes never displaces the newer one's
        node of the same inode (an inode's content is the same in both by construction; this
        only keeps the newest directory listing and link count)."""
        if self._build is not None:
            self._build.current = False


class TreeBuilder:
    """Builds NameTrees from StoreIndexes. `data` is "fuse" (serve bytes) or "symlink"."""

    def __init__(
        self,
        inodes: InodeTable,
        *,
        prefer: Iterable[str] = DEFAULT_PREFER,
        data: str = "fuse",
    ) -> None:
        self.inodes = inodes
        self.prefer = tuple(prefer)
        self.data = data
        # Merged views depend only on blob contents, so they are cached for the mount's life.
        self.merged: dict[tuple[Digest, ...], MergedSafetensors | str] = {}
        # One merge of a big header at a time per key, however many directories ask for it.
        self.merge_locks: dict[tuple[Digest, ...], threading.Lock] = {}
        # So do llama.cpp views of GGUF blobs (None: the blob needs none).
        self.compat: dict[Digest, CompatViews | str | None] = {}
        # ... and the views of separate projector blobs (mmproj.gguf layers).
        self.mmproj: dict[Digest, GGUFView | str | None] = {}
        self.compute_cache: ComputeCache | None = None
        # Which blobs get views, from earlier mounts: a view is made when first looked into.
        self.decisions: Decisions | None = None
        # The tensor names of safetensors blobs, for the hub cache's index files.
        self.tensor_names: dict[Digest, tuple[list[str], int] | None] = {}
        # ... and the hub cache's model.safetensors.index.json, by its shards' blobs.
        self.indexes: dict[tuple[Digest, ...], bytes | None] = {}

    def build(self, index: StoreIndex) -> NameTree:
        # A build makes ~20 objects per model and keeps them all; the cyclic collector would
        # walk them again and again while they are being made, for nothing.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        if self.decisions is None:
            self.decisions = Decisions(index.layout)
        self.decisions.forget_use()
        try:
            return _Build(self, index).run()
        finally:
            self._drop_gone(index)
            self.decisions.save()
            if gc_was_enabled:
                gc.enable()

    def _drop_gone(self, index: StoreIndex) -> None:
        """Views of blobs the store no longer has go with them (a mount's life is long).
        Worker threads of the served tree add to these caches meanwhile: each is walked from a
        copy of its keys (list() of a dict is one step under the GIL)."""
        for cache in (self.compat, self.mmproj, self.tensor_names):
            for digest in [d for d in list(cache) if not index.has_blob(d)]:
                cache.pop(digest, None)
        for keyed in (self.merged, self.indexes):
            for key in [k for k in list(keyed) if not all(index.has_blob(d) for d in k)]:
                keyed.pop(key, None)


class _Build(Counting, CompatDirs, ToolDirs):
    """One build: the state that depends on one StoreIndex, kept as long as a lazy directory
    of its tree may still be filled. Nothing here refers back to the tree's nodes (the mount
    is held weakly), so a tree that is no longer served is freed by reference counting."""

    builder: TreeBuilder  # more than the BuilderState the compat part reads

    def __init__(self, builder: TreeBuilder, index: StoreIndex) -> None:
        self.inodes = builder.inodes
        self.prefer = builder.prefer
        self.data = builder.data
        self.merged = builder.merged
        self.compat = builder.compat
        self.mmproj = builder.mmproj
        self.builder = builder  # its caches; it holds no node
        self.index = index
        # Every model is placed up to three times (short name, .by-name, .by-digest); what
        # depends only on a manifest or a blob is computed once per build.
        self.plans: dict[Digest, ModelPlan] = {}
        self.texts: dict[Digest, str | None] = {}
        self.modelfiles: dict[tuple[Digest, str], bytes] = {}
        self.blob_nodes: dict[Digest, BlobNode] = {}
        # Files made from several blobs, one node per build wherever they show (the places
        # that show them counted in `merged_links`, fsd.counting).
        self.merged_nodes: dict[tuple[Digest, ...], MergedNode] = {}
        self.compat_nodes: dict[tuple[Digest, str], CompatNode] = {}
        self.heavy: dict[tuple[Digest, ...], bool] = {}  # see _merge_is_heavy
        # The model directories each holder (by inode) will hold, while building.
        self.leaves: dict[int, dict[str, tuple[Entry, Variant]]] = {}
        self.hex_of = HexOf()  # manifests are named by digest before any is made whole
        self.hidden_later: tuple[_Places, _Places] | None = None  # see _fill_hidden_later
        self.init_counting()
        self.nodes: dict[int, Node] | None = {}  # while building; then None
        self.pending: dict[int, Node] = {}  # made lazily before the tree is attached
        self.sink: weakref.ref[NodeSink] | None = None
        self.current = True
        self.init_tool_dirs(builder.tensor_names)

    # -- registration --------------------------------------------------------------------
    def register(self, node: Node) -> None:
        if self.nodes is not None:
            self.nodes[node.inode] = node
            return
        sink = self.sink() if self.sink is not None else None
        if sink is None:
            if self.sink is None:
                self.pending[node.inode] = node
            return  # the mount is gone
        sink.place(node, self.is_current)

    def is_current(self) -> bool:
        return self.current

    def attach(self, sink: NodeSink) -> None:
        self.sink = weakref.ref(sink)
        pending, self.pending = self.pending, {}
        for node in pending.values():
            self.register(node)

    # -- the build -----------------------------------------------------------------------
    def run(self) -> NameTree:
        index = self.index
        root_mtime = max((e.modified_ns for e in index), default=0)
        root = self._dir((), root_mtime)
        assert self.nodes is not None
        del self.nodes[root.inode]
        root.inode = ROOT_INODE
        self.register(root)

        by_name = self._mkdirs(root, (".by-name",), root_mtime)
        by_digest = self._mkdirs(root, (".by-digest",), root_mtime)
        blobs = self._mkdirs(root, (".blobs",), root_mtime)
        blobs._fill = self._fill_blobs

        # The model directories under .by-name/ and .by-digest/ are made when those are
        # first looked into; what they will show is counted now (link counts, and their own:
        # a name's four parts and a digest never run into another model's directory).
        hidden: tuple[_Places, _Places] = ({}, {})
        entries = index.sorted_entries()
        fp = counts.fingerprint(index, entries, self.prefer, self.data, self.hex_of)
        if fp is not None:
            self._take_counts(counts.load(index, fp))
        for entry in entries:
            try:
                self._add_entry(root, entry)
                if self.known is None:  # else worked out when first looked into
                    self._add_hidden(hidden, entry)
            except Exception:
                # One model's oddity must not cost the user the whole view.
                log.exception("%s: not shown", entry.name)
        assert self.nodes is not None
        for inode, leaves in self.leaves.items():
            holder = self.nodes[inode]
            assert isinstance(holder, DirNode)
            holder._subdirs = len(leaves) + sum(
                isinstance(c, DirNode) for c in holder._children.values()
            )
        self.leaves = {}  # each holder's fill holds its own
        if self.known is None:
            for places, holder in zip(hidden, (by_name, by_digest), strict=True):
                holder._fill = functools.partial(self._fill_hidden, places)
            self.hidden_subdirs = (
                len({rel[0] for rel in hidden[0]}),
                len({rel[0] for rel in hidden[1]}),
            )
        else:
            for which, holder in enumerate((by_name, by_digest)):
                holder._fill = functools.partial(self._fill_hidden_later, entries, which)
            self.hidden_subdirs = self.known.hidden_subdirs
        by_name._subdirs, by_digest._subdirs = self.hidden_subdirs
        self.add_tool_tops(root, root_mtime)
        if self.known is None:
            self._count_places()
            if fp is not None:
                counts.save(index, fp, self._counts())
        for key, merged in self.merged_nodes.items():
            merged.links = self.merged_links.get(key, 1)
        nodes, self.nodes = self.nodes, None
        return NameTree(root, nodes, self.blob_nodes, self)

    def _fill_blobs(self, blobs: DirNode) -> None:
        for name in sorted(self.index.blob_names):
            node = self._blob(Digest(name.removeprefix("sha256-")), "")
            if node is not None:
                blobs._children[name] = node

    # -- helpers -------------------------------------------------------------------------
    def _dir(
        self, path: tuple[str, ...], mtime_ns: int, xattrs: dict[str, bytes] | None = None
    ) -> DirNode:
        node = DirNode(self.inodes.get(("dir", path)), mtime_ns, xattrs or {}, path=path)
        self.register(node)
        return node

    def _mkdirs(self, parent: DirNode, rel: Iterable[str], mtime_ns: int) -> DirNode:
        """The directory `rel` below `parent`, made as needed; _Clash if a file is in the way."""
        node = parent
        for part in rel:
            child = node._children.get(part)
            if child is None:
                if part in self.leaves.get(node.inode, ()):
                    raise _Clash(part)  # a model directory, made when `node` is filled
                child = self._dir((*node.path, part), mtime_ns)
                node._children[part] = child
            elif not isinstance(child, DirNode) or child.is_model:
                # Never into another model's directory: `llama3/8b/q4` must not appear inside
                # the library model `llama3:8b`.
                raise _Clash(part)
            child.mtime_ns = max(child.mtime_ns, mtime_ns)
            node = child
        return node

    def _blob(self, digest: Digest, media_type: str) -> BlobNode | None:
        """The one node of a present blob (shared by every path that shows it)."""
        node = self.blob_nodes.get(digest)
        if node is not None:
            return node
        info = self.index.blob_info(digest)
        if info is None:
            return None
        # Made after the build, when a directory showing it is filled: what it is shown as
        # and in how many model directories was worked out by the build (fsd.counting).
        media_type = self.media.get(digest.hex, media_type)
        node = BlobNode(
            self.inodes.get(("blob", digest)),
            int(info.mtime * 1e9),
            {"user.modelfs.digest": str(digest).encode()},
            digest=digest,
            blobs_dir=self.index.layout.blobs,
            blob_size=info.size,
            media_type=media_type,
            gguf=digest.hex in self.gguf_blobs,
            links=1 + self.place_links.get(digest.hex, 0),  # .blobs/ shows every present blob
        )
        if self.data != "symlink":
            node._count = self.count_ref  # the tool layouts' places, added when first asked
        if media_type:
            node.xattrs["user.modelfs.media_type"] = media_type.encode()
        # One node however many threads fill directories showing it at once.
        made = self.blob_nodes.setdefault(digest, node)
        if made is node:
            self.register(node)
        return made

    def _layer_blob(self, f: ModelFile, path: str) -> BlobNode | None:
        """The node of a layer's blob when present at the size the manifest says, typed."""
        blob = self._blob(f.layer.digest, f.layer.media_type)
        if blob is None or blob.size != f.layer.size:
            return None
        if not blob.media_type:
            blob.media_type = f.layer.media_type
            blob.xattrs["user.modelfs.media_type"] = f.layer.media_type.encode()
        if path.endswith(".gguf"):
            blob.gguf = True  # its header-derived xattrs are read on first getxattr
        return blob

    def _plan(self, manifest: Manifest) -> ModelPlan:
        plan = self.plans.get(manifest.digest)
        if plan is not None:
            return plan
        files = model_files(manifest)
        shown: list[tuple[ModelFile, BlobNode]] = []
        missing: list[str] = []
        subdirs = {".ollama"}
        for f in files:
            blob = self._layer_blob(f, f.path)
            if blob is None:
                missing.append(f"missing blob {f.layer.digest} ({f.path})")
                continue
            shown.append((f, blob))
            top, sep, _ = f.path.partition("/")
            if sep:
                subdirs.add(top)
        config = None
        if manifest.config is not None:
            if self.index.blob_info(manifest.config.digest) is None:
                missing.append(f"missing blob {manifest.config.digest} (.ollama/config.json)")
            else:
                config = self._blob(manifest.config.digest, manifest.config.media_type)
        plan = ModelPlan(files, shown, missing, config, len(subdirs), _tensor_key(files))
        return self.plans.setdefault(manifest.digest, plan)

    def _file_node(self, blob: BlobNode) -> Node:
        if self.data == "symlink":
            target = str(blob.path).encode()
            link = SymlinkNode(
                self.inodes.get(("link", target)), blob.mtime_ns, dict(blob.xattrs), target=target
            )
            self.register(link)
            return link
        return blob

    def _bytes(self, path: tuple[str, ...], data: bytes, mtime_ns: int) -> BytesNode:
        # bytes hash once per object and the same objects recur (manifest bytes, Modelfiles).
        key = ("bytes", path, data)
        node = BytesNode(self.inodes.get(key), mtime_ns, data=data)
        self.register(node)
        return node

    # -- other tools' layouts (fsd.tool_dirs) -----------------------------------------
    def _known_tensor_names(self, f: ModelFile) -> tuple[list[str], int] | None:
        """The tensor names of a blob read at an earlier build; Deferred for any other, so
        that a build reads no header (one of 100 MB takes seconds and 500 MB)."""
        known = self.builder.tensor_names
        if f.layer.digest not in known:
            raise Deferred
        return known[f.layer.digest]

    def _read_tensor_names(self, f: ModelFile) -> tuple[list[str], int] | None:
        """A tensor blob's names, read; kept for the next builds when its header is small."""
        digest = f.layer.digest
        known = self.builder.tensor_names
        if digest in known:
            return known[digest]
        read = None
        try:
            header = read_safetensors_header_path(self.index.layout.blob(digest))
            read = ([t.name for t in header.tensors], header.data_size)
            small = header.header_len <= EAGER_HEADER_BYTES
        except (OSError, StoreError):
            small = True
        if small:
            known[digest] = read
        return read

    def _index_of(self, shards: tuple[tuple[str, ModelFile], ...]) -> bytes | None:
        """The index of these shards, made once per mount however many ask at once."""
        key = tuple(f.layer.digest for _, f in shards)
        with self.builder.merge_locks.setdefault(key, threading.Lock()):
            if key not in self.builder.indexes:
                data = safetensors_index(shards, self._read_tensor_names)
                self.builder.indexes[key] = data
                heap.trim()  # a big header's names are let go
        return self.builder.indexes[key]

    def _fill_index(
        self,
        name: str,
        path: tuple[str, ...],
        shards: tuple[tuple[str, ModelFile], ...],
        mtime_ns: int,
        holder: DirNode,
    ) -> None:
        data = self._index_of(shards)
        if data is None:
            log.warning("%s: not shown: a shard's header cannot be read", "/".join(path))
            return
        holder._children[name] = self._bytes(path, data, mtime_ns)

    # -- model directories ---------------------------------------------------------------
    def _add_entry(self, root: DirNode, entry: Entry) -> None:
        """A tag's model directories under its short name (`name/tag`, `name/tag@runner`)."""
        name = entry.name
        preferred = entry.preferred(self.prefer)
        if preferred is not None:
            self._place(root, short_path(name), entry, preferred)
        for v in entry.variants:
            if v.from_list and v.runner:
                parts = short_path(name)
                self._place(root, (*parts[:-1], f"{parts[-1]}@{v.runner}"), entry, v)

    def _add_hidden(self, hidden: tuple[_Places, _Places], entry: Entry) -> None:
        """... and under .by-name/ and .by-digest/, placed when those are first looked into:
        a name's four parts and a digest never run into another model's directory."""
        by_name, by_digest = hidden
        canonical = entry.name.legacy_parts()
        preferred = entry.preferred(self.prefer)
        if preferred is not None:
            self._defer(by_name, canonical, entry, preferred)
            self._defer(by_digest, (self.hex_of(entry.top),), entry, preferred)
        for v in entry.variants:
            if v.from_list and v.runner:
                self._defer(by_name, (*canonical[:-1], f"{canonical[-1]}@{v.runner}"), entry, v)
            self._defer(by_digest, (self.hex_of(v.manifest),), entry, v)

    def _fill_hidden_later(self, entries: list[Entry], which: int, top: DirNode) -> None:
        """Fill .by-name/ (0) or .by-digest/ (1) of a build that took its counts (fsd.counts),
        which worked out no place there: both tops' places in one pass, the other's kept for
        it until it is filled."""
        hidden = self.hidden_later
        if hidden is None:
            hidden = self.hidden_later = ({}, {})
            for entry in entries:
                try:
                    self._add_hidden(hidden, entry)
                except Exception:
                    log.exception("%s: not shown", entry.name)
        self._fill_hidden(hidden[which], top)
        hidden[which].clear()  # placed: nothing to keep for it

    def _defer(self, places: _Places, rel: tuple[str, ...], entry: Entry, v: Variant) -> None:
        """A model directory to place when its top (.by-name/, .by-digest/) is filled; its
        links counted now. First come wins, as in `_place`."""
        if rel not in places:
            places[rel] = (entry, v)
            self._count_place(v)

    def _fill_hidden(self, places: _Places, top: DirNode) -> None:
        for rel, (entry, v) in places.items():
            try:
                self._place(top, rel, entry, v, counted=True)
            except Exception:
                log.exception("%s: not shown", entry.name)

    def _place(
        self,
        parent: DirNode,
        rel: tuple[str, ...],
        entry: Entry,
        v: Variant,
        *,
        counted: bool = False,
    ) -> None:
        try:
            holder = self._mkdirs(parent, rel[:-1], entry.modified_ns)
        except _Clash as clash:
            log.info("%s: %r is a file in another model; see .by-name/", entry.name, clash.args[0])
            return
        name = rel[-1]
        leaves = self.leaves.get(holder.inode) if self.nodes is not None else None
        if name in holder._children or (leaves is not None and name in leaves):
            # First come wins (newest first); every model stays reachable under .by-name/.
            return
        if self.nodes is not None:
            # Made when its holder is first looked into (`_fill_leaves`): 9,000 model
            # directories made at once were half a build of 5,000 models.
            if leaves is None:
                leaves = self.leaves[holder.inode] = {}
                holder._fill = functools.partial(self._fill_leaves, leaves)
            leaves[name] = (entry, v)
        else:
            holder._children[name] = self._model_dir(holder, name, entry, v)
        if not counted:
            self._count_place(v)

    def _fill_leaves(self, leaves: dict[str, tuple[Entry, Variant]], holder: DirNode) -> None:
        for name, (entry, v) in leaves.items():
            try:
                holder._children[name] = self._model_dir(holder, name, entry, v)
            except Exception:
                log.exception("%s: not shown", entry.name)

    def _model_dir(self, holder: DirNode, name: str, entry: Entry, v: Variant) -> DirNode:
        """The model directory `name` in `holder`, to be filled on first use."""
        manifest = v.manifest
        xattrs = {
            "user.modelfs.name": entry.name.full.encode(),
            # The manifest this directory serves (a list's child, as `.ollama/digest`), and
            # the tag's own digest, whose first 12 digits are the ID `ls` and `show` give.
            "user.modelfs.manifest_digest": f"sha256:{self.hex_of(manifest)}".encode(),
            "user.modelfs.tag_digest": f"sha256:{self.hex_of(entry.top)}".encode(),
        }
        d = self._dir((*holder.path, name), entry.modified_ns, xattrs)
        d.is_model = True
        tensors = self._tensors_of(manifest)
        # Filled on first use; nothing here reads a blob or makes its plan. Tensor blobs'
        # headers are read first, in a worker thread (`_prepare_merged`): the request loop
        # answers other lookups meanwhile.
        d._fill = functools.partial(self._fill_lazy, entry, v)
        d._count_subdirs = functools.partial(self._subdirs_of, v)
        if tensors and tensors not in self.merged:
            d._prepare = functools.partial(self._prepare_merged, manifest)
        return d

    def _fill_lazy(self, entry: Entry, v: Variant, d: DirNode) -> None:
        try:
            self._fill_model(entry, v, d)
        except Exception:
            # Served as far as it got; the mount goes on.
            log.exception("%s: %s not filled", entry.name, "/".join(d.path))

    def _fill_model(self, entry: Entry, v: Variant, d: DirNode) -> None:
        path = d.path
        manifest = v.manifest
        mtime = entry.modified_ns
        plan = self._plan(manifest)
        files = plan.files
        for f, blob in plan.shown:
            node = self._file_node(blob)
            parts = f.path.split("/")
            try:
                holder = self._mkdirs(d, parts[:-1], mtime) if len(parts) > 1 else d
            except _Clash:
                continue
            holder._children[parts[-1]] = node
        status = list(plan.missing)
        if "model.gguf" in d._children:
            status += self._add_compat(d, plan, v, mtime)
        safetensors = any(f.layer.kind == "tensor" for f in files)
        if safetensors:
            key = _tensor_key(files)
            unread = self._unread_single(key)
            merged = unread or self._merged_view(files)
            if isinstance(merged, MergedSafetensors):
                node = self._merged_node(key, merged, mtime)
                if unread is not None and node.check is None:
                    node.check = functools.partial(self._check_single, key)
                d._children["model.safetensors"] = node
            elif merged:
                status.append(f"model.safetensors not shown: {merged}")
        d._children["Modelfile"] = self._bytes(
            (*path, "Modelfile"),
            self._modelfile(entry.name.shortest, manifest.digest, files, safetensors),
            mtime,
        )
        meta = self._mkdirs(d, (".ollama",), mtime)
        meta._children["manifest.json"] = self._bytes(
            (*path, ".ollama", "manifest.json"), manifest.raw, mtime
        )
        if plan.config is not None:
            meta._children["config.json"] = plan.config
        meta._children["digest"] = self._bytes(
            (*path, ".ollama", "digest"), f"{manifest.digest}\n".encode(), mtime
        )
        text = "\n".join(status) if status else "ok"
        meta._children["status"] = self._bytes(
            (*path, ".ollama", "status"), (text + "\n").encode(), mtime
        )

    def _modelfile(
        self, display: str, digest: Digest, files: list[ModelFile], safetensors: bool
    ) -> bytes:
        key = (digest, display)
        text = self.modelfiles.get(key)
        if text is None:
            text = render_modelfile(display, files, self._read_text, safetensors=safetensors)
            self.modelfiles[key] = text
        return text

    def _read_text(self, f: ModelFile) -> str | None:
        digest = f.layer.digest
        if digest not in self.texts:
            self.texts[digest] = self._read_text_uncached(f)
        return self.texts[digest]

    def _read_text_uncached(self, f: ModelFile) -> str | None:
        info = self.index.blob_info(f.layer.digest)
        # Trust the blob's real size, not the manifest's claim, before reading it whole.
        if info is None or info.size != f.layer.size or info.size > MAX_TEXT_BYTES:
            return None
        try:
            with open_binary(self.index.layout.blob(f.layer.digest)) as fh:
                data = fh.read(MAX_TEXT_BYTES + 1)
        except OSError:
            return None
        return clean_text(data[:MAX_TEXT_BYTES].decode("utf-8", "replace"))

    def _merge_is_heavy(self, key: tuple[Digest, ...]) -> bool:
        """Whether the merged view of these tensor blobs is still to be made and would read
        more than EAGER_HEADER_BYTES of headers (from each blob's 8-byte length prefix)."""
        if not key or key in self.merged:
            return False
        heavy = self.heavy.get(key)
        if heavy is None:
            total = 0
            for digest in key:
                info = self.index.blob_info(digest)
                if info is None:
                    continue  # made at once: "a tensor blob is missing"
                try:
                    total += read_header_length(self.index.layout.blob(digest))
                except OSError:
                    continue  # its error is the merge's to report
                if total > EAGER_HEADER_BYTES:
                    break
            heavy = self.heavy[key] = total > EAGER_HEADER_BYTES
        return heavy

    def _unread_single(self, key: tuple[Digest, ...]) -> MergedSafetensors | None:
        """The `model.safetensors` of one tensor blob whose header is too big to read now: the
        blob as it is, at its size (what its merge is when the header is sound), not read
        until `_check_single` runs at the first open. None for anything else."""
        if len(key) != 1 or not self._merge_is_heavy(key):
            return None
        info = self.index.blob_info(key[0])
        if info is None:
            return None
        path = self.index.layout.blob(key[0])
        return MergedSafetensors(
            b"", (Segment(0, path, 0, info.size),) if info.size else (), info.size
        )

    def _check_single(self, key: tuple[Digest, ...]) -> None:
        """Check the header of an unread single tensor blob (see `_unread_single`), once per
        mount however many opens ask at once; OSError(EIO) saying what is wrong with it."""
        with self.builder.merge_locks.setdefault(key, threading.Lock()):
            result = self.merged.get(key)
            if result is None:
                path = self.index.layout.blob(key[0])
                try:
                    # Parsed to be checked, then let go: the file is served as it is.
                    result = merge_safetensors([(path, read_safetensors_header_path(path))])
                except (OSError, StoreError) as exc:
                    result = str(exc)
                self.merged[key] = result
                heap.trim()  # the parse held a few hundred MB, all freed now
        if isinstance(result, str):
            raise OSError(errno.EIO, f"model.safetensors not served: {result}")

    def _subdirs_of(self, v: Variant) -> int:
        plan = self._plan(v.manifest)
        return plan.subdirs + (1 if self._shows_compat(plan, v) else 0)

    def _prepare_merged(self, manifest: Manifest) -> None:
        """Read what the directory's `model.safetensors` needs, in a worker thread: the header
        lengths, then the headers to merge, but for one big tensor blob, whose header is
        checked at its first open (`_unread_single`)."""
        files = self._plan(manifest).files
        key = _tensor_key(files)
        if self._merge_is_heavy(key) and len(key) == 1:
            return
        with self.builder.merge_locks.setdefault(key, threading.Lock()):
            self._merged_view(files)

    def _merged_view(self, files: list[ModelFile]) -> MergedSafetensors | str:
        tensors = [f for f in files if f.layer.kind == "tensor"]
        key = _tensor_key(files)
        if key in self.merged:
            return self.merged[key]
        result: MergedSafetensors | str
        if any(self.index.blob_info(d) is None for d in key):
            result = "a tensor blob is missing"
        else:
            try:
                parts = []
                for f in tensors:
                    path = self.index.layout.blob(f.layer.digest)
                    parts.append((path, read_safetensors_header_path(path)))
                result = merge_safetensors(parts)
            except (OSError, StoreError) as exc:
                result = str(exc)
        self.merged[key] = result
        return result

    def _merged_node(
        self, tensors: tuple[Digest, ...], merged: MergedSafetensors, mtime_ns: int
    ) -> MergedNode:
        node = self.merged_nodes.get(tensors)
        if node is None:
            key = ("merged", tuple(s.path.name for s in merged.segments), len(merged.header))
            node = MergedNode(
                self.inodes.get(key),
                mtime_ns,
                merged=merged,
                links=self.merged_links.get(tensors, 1),  # final once the build has run
            )
            self.merged_nodes[tensors] = node
            self.register(node)
        return node


def _tensor_key(files: list[ModelFile]) -> tuple[Digest, ...]:
    """The tensor blobs of a model, in order: what its `model.safetensors` is made of."""
    return tuple(f.layer.digest for f in files if f.layer.kind == "tensor")


# Model directories to place under one top, by their path below it.
_Places = dict[tuple[str, ...], tuple[Entry, Variant]]


class _Clash(Exception):
    """A path part that is a file where a directory is needed."""


def short_path(name: Name) -> tuple[str, ...]:
    """Ollama's shortest name with ':' as '/': `gemma4/26b`, `user/m/t`, `host/ns/m/t`."""
    if not name.is_default_host:
        return (name.host, name.namespace, name.model, name.tag)
    if name.namespace.lower() != "library":
        return (name.namespace, name.model, name.tag)
    return (name.model, name.tag)
