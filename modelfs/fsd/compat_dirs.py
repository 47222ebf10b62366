"""The `llama.cpp/` directory of a model directory: which views of its GGUF blobs it shows
(decided once per blob, remembered across mounts in store.compat.decisions), the views
themselves, made on first use, and the `CompatNode`s that serve them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from modelfs.fsd.nodes import CompatNode, DirNode, InodeTable, Node
from modelfs.fsd.plan import BuilderState, ModelPlan
from modelfs.store.compat import (
    COMPATIBLE_RUNNERS,
    CompatViews,
    compat_views,
    may_need_mmproj_view,
    may_need_view,
    mmproj_view,
)
from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.scan import StoreIndex, Variant

if TYPE_CHECKING:  # imported when a view is first made (store.compat)
    from modelfs.store.compat import GGUFView

log = logging.getLogger(__name__)

_V = TypeVar("_V")


class CompatDirs:
    """The `llama.cpp/` part of one build (fsd.builder._Build, which holds this state)."""

    builder: BuilderState
    index: StoreIndex
    inodes: InodeTable
    compat: dict[Digest, CompatViews | str | None]
    mmproj: dict[Digest, GGUFView | str | None]
    compat_nodes: dict[tuple[Digest, str], CompatNode]
    # The model directories placed that may show `llama.cpp/`: how many hold each GGUF blob as
    # model.gguf, and the model.gguf beside each projector blob (mmproj.gguf), so that a view's
    # link count is worked out when it is made, without deciding anything at build time.
    gguf_places: dict[Digest, int]
    projector_places: dict[Digest, list[Digest]]
    # A blob that gets no view for an error is a warning the first time in a tree, and told
    # at debug level after that (`ls -lR` over a store of 3,000 GGUF files of a version
    # llama.cpp cannot read would log 3,000 warnings).
    view_error_told = False

    if TYPE_CHECKING:

        def register(self, node: Node) -> None: ...

        def _mkdirs(self, parent: DirNode, rel: Iterable[str], mtime_ns: int) -> DirNode: ...

    def compat_views(self, digest: Digest) -> CompatViews | str | None:
        """The llama.cpp views of a GGUF blob, an error text, or None (none needed)."""
        return self._view_of(self.compat, digest, may_need_view, compat_views)

    def mmproj_view(self, digest: Digest) -> GGUFView | str | None:
        """The llama.cpp view of a separate projector blob, an error text, or None."""
        return self._view_of(self.mmproj, digest, may_need_mmproj_view, mmproj_view)

    def _view_of(
        self,
        cache: dict[Digest, _V | str | None],
        digest: Digest,
        may_need: Callable[[Path], bool],
        make: Callable[[Path, str], _V | None],
    ) -> _V | str | None:
        """`make`'s view of a blob, once per mount; the error text when it cannot be made."""
        if digest in cache:
            return cache[digest]
        path = self.index.layout.blob(digest)
        result: _V | str | None = None
        if may_need(path):
            try:
                result = make(path, digest.hex)
            except (OSError, StoreError, ValueError) as exc:
                result = str(exc)
                self._tell_view_error(digest, result)
        cache[digest] = result
        return result

    def _compat_files(
        self, plan: ModelPlan, v: Variant
    ) -> tuple[list[tuple[Digest, GGUFView]], list[str]]:
        """The files of `llama.cpp/` (source blob, view) and why any is not shown: the views of
        model.gguf, and the projector's own view where the model has no clip view of its
        own. Nothing for a child made for llama.cpp."""
        if v.runner in COMPATIBLE_RUNNERS:
            return [], []
        shown = {f.path: f for f, _ in plan.shown}
        model, projector = shown.get("model.gguf"), shown.get("mmproj.gguf")
        if model is None:
            return [], []
        files: list[tuple[Digest, GGUFView]] = []
        problems: list[str] = []
        views = self.compat_views(model.layer.digest)
        if isinstance(views, CompatViews):
            files.append((model.layer.digest, views.model))
            if views.mmproj is not None:
                files.append((model.layer.digest, views.mmproj))
        elif views:
            problems.append(f"llama.cpp/ not shown: {views}")
        if projector is not None and not any(view.kind == "mmproj" for _, view in files):
            view = self.mmproj_view(projector.layer.digest)
            if view is not None and not isinstance(view, str):  # a GGUFView
                files.append((projector.layer.digest, view))
            elif view:
                problems.append(f"llama.cpp/mmproj.gguf not shown: {view}")
        return files, problems

    def _decision(self, kind: str, digest: Digest) -> str:
        """Whether a blob gets a view (see store.compat.decisions), without reading it when
        this mount or an earlier one decided already."""
        made = self.compat if kind == "model" else self.mmproj
        decisions = self.builder.decisions
        assert decisions is not None
        if digest not in made and (known := decisions.get(kind, digest)) is not None:
            return known
        result = self.compat_views(digest) if kind == "model" else self.mmproj_view(digest)
        if result is None:
            value = "none"
        elif isinstance(result, str):
            value = f"error: {result}"
        elif isinstance(result, CompatViews):
            value = "model+mmproj" if result.mmproj is not None else "model"
        else:
            value = "view"
        decisions.put(kind, digest, value)
        return value

    def _tell_view_error(self, digest: Digest, why: str) -> None:
        if not self.view_error_told:
            self.view_error_told = True
            log.warning("%s: no llama.cpp view: %s (any others: -v)", digest, why)
        else:
            log.debug("%s: no llama.cpp view: %s", digest, why)

    def make_views(self) -> int:
        decisions = self.builder.decisions
        made = 0
        for kind, digest in decisions.views() if decisions is not None else ():
            cache = self.compat if kind == "model" else self.mmproj
            if digest not in cache:
                (self.compat_views if kind == "model" else self.mmproj_view)(digest)
                made += 1
        return made

    def _compat_shape(
        self, plan: ModelPlan, v: Variant
    ) -> tuple[list[tuple[Digest, str]], list[str]]:
        """The files `llama.cpp/` will hold (source blob, kind), and why any view is not
        shown: `_compat_files` told from the decisions, so that nothing is read for a model
        decided before."""
        if v.runner in COMPATIBLE_RUNNERS:
            return [], []
        shown = {f.path: f for f, _ in plan.shown}
        model, projector = shown.get("model.gguf"), shown.get("mmproj.gguf")
        if model is None:
            return [], []
        files: list[tuple[Digest, str]] = []
        problems: list[str] = []
        decided = self._decision("model", model.layer.digest)
        if decided.startswith("error: "):
            problems.append(f"llama.cpp/ not shown: {decided.removeprefix('error: ')}")
        if decided.startswith("model"):
            files.append((model.layer.digest, "model"))
        if decided == "model+mmproj":
            files.append((model.layer.digest, "mmproj"))
        elif projector is not None:
            decided = self._decision("mmproj", projector.layer.digest)
            if decided.startswith("error: "):
                why = decided.removeprefix("error: ")
                problems.append(f"llama.cpp/mmproj.gguf not shown: {why}")
            if decided == "view":
                files.append((projector.layer.digest, "mmproj"))
        return files, problems

    def count_compat_place(
        self, model: Digest | None, projector: Digest | None, v: Variant
    ) -> None:
        """Count a model directory placed (see `gguf_places`) that shows `model` as model.gguf
        and `projector` as mmproj.gguf; what earlier mounts decided of these blobs is marked as
        still met, so that it is kept and its views made ahead."""
        if v.runner in COMPATIBLE_RUNNERS:
            return
        if model is None:
            return
        decisions = self.builder.decisions
        first = model not in self.gguf_places
        self.gguf_places[model] = self.gguf_places.get(model, 0) + 1
        if first and decisions is not None:
            decisions.get("model", model)
        if projector is not None:
            beside = self.projector_places.setdefault(projector, [])
            if not beside and decisions is not None:
                decisions.get("mmproj", projector)
            beside.append(model)

    def _compat_links(self, digest: Digest, kind: str) -> int:
        """How many places show the view (digest, kind): as `_compat_shape` would place it in
        every directory counted by `count_compat_place`."""
        links = 0
        if kind == "model" or self._decision("model", digest) == "model+mmproj":
            links += self.gguf_places.get(digest, 0)
        if (
            kind == "mmproj"
            and digest in self.projector_places
            and self._decision("mmproj", digest) == "view"
        ):
            beside = self.projector_places.get(digest, ())
            links += sum(self._decision("model", m) != "model+mmproj" for m in beside)
        return max(links, 1)

    def _shows_compat(self, plan: ModelPlan, v: Variant) -> bool:
        """Will the model directory hold `llama.cpp/`? (Its link count says so before it is
        filled.)"""
        return bool(self._compat_shape(plan, v)[0])

    def _add_compat(self, d: DirNode, plan: ModelPlan, v: Variant, mtime_ns: int) -> list[str]:
        """`llama.cpp/` in the model directory `d`, if it has one, filled on first use (the
        views are made then); its status lines."""
        shows, problems = self._compat_shape(plan, v)
        if shows:  # the files it will hold
            holder = self._mkdirs(d, ("llama.cpp",), mtime_ns)
            holder._fill = functools.partial(self._fill_compat, plan, v, mtime_ns)
        return problems

    def _fill_compat(self, plan: ModelPlan, v: Variant, mtime_ns: int, holder: DirNode) -> None:
        try:
            # The views of a blob decided at an earlier mount are made here, on first use.
            files, _ = self._compat_files(plan, v)
        except Exception:
            log.exception("%s: llama.cpp/ not filled", "/".join(holder.path))
            return
        if self.builder.compute_cache is None:
            from modelfs.store.compat.compute import ComputeCache

            self.builder.compute_cache = ComputeCache(self.index.layout.compat)
        for digest, view in files:
            key = (digest, view.kind)
            node = self.compat_nodes.get(key)
            if node is None:
                node = CompatNode(
                    self.inodes.get(("compat", digest, view.kind)),
                    mtime_ns,
                    {
                        "user.modelfs.compat.source": str(digest).encode(),
                        "user.modelfs.compat.handler": view.handler.encode(),
                    },
                    links=self._compat_links(digest, view.kind),
                    digest=digest,
                    path=view.source,
                    view=view,
                    cache=self.builder.compute_cache,
                )
                self.compat_nodes[key] = node
                self.register(node)
            holder._children[f"{view.kind}.gguf"] = node
