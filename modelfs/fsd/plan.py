"""What a model directory of one manifest holds, worked out once per build (fsd.builder), and
the builder state its `llama.cpp/` part (fsd.compat_dirs) reads: both below those two modules,
so neither imports the other to name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from modelfs.fsd.nodes import BlobNode
from modelfs.store.compat.decisions import Decisions
from modelfs.store.digest import Digest
from modelfs.store.tools.files import ModelFile

if TYPE_CHECKING:  # imported when a view is first made (store.compat)
    from modelfs.store.compat import ComputeCache


@dataclass
class ModelPlan:
    """What a model directory of one manifest holds, worked out once per build."""

    files: list[ModelFile]
    shown: list[tuple[ModelFile, BlobNode]]  # the blob-backed files, blob present, right size
    missing: list[str]  # status lines
    config: BlobNode | None
    subdirs: int
    tensors: tuple[Digest, ...]  # the tensor blobs its `model.safetensors` is made of


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model directory of one manifest shows, as a build counts it (`_shape`)."""

    shown: tuple[Digest, ...]  # the layers' blobs present at the size the manifest says
    config: Digest | None  # present
    tensors: tuple[Digest, ...]  # what its `model.safetensors` is made of
    model: Digest | None  # the blob shown as model.gguf
    projector: Digest | None  # ... as mmproj.gguf


class BuilderState(Protocol):
    """What outlives one build in fsd.builder.TreeBuilder and the compat views use."""

    decisions: Decisions | None
    compute_cache: ComputeCache | None
