"""What each blob of a build's tree is shown as and how many places show it: its link count,
worked out from every manifest's layers when the build places the model directories, or taken
from the last build of the same store (fsd.counts). A part of fsd.builder._Build, as
fsd.compat_dirs and fsd.tool_dirs are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from modelfs.fsd.counts import Counts
from modelfs.fsd.plan import BuilderState, ModelShape
from modelfs.store.digest import Digest
from modelfs.store.index.lazy import HexOf
from modelfs.store.manifest import Manifest
from modelfs.store.scan import StoreIndex, Variant
from modelfs.store.tools.files import GGUF_NAMES, model_files


class Counting:
    """The counting part of one build (fsd.builder._Build, which holds this state)."""

    builder: BuilderState
    index: StoreIndex
    data: str
    merged_links: dict[tuple[Digest, ...], int]
    gguf_places: dict[Digest, int]
    projector_places: dict[Digest, list[Digest]]
    blob_repos: Mapping[str, Collection[tuple[str, ...]]] | None
    repos_kept: bool
    hex_of: HexOf

    if TYPE_CHECKING:

        def count_compat_place(
            self, model: Digest | None, projector: Digest | None, v: Variant
        ) -> None: ...

        def repos_of_blobs(self) -> Mapping[str, Collection[tuple[str, ...]]]: ...

    def init_counting(self) -> None:
        # By the blob's hex, for the blob nodes made after the build: how many model
        # directories show each blob, the media type it is first met as, and which are shown
        # as a .gguf file; or all of it taken from the last build of the same store, when
        # `known` is set.
        self.shapes: dict[Digest, ModelShape] = {}
        self.placed: dict[Digest, int] = {}  # model directories of each manifest
        self.place_links: dict[str, int] = {}
        self.media: dict[str, str] = {}
        self.gguf_blobs: set[str] = set()
        # The places that show each file made of several blobs (a merged model.safetensors).
        self.merged_links = {}
        self.gguf_places = {}
        self.projector_places = {}
        self.known: Counts | None = None
        self.hidden_subdirs = (0, 0)  # the link counts of .by-name/ and .by-digest/, less 2

    def _shape(self, manifest: Manifest) -> ModelShape:
        """What a model directory of `manifest` shows, for counting, from its layers: what its
        plan (`_plan`, made when the directory is filled) gives, without making one."""
        shape = self.shapes.get(manifest.digest)
        if shape is not None:
            return shape
        size_of = self.index.blob_size  # no stat per blob on a warm start
        media, gguf = self.media, self.gguf_blobs
        layers = manifest.layers
        kinds = [layer.kind for layer in layers]
        paths: list[str] = []
        if any(
            ".gguf" in k or (k == "json" and ".gguf" in (x.name or ""))
            for k, x in zip(kinds, layers, strict=True)
        ):
            # A json layer may take a GGUF's name, or be a .gguf file, and a layer of a kind
            # of its own is a file named after it (`.ollama/layers/3-x.gguf`): as the plan
            # names them.
            paths = [f.path for f in model_files(manifest)]
        else:
            for kind in kinds:
                path = GGUF_NAMES.get(kind, "")
                if path and path in paths:
                    path = f"-{path}"  # the next of a kind: model-2.gguf, still a .gguf file
                paths.append(path)
        shown: list[Digest] = []
        model = projector = None
        for layer, path in zip(layers, paths, strict=True):
            digest = layer.digest
            size = size_of(digest)
            if size is None:
                continue
            media.setdefault(digest.hex, layer.media_type)  # the first plan to meet it names it
            if size != layer.size:
                continue
            shown.append(digest)
            if path.endswith(".gguf"):
                gguf.add(digest.hex)
                if path == "model.gguf":
                    model = digest
                elif path == "mmproj.gguf":
                    projector = digest
        config = None
        if manifest.config is not None and size_of(manifest.config.digest) is not None:
            config = manifest.config.digest
            media.setdefault(config.hex, manifest.config.media_type)
        tensors = tuple(x.digest for k, x in zip(kinds, layers, strict=True) if k == "tensor")
        shape = ModelShape(tuple(shown), config, tensors, model, projector)
        self.shapes[manifest.digest] = shape
        return shape

    def _count_place(self, v: Variant) -> None:
        """Count a model directory in the link counts of what it shows (`_count_places` adds
        them up when the build ends; a blob's node starts from that). All are counted by the
        end of the build, filled or not, so no listing ever sees one move."""
        if self.known is not None:
            return  # counted by the build these counts were saved from
        digest = v.manifest.digest
        shape = self.shapes.get(digest) or self._shape(v.manifest)
        self.placed[digest] = self.placed.get(digest, 0) + 1
        if shape.model is not None:
            self.count_compat_place(shape.model, shape.projector, v)

    def _tensors_of(self, manifest: Manifest) -> tuple[Digest, ...]:
        """The tensor blobs of a model directory's `model.safetensors`."""
        if self.known is not None:
            return self.known.tensors.get(self.hex_of(manifest), ())
        return (self.shapes.get(manifest.digest) or self._shape(manifest)).tensors

    def _count_places(self) -> None:
        links = self.place_links
        for digest, n in self.placed.items():
            shape = self.shapes[digest]
            if self.data != "symlink":
                for blob in shape.shown:
                    links[blob.hex] = links.get(blob.hex, 0) + n
            if shape.config is not None:
                hex_ = shape.config.hex
                links[hex_] = links.get(hex_, 0) + n
            if shape.tensors:
                self.merged_links[shape.tensors] = self.merged_links.get(shape.tensors, 0) + n
        self.placed = {}  # all counted: a tree lives long, and no place is counted after

    def _counts(self) -> Counts:
        """What this build counted, to keep for the next (fsd.counts)."""
        return Counts(
            self.place_links,
            self.media,
            self.gguf_blobs,
            self.merged_links,
            self.gguf_places,
            self.projector_places,
            {d.hex: s.tensors for d, s in self.shapes.items() if s.tensors},
            self.hidden_subdirs,
            self.repos_of_blobs(),
        )

    def _take_counts(self, known: Counts | None) -> None:
        """Use the counts of the last build of the same store (`_count_place` then counts
        nothing); the earlier mounts' llama.cpp decisions of the GGUF blobs they count are
        marked as still met, as `count_compat_place` does."""
        if known is None:
            return
        self.known = known
        self.place_links, self.media, self.gguf_blobs = (
            known.place_links,
            known.media,
            known.gguf_blobs,
        )
        self.merged_links = known.merged_links
        self.gguf_places, self.projector_places = known.gguf_places, known.projector_places
        self.blob_repos, self.repos_kept = known.blob_repos, True
        decisions = self.builder.decisions
        if decisions is not None:
            for model in known.gguf_places:
                decisions.get("model", model)
            for projector in known.projector_places:
                decisions.get("mmproj", projector)
