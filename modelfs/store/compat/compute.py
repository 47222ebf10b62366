"""Tensors whose bytes must change, made from source bytes on first read and cached.

Each op mirrors an upstream load op (ollama/ollama `llama/compat/`); the cache lives in
`<store>/.modelfs/compat/<source hex>/` (modelfs's own state, modelfs/store/layout.py), one file per
tensor, written to a temp name and renamed when whole, so a reader never sees half a file.
Where the store cannot be written (read-only stores exist), the bytes are kept in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from modelfs.store.compat.draft import GGML_BF16, GGML_F16, GGML_F32, Compute
from modelfs.store.disk.owner import write_atomic

if TYPE_CHECKING:
    # numpy is imported where a tensor is computed, so a mount that computes none never loads it.
    import numpy as np
    from numpy.typing import NDArray

log = logging.getLogger(__name__)

CACHE_VERSION = "v1"  # bump when an op's output changes, so old cache files are not served

ReadAt = Callable[[int, int], bytes]  # (absolute offset, length) -> source bytes


def _f16_to_f32(read: ReadAt, c: Compute) -> bytes:
    """promote_tensor_to_f32 (llama-ollama-compat-util.cpp): F16 widened to F32."""
    import numpy as np

    ((offset, length),) = c.sources
    return np.frombuffer(read(offset, length), dtype="<f2").astype("<f4").tobytes()


def _to_f32(data: bytes, ggml_type: int, n: int) -> NDArray[np.float32]:
    import numpy as np

    if ggml_type == GGML_F32:
        return np.frombuffer(data, dtype="<f4").copy()
    if ggml_type == GGML_F16:
        return np.frombuffer(data, dtype="<f2").astype("<f4")
    if ggml_type == GGML_BF16:
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    # Quantized norms are rare; ggml's to_float for them is what gguf's quants port does.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(np.frombuffer(data, dtype=np.uint8), GGMLQuantizationType(ggml_type))
    return out.reshape(-1)[:n].astype("<f4")


def _add_one_f32(read: ReadAt, c: Compute) -> bytes:
    """register_qwen35_norm_shift_load (llama-ollama-compat.cpp): to F32, then +1."""
    ((offset, length),) = c.sources
    (src_type,) = c.params
    values = _to_f32(read(offset, length), src_type, c.nbytes // 4)
    values += 1.0
    return values.tobytes()


def _patch_embed_slice(read: ReadAt, c: Compute) -> bytes:
    """register_qwen35moe_patch_embed_split / register_qwen3vl_patch_embed_split: one
    temporal slice of an F16 [w, h, frames, c_out*c_in] patch embedding as F32
    [w, h, c_in, c_out]. Source plane (slice, packed) lands at plane packed = c_out*c_in +
    c_in, which is the destination's plane order too, so it is a strided pick."""
    import numpy as np

    ((offset, length),) = c.sources
    slice_idx, plane, frames, packed = c.params
    src = np.frombuffer(read(offset, length), dtype="<f2").reshape(packed, frames, plane)
    return src[:, slice_idx, :].astype("<f4").tobytes()


def _concat_to_f32(read: ReadAt, c: Compute) -> bytes:
    """register_concat_load_to_f32 (llama-ollama-compat-util.cpp): each source to F32 by its
    own type (F16 q/k beside a Q8_0 v happens), the F32 arrays one after another. One
    source alone is a plain to-F32 conversion of any type."""
    import numpy as np

    parts = [
        _to_f32(read(offset, length), src_type, n)
        for (offset, length), (src_type, n) in zip(c.sources, c.params, strict=True)
    ]
    return np.concatenate(parts).astype("<f4").tobytes()


def _align_corners(side: int, source_side: int) -> NDArray[np.float64]:
    """nemotron3_align_corners for every target index: where it samples the source grid."""
    import numpy as np

    if side <= 1:
        return np.zeros(side)
    return np.arange(side, dtype=np.float64) * (source_side - 1) / (side - 1)


def _resample_positions(read: ReadAt, c: Compute) -> bytes:
    """register_nemotron3_position_embedding (llama-ollama-compat.cpp): a square grid of
    position embeddings resampled bilinearly (corners aligned, float weights as upstream)
    to target_side x target_side, as F32 ggml [embedding, target_side^2]. `layout` tells
    how the source holds (position, embedding): "ep" (embedding fastest) or "pe"."""
    import numpy as np

    ((offset, length),) = c.sources
    src_type, n, layout, embedding, positions, source_side, target_side = c.params
    src = _to_f32(read(offset, length), src_type, n)
    grid = np.asarray(src, dtype=np.float32)
    if layout == "ep":
        grid = grid.reshape(positions, embedding)
    else:
        grid = grid.reshape(embedding, positions).T
    grid = grid.reshape(source_side, source_side, embedding)

    def axis(
        side: int,
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float32]]:
        where = _align_corners(side, source_side)
        lo = np.floor(where).astype(np.int64)
        hi = np.minimum(lo + 1, source_side - 1)
        return lo, hi, (where - lo).astype(np.float32)

    y0, y1, wy = axis(target_side)
    x0, x1, wx = axis(target_side)
    one = np.float32(1.0)
    wx_, wy_ = wx[None, :, None], wy[:, None, None]
    top = grid[y0][:, x0] * (one - wx_) + grid[y0][:, x1] * wx_
    bottom = grid[y1][:, x0] * (one - wx_) + grid[y1][:, x1] * wx_
    out = top * (one - wy_) + bottom * wy_  # [y, x, embedding]: embedding fastest
    # numpy's stubs type fancy indexing (grid[y0]) as Any, so name what tobytes gives.
    data: bytes = out.astype("<f4").tobytes()
    return data


def _zeros(read: ReadAt, c: Compute) -> bytes:
    """The zero-fill load op (mistral3's img_break)."""
    return bytes(c.nbytes)


OPS: dict[str, Callable[[ReadAt, Compute], bytes]] = {
    "f16_to_f32": _f16_to_f32,
    "add_one_f32": _add_one_f32,
    "patch_embed_slice": _patch_embed_slice,
    "concat_to_f32": _concat_to_f32,
    "resample_positions": _resample_positions,
    "zeros": _zeros,
}
# Ops made as literal header-side bytes by build_view, never cached (nothing to read).
LITERAL_OPS = frozenset({"zeros"})


def cache_name(tensor: str, c: Compute) -> str:
    """A file name for one computed tensor: readable, and unique to the op and its inputs."""
    ident = repr((CACHE_VERSION, tensor, c.op, c.sources, c.params, c.nbytes)).encode()
    digest = hashlib.sha256(ident).hexdigest()[:16]
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in tensor)[:120]
    return f"{safe}.{c.op}.{digest}"


class ComputeCache:
    """Computed tensors of one mount (or one command): on disk under `root`, else memory.

    `root` is `<store>/.modelfs/compat`; None keeps everything in memory.
    """

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._memory: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()
        self._warned = False

    def path(self, source_hex: str, name: str) -> Path | None:
        return None if self.root is None else self.root / source_hex / CACHE_VERSION / name

    def get(
        self, source_hex: str, name: str, c: Compute, read: ReadAt
    ) -> tuple[Path | None, bytes]:
        """(cache file, b"") when the bytes are on disk, else (None, the bytes)."""
        key = (source_hex, name)
        path = self.path(source_hex, name)
        if path is not None:
            with contextlib.suppress(OSError):
                if path.stat().st_size == c.nbytes:
                    return path, b""
        with self._lock:
            held = self._memory.get(key)
            if held is not None:
                return None, held
            data = OPS[c.op](read, c)
            if len(data) != c.nbytes:
                raise ValueError(f"{name}: {c.op} made {len(data)} bytes, {c.nbytes} expected")
            if path is not None and self._store(path, data):
                return path, b""
            self._memory[key] = data
            return None, data

    def _store(self, path: Path, data: bytes) -> bool:
        try:
            # `root` is <store>/.modelfs/compat: what is made there belongs to the store's owner.
            store = self.root.parent.parent if self.root is not None else path.parent
            write_atomic(path, data, store)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning(
                    "cannot cache computed tensors in %s (%s); keeping them in memory",
                    path.parent,
                    exc.strerror or exc,
                )
                self._warned = True
            return False
