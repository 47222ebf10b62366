"""The name tree a mount shows, built from a store scan (DESIGN §3).

A tree is immutable; a change in the store builds a new one. Inode numbers come from an
`InodeTable` that lives as long as the mount, keyed by what a node *is* (a directory's path, a
blob's digest, a small file's path and bytes), so an unchanged path keeps its inode across
rebuilds and an inode never changes meaning, which lets `forget` be a no-op and lets an open
file keep its bytes when its tag moves.
"""

from __future__ import annotations

import functools
import gc
import logging
import stat
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from store.compat import (
    COMPATIBLE_RUNNERS,
    CompatViews,
    ComputeCache,
    GGUFView,
    compat_views,
    may_need_view,
)
from store.digest import Digest
from store.errors import StoreError
from store.files import ModelFile, model_files
from store.manifest import clean_text
from store.names import Name
from store.safetensors import read_safetensors_header_path
from store.scan import DEFAULT_PREFER, Entry, StoreIndex, Variant
from store.views import MergedSafetensors, merge_safetensors, read_merged, render_modelfile

log = logging.getLogger(__name__)

ROOT_INODE = 1
MAX_TEXT_BYTES = 1 << 20  # templates, licenses, params shown inside a Modelfile


class InodeTable:
    """Stable inode numbers for the life of a mount; never reused."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, int] = {}
        self._next = ROOT_INODE + 1

    def get(self, key: Hashable) -> int:
        ino = self._by_key.get(key)
        if ino is None:
            ino = self._next
            self._next += 1
            self._by_key[key] = ino
        return ino


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
    children: dict[str, Node] = field(default_factory=dict)
    is_model: bool = False
    mode = stat.S_IFDIR | 0o555

    @property
    def size(self) -> int:
        return 4096


@dataclass(eq=False)
class BlobNode(Node):
    """A file whose bytes are one blob, served from the blob file."""

    digest: Digest = field(default=Digest("0" * 64))
    path: Path = field(default=Path())
    blob_size: int = 0
    media_type: str = ""
    gguf: bool = False

    @property
    def size(self) -> int:
        return self.blob_size


@dataclass(eq=False)
class BytesNode(Node):
    """A small file synthesized in memory."""

    data: bytes = b""

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(eq=False)
class MergedNode(Node):
    """`model.safetensors`: a merged header, data read from many blobs."""

    merged: MergedSafetensors | None = None

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


@dataclass
class NameTree:
    root: DirNode
    nodes: dict[int, Node]
    blob_nodes: dict[Digest, BlobNode]


class TreeBuilder:
    """Builds a NameTree from a StoreIndex. `data` is "fuse" (serve bytes) or "symlink"."""

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
        self._merged: dict[tuple[Digest, ...], MergedSafetensors | str] = {}
        # So do llama.cpp views of GGUF blobs (None: the blob needs none).
        self._compat: dict[Digest, CompatViews | str | None] = {}
        self._compute_cache: ComputeCache | None = None

    # -- public --------------------------------------------------------------------------
    def build(self, index: StoreIndex) -> NameTree:
        # A build makes ~20 objects per model and keeps them all; the cyclic collector would
        # walk them again and again while they are being made, for nothing.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._build(index)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _build(self, index: StoreIndex) -> NameTree:
        self.index = index
        # Every model is placed up to three times (short name, .by-name, .by-digest); what
        # depends only on a manifest or a blob is computed once per build.
        self._files: dict[Digest, list[ModelFile]] = {}
        self._texts: dict[Digest, str | None] = {}
        self._modelfiles: dict[tuple[Digest, str], bytes] = {}
        self.nodes: dict[int, Node] = {}
        self.blob_nodes: dict[Digest, BlobNode] = {}
        root_mtime = max((e.mtime_ns for e in index), default=0)
        root = self._dir((), root_mtime)
        self.nodes[ROOT_INODE] = root
        root.inode = ROOT_INODE

        by_name = self._mkdirs(root, (".by-name",), root_mtime)
        by_digest = self._mkdirs(root, (".by-digest",), root_mtime)
        blobs = self._mkdirs(root, (".blobs",), root_mtime)

        for entry in index.sorted_entries():
            try:
                self._add_entry(root, by_name, by_digest, entry)
            except Exception:
                # One model's oddity must not cost the user the whole view.
                log.exception("%s: not shown", entry.name)
        for name in sorted(index.blob_names):
            digest = Digest.parse(name)
            node = self._blob(digest, "")
            if node is not None:
                _attach(blobs, name, node)
        return NameTree(root, self.nodes, self.blob_nodes)

    # -- helpers -------------------------------------------------------------------------
    def _register(self, node: Node) -> None:
        self.nodes[node.inode] = node

    def _dir(
        self, path: tuple[str, ...], mtime_ns: int, xattrs: dict[str, bytes] | None = None
    ) -> DirNode:
        node = DirNode(self.inodes.get(("dir", path)), mtime_ns, xattrs or {}, path=path)
        self._register(node)
        return node

    def _mkdirs(self, parent: DirNode, rel: Iterable[str], mtime_ns: int) -> DirNode:
        """The directory `rel` below `parent`, made as needed; _Clash if a file is in the way."""
        node = parent
        for part in rel:
            child = node.children.get(part)
            if child is None:
                child = self._dir((*node.path, part), mtime_ns)
                node.children[part] = child
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
        node = BlobNode(
            self.inodes.get(("blob", digest)),
            int(info.mtime * 1e9),
            {"user.modelfs.digest": str(digest).encode()},
            digest=digest,
            path=self.index.layout.blob(digest),
            blob_size=info.size,
            media_type=media_type,
            links=0,
        )
        if media_type:
            node.xattrs["user.modelfs.media_type"] = media_type.encode()
        self.blob_nodes[digest] = node
        self._register(node)
        return node

    def _file_node(self, dir_path: tuple[str, ...], f: ModelFile) -> Node | None:
        blob = self._blob(f.layer.digest, f.layer.media_type)
        if blob is None or blob.size != f.layer.size:
            return None
        if not blob.media_type:
            blob.media_type = f.layer.media_type
            blob.xattrs["user.modelfs.media_type"] = f.layer.media_type.encode()
        if f.path.endswith(".gguf"):
            blob.gguf = True  # its header-derived xattrs are read on first getxattr
        if self.data == "symlink":
            target = str(blob.path).encode()
            link = SymlinkNode(
                self.inodes.get(("link", target)), blob.mtime_ns, dict(blob.xattrs), target=target
            )
            self._register(link)
            return link
        return blob

    def _bytes(self, path: tuple[str, ...], data: bytes, mtime_ns: int) -> BytesNode:
        # bytes hash once per object and the same objects recur (manifest bytes, Modelfiles).
        key = ("bytes", path, data)
        node = BytesNode(self.inodes.get(key), mtime_ns, data=data)
        self._register(node)
        return node

    # -- model directories ---------------------------------------------------------------
    def _add_entry(self, root: DirNode, by_name: DirNode, by_digest: DirNode, entry: Entry) -> None:
        name = entry.name
        canonical = name.legacy_parts()
        preferred = entry.preferred(self.prefer)
        if preferred is not None:
            self._place(by_name, canonical, entry, preferred)
            self._place(root, short_path(name), entry, preferred)
            self._place(by_digest, (entry.digest.hex,), entry, preferred)
        for v in entry.variants:
            if v.from_list and v.runner:
                parts = short_path(name)
                self._place(root, (*parts[:-1], f"{parts[-1]}@{v.runner}"), entry, v)
                self._place(by_name, (*canonical[:-1], f"{canonical[-1]}@{v.runner}"), entry, v)
            self._place(by_digest, (v.manifest.digest.hex,), entry, v)

    def _place(self, parent: DirNode, rel: tuple[str, ...], entry: Entry, v: Variant) -> None:
        try:
            holder = self._mkdirs(parent, rel[:-1], entry.mtime_ns)
        except _Clash as clash:
            log.info("%s: %r is a file in another model; see .by-name/", entry.name, clash.args[0])
            return
        if rel[-1] in holder.children:
            # First come wins (newest first); every model stays reachable under .by-name/.
            return
        holder.children[rel[-1]] = self._model_dir((*holder.path, rel[-1]), entry, v)

    def _model_dir(self, path: tuple[str, ...], entry: Entry, v: Variant) -> DirNode:
        manifest = v.manifest
        xattrs = {
            "user.modelfs.name": entry.name.full.encode(),
            "user.modelfs.manifest_digest": str(manifest.digest).encode(),
        }
        d = self._dir(path, entry.mtime_ns, xattrs)
        d.is_model = True
        files = self._files.get(manifest.digest)
        if files is None:
            files = self._files[manifest.digest] = model_files(manifest)
        status: list[str] = []
        for f in files:
            node = self._file_node(path, f)
            if node is None:
                status.append(f"missing blob {f.layer.digest} ({f.path})")
                continue
            parts = f.path.split("/")
            try:
                holder = self._mkdirs(d, parts[:-1], entry.mtime_ns)
            except _Clash:
                continue
            _attach(holder, parts[-1], node)
        if manifest.config is not None and self.index.blob_info(manifest.config.digest) is None:
            status.append(f"missing blob {manifest.config.digest} (.ollama/config.json)")
        model = next((f for f in files if f.path == "model.gguf"), None)
        if model is not None and "model.gguf" in d.children and v.runner not in COMPATIBLE_RUNNERS:
            problem = self._add_compat(d, model, entry.mtime_ns)
            if problem:
                status.append(f"llama.cpp/ not shown: {problem}")
        safetensors = any(f.layer.kind == "tensor" for f in files)
        if safetensors:
            merged = self._merged_view(files)
            if isinstance(merged, MergedSafetensors):
                d.children["model.safetensors"] = self._merged_node(path, merged, entry.mtime_ns)
            elif merged:
                status.append(f"model.safetensors not shown: {merged}")
        d.children["Modelfile"] = self._bytes(
            (*path, "Modelfile"),
            self._modelfile(entry.name.shortest, manifest.digest, files, safetensors),
            entry.mtime_ns,
        )
        meta = self._mkdirs(d, (".ollama",), entry.mtime_ns)
        meta.children["manifest.json"] = self._bytes(
            (*path, ".ollama", "manifest.json"), manifest.raw, entry.mtime_ns
        )
        if manifest.config is not None:
            config = self._blob(manifest.config.digest, manifest.config.media_type)
            if config is not None:
                _attach(meta, "config.json", config)
        meta.children["digest"] = self._bytes(
            (*path, ".ollama", "digest"), f"{manifest.digest}\n".encode(), entry.mtime_ns
        )
        text = "\n".join(status) if status else "ok"
        meta.children["status"] = self._bytes(
            (*path, ".ollama", "status"), (text + "\n").encode(), entry.mtime_ns
        )
        return d

    def _modelfile(
        self, display: str, digest: Digest, files: list[ModelFile], safetensors: bool
    ) -> bytes:
        key = (digest, display)
        text = self._modelfiles.get(key)
        if text is None:
            text = render_modelfile(display, files, self._read_text, safetensors=safetensors)
            self._modelfiles[key] = text
        return text

    def _read_text(self, f: ModelFile) -> str | None:
        digest = f.layer.digest
        if digest not in self._texts:
            self._texts[digest] = self._read_text_uncached(f)
        return self._texts[digest]

    def _read_text_uncached(self, f: ModelFile) -> str | None:
        info = self.index.blob_info(f.layer.digest)
        # Trust the blob's real size, not the manifest's claim, before reading it whole.
        if info is None or info.size != f.layer.size or info.size > MAX_TEXT_BYTES:
            return None
        try:
            with open(self.index.layout.blob(f.layer.digest), "rb") as fh:
                data = fh.read(MAX_TEXT_BYTES + 1)
        except OSError:
            return None
        return clean_text(data[:MAX_TEXT_BYTES].decode("utf-8", "replace"))

    def _merged_view(self, files: list[ModelFile]) -> MergedSafetensors | str:
        tensors = [f for f in files if f.layer.kind == "tensor"]
        key = tuple(f.layer.digest for f in tensors)
        if key in self._merged:
            return self._merged[key]
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
        self._merged[key] = result
        return result

    def compat_views(self, digest: Digest) -> CompatViews | str | None:
        """The llama.cpp views of a GGUF blob, an error text, or None (none needed)."""
        if digest in self._compat:
            return self._compat[digest]
        path = self.index.layout.blob(digest)
        result: CompatViews | str | None = None
        if may_need_view(path):
            try:
                result = compat_views(path, digest.hex)
            except (OSError, StoreError, ValueError) as exc:
                log.warning("%s: no llama.cpp view: %s", digest, exc)
                result = str(exc)
        self._compat[digest] = result
        return result

    def _add_compat(self, d: DirNode, f: ModelFile, mtime_ns: int) -> str | None:
        views = self.compat_views(f.layer.digest)
        if not isinstance(views, CompatViews):
            return views
        if self._compute_cache is None:
            self._compute_cache = ComputeCache(self.index.layout.compat)
        holder = self._mkdirs(d, ("llama.cpp",), mtime_ns)
        for view in (views.model, views.mmproj):
            if view is None:
                continue
            node = CompatNode(
                self.inodes.get(("compat", f.layer.digest, view.kind)),
                mtime_ns,
                {
                    "user.modelfs.compat.source": str(f.layer.digest).encode(),
                    "user.modelfs.compat.handler": view.handler.encode(),
                },
                digest=f.layer.digest,
                path=view.source,
                view=view,
                cache=self._compute_cache,
            )
            self._register(node)
            holder.children[f"{view.kind}.gguf"] = node
        return None

    def _merged_node(
        self, path: tuple[str, ...], merged: MergedSafetensors, mtime_ns: int
    ) -> MergedNode:
        key = ("merged", tuple(s.path.name for s in merged.segments), len(merged.header))
        node = MergedNode(self.inodes.get(key), mtime_ns, merged=merged)
        self._register(node)
        return node


def _attach(parent: DirNode, name: str, node: Node) -> None:
    parent.children[name] = node
    if isinstance(node, BlobNode):
        node.links += 1  # a blob node is shared by every place that shows it, in one build


class _Clash(Exception):
    """A path part that is a file where a directory is needed."""


def short_path(name: Name) -> tuple[str, ...]:
    """Ollama's shortest name with ':' as '/': `gemma4/26b`, `user/m/t`, `host/ns/m/t`."""
    if not name.is_default_host:
        return (name.host, name.namespace, name.model, name.tag)
    if name.namespace.lower() != "library":
        return (name.namespace, name.model, name.tag)
    return (name.model, name.tag)
