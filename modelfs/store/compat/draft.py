"""The mutable translation of one GGUF header that handlers edit, like llama.cpp's in-memory
`gguf_context` + `ggml_context` that Ollama's compat layer edits at load time.

Nothing here reads tensor data. A KV either keeps its bytes in the source file (copied byte
for byte into the view) or carries a new value; a tensor's data is either a list of byte
ranges of the source (a plain tensor, or several concatenated or interleaved) or a
`Compute` (bytes that must change: a dtype promotion, a norm shift), made on first read.

The helper methods mirror `llama/compat/llama-ollama-compat-util.cpp` in ollama/ollama; each
names the upstream helper it follows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelfs.store.formats.gguf import (
    GGML_TYPES,
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_STRING,
    T_UINT32,
    ArraySummary,
    GGUFHeader,
    GGUFTensor,
    KVSpan,
    read_array,
    tensor_nbytes,
)

GGML_F32 = 0
GGML_F16 = 1
GGML_BF16 = 30

TOKEN_WINDOW = 32


@dataclass(frozen=True, slots=True)
class KVItem:
    """One KV of the view.

    `span`: the value's bytes are the source's, unchanged (the whole value, or with `keep`
    set, the first `keep` items of a source array, re-headed with `item_type`).
    `value`: the decoded value (a list, scalar, or ArraySummary for a long source array).
    """

    vtype: int
    value: Any
    item_type: int = -1
    span: KVSpan | None = None
    keep: int | None = None


@dataclass(frozen=True, slots=True)
class Compute:
    """Tensor bytes that differ from the source: made by `op` from source byte ranges.

    `op` is a key of store.compat.compute.OPS; `params` are plain values (hashable), so a
    Compute names its own cache file.
    """

    op: str
    sources: tuple[tuple[int, int], ...]  # (absolute offset, length) in the source blob
    params: tuple[Any, ...]
    nbytes: int


# A tensor's data: source byte ranges, served as they are, or a Compute.
TensorData = tuple[tuple[int, int], ...] | Compute


@dataclass(slots=True)
class TensorItem:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: TensorData
    source: GGUFTensor  # the tensor this one started as (for offsets and the original type)

    @property
    def computed(self) -> bool:
        return isinstance(self.data, Compute)

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, Compute):
            return self.data.nbytes
        return sum(n for _, n in self.data)


@dataclass
class Draft:
    """A GGUF header being translated. `notes` records what was done, for `modelfs show`."""

    header: GGUFHeader
    arch: str
    kv: dict[str, KVItem]
    tensors: dict[str, TensorItem]
    hidden: list[str] = field(default_factory=list)  # tensor-name prefixes the loader skips
    notes: list[str] = field(default_factory=list)
    handler: str = ""
    file: BinaryIO | None = None  # the source, for arrays too long to be in `header`
    # Tokens read from the source by index. A detector asks for a few neighbours (Llama 3's
    # 128006 and 128009), and each read walks the vocabulary from its start: one walk, then.
    _tokens: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, header: GGUFHeader, file: BinaryIO | None = None) -> Draft:
        kv: dict[str, KVItem] = {}
        for key, value in header.kv.items():
            span = header.spans[key]
            kv[key] = KVItem(span.vtype, value, span.item_type, span)
        tensors = {
            t.name: TensorItem(t.name, t.shape, t.ggml_type, ((t.offset, t.nbytes),), t)
            for t in header.tensors
        }
        return cls(header, header.architecture, kv, tensors, file=file)

    # -- KV reads --------------------------------------------------------------------------
    def has_key(self, key: str) -> bool:  # has_key
        return key in self.kv

    def value(self, key: str) -> Any:
        item = self.kv.get(key)
        return None if item is None else item.value

    def str_value(self, key: str) -> str | None:
        item = self.kv.get(key)
        return item.value if item is not None and item.vtype == T_STRING else None

    def u32_value(self, key: str) -> int | None:
        """An unsigned 32-bit value; upstream's gguf_get_val_u32 asserts the type."""
        item = self.kv.get(key)
        return item.value if item is not None and item.vtype == T_UINT32 else None

    def array_items(self, key: str) -> list[Any] | None:
        """An array's items, read from the source when the header kept only its length."""
        item = self.kv.get(key)
        if item is None or item.vtype != T_ARRAY:
            return None
        if not isinstance(item.value, ArraySummary):
            return list(item.value)
        if item.span is None or self.file is None:
            return None
        return read_array(self.file, item.span, 0, item.keep)

    def token_at(self, index: int) -> str | None:
        """tokenizer.ggml.tokens[index] (the read behind token_at_equals), or None."""
        item = self.kv.get("tokenizer.ggml.tokens")
        if item is None or item.vtype != T_ARRAY or item.item_type != T_STRING:
            return None
        if not isinstance(item.value, ArraySummary):
            return item.value[index] if 0 <= index < len(item.value) else None
        limit = item.value.length
        if item.span is None or self.file is None or not 0 <= index < limit:
            return None
        if index not in self._tokens:
            first = max(0, index - TOKEN_WINDOW // 2)
            tokens = read_array(self.file, item.span, first, TOKEN_WINDOW)
            self._tokens.update(enumerate(tokens, first))
        return self._tokens[index]

    def string_equals(self, key: str, want: str) -> bool:  # string_kv_equals
        return self.str_value(key) == want

    def string_contains(self, key: str, needle: str) -> bool:  # string_kv_contains
        value = self.str_value(key)
        return value is not None and needle in value

    def string_missing_or_default(self, key: str) -> bool:  # string_kv_missing_or_default
        item = self.kv.get(key)
        if item is None:
            return True
        return item.vtype == T_STRING and item.value in ("", "default")

    # -- KV edits --------------------------------------------------------------------------
    def set(self, key: str, vtype: int, value: Any, item_type: int = -1) -> None:
        """gguf_set_val_* / gguf_set_arr_*: an existing key is removed, the new one appended."""
        self.kv.pop(key, None)
        self.kv[key] = KVItem(vtype, value, item_type)

    def remove(self, key: str) -> None:  # gguf_remove_key
        self.kv.pop(key, None)

    def set_u32(self, key: str, value: int) -> None:  # set_u32_kv
        self.set(key, T_UINT32, value)

    def set_str(self, key: str, value: str) -> None:
        self.set(key, T_STRING, value)

    def copy_kv(self, src: str, dst: str, vtype: int | None = None) -> None:
        """copy_kv (and copy_u32_kv / copy_f32_kv with `vtype`): skipped when `src` is
        missing or `dst` exists. The copy keeps the source bytes, so long arrays copy too.
        A typed copy of a value of another type is skipped (upstream would assert)."""
        if dst in self.kv:
            return
        item = self.kv.get(src)
        if item is None or (vtype is not None and item.vtype != vtype):
            return
        self.kv[dst] = item

    def rename_kv_prefix(self, old: str, new: str) -> None:
        """rename_kv_prefix: copy every `old*` key to `new*`; the old keys stay."""
        for key in [k for k in self.kv if k.startswith(old)]:
            self.copy_kv(key, new + key[len(old) :])

    def inject_u32(self, key: str, value: int) -> None:  # inject_u32_if_missing
        if key not in self.kv:
            self.set(key, T_UINT32, value)

    def inject_f32(self, key: str, value: float) -> None:  # inject_f32_if_missing
        if key not in self.kv:
            self.set(key, T_FLOAT32, value)

    def inject_str(self, key: str, value: str) -> None:  # inject_str_if_missing
        if key not in self.kv:
            self.set(key, T_STRING, value)

    def inject_bool(self, key: str, value: bool) -> None:  # inject_bool_if_missing
        if key not in self.kv:
            self.set(key, T_BOOL, value)

    def inject_f32_array(self, key: str, values: Iterable[float]) -> None:
        """inject_f32_arr_if_missing"""
        if key not in self.kv:
            self.set(key, T_ARRAY, list(values), T_FLOAT32)

    def truncate_array(self, key: str, n: int, item_type: int | None = None) -> None:
        """truncate_str_arr / truncate_data_arr: keep the first `n` items of an array.

        The items stay the source's bytes; `item_type` re-types them as upstream does
        (truncate_data_arr writes the element type it is given)."""
        item = self.kv.get(key)
        if item is None or item.vtype != T_ARRAY:
            return
        count = item.value.length if isinstance(item.value, ArraySummary) else len(item.value)
        if n >= count:
            return
        new_type = item.item_type if item_type is None else item_type
        if item.span is None or item.keep is not None:
            # A value made here: cut it in memory.
            self.set(key, T_ARRAY, list(item.value)[:n], new_type)
            return
        value: Any = (
            ArraySummary(new_type, n) if isinstance(item.value, ArraySummary) else item.value[:n]
        )
        self.kv.pop(key)
        self.kv[key] = KVItem(T_ARRAY, value, new_type, item.span, n)

    # -- tensors ---------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorItem | None:
        return self.tensors.get(name)

    def any_tensor_with_prefix(self, prefix: str) -> bool:  # any_tensor_with_prefix
        return any(name.startswith(prefix) for name in self.tensors)

    def rename_tensor(self, old: str, new: str) -> None:  # rename_tensor
        t = self.tensors.get(old)
        if t is None:
            return
        # Keep the file order: rebuild the dict with the one key changed.
        t.name = new
        self.tensors = {(new if k == old else k): v for k, v in self.tensors.items()}

    def rename_tensors_containing(self, needle: str, replacement: str) -> None:
        """rename_tensors_containing: replace the first occurrence of `needle` in each name."""
        renames = [(n, n.replace(needle, replacement, 1)) for n in self.tensors if needle in n]
        for old, new in renames:
            self.rename_tensor(old, new)

    def set_shape(self, name: str, shape: tuple[int, ...], ggml_type: int | None = None) -> None:
        """set_tensor_shape / set_tensor_type: the tensor's ggml shape (and type) changed;
        its data must be set to match (check_tensor tells when it does not)."""
        t = self.tensors[name]
        t.shape = tuple(shape)
        if ggml_type is not None:
            t.ggml_type = ggml_type

    def reclaim(
        self, orphan: str, new: str, shape: tuple[int, ...], ggml_type: int, data: TensorData
    ) -> None:
        """reclaim_slot_as: a synthesized tensor takes an orphaned tensor's place (upstream's
        clip context has no spare slot). Without the orphan the tensor is appended: a view
        has no slot limit."""
        if orphan in self.tensors and new not in self.tensors:
            self.rename_tensor(orphan, new)
            t = self.tensors[new]
            t.shape, t.ggml_type, t.data = tuple(shape), ggml_type, data
            return
        source = next(iter(self.tensors.values())).source
        self.tensors[new] = TensorItem(new, tuple(shape), ggml_type, data, source)

    def drop_tensor(self, name: str) -> None:
        """A tensor whose bytes now live in another (a merged QKV's k and v): left out of the
        view. Upstream leaves it in the clip context, where nothing reads it."""
        self.tensors.pop(name, None)

    def permute_rows(self, name: str, order: list[int]) -> bool:
        """Row `i` of the result is row `order[i]` of the source (whole rows, served as
        ranges of the source: nothing computed)."""
        t = self.tensors.get(name)
        if t is None or isinstance(t.data, Compute) or len(t.data) != 1 or not order:
            return False
        ((offset, length),) = t.data
        if length % len(order):
            return False
        row = length // len(order)
        t.data = tuple((offset + src * row, row) for src in order)
        return True

    def add_skip_prefix(self, prefix: str) -> None:  # add_skip_prefix
        self.hidden.append(prefix)

    def is_hidden(self, name: str) -> bool:  # should_skip_tensor_prefix
        return any(name.startswith(p) for p in self.hidden)

    # -- data transforms (load ops) --------------------------------------------------------
    def promote_to_f32(self, name: str) -> None:
        """promote_tensor_to_f32: an F16 tensor becomes F32, converted on first read."""
        t = self.tensors.get(name)
        if t is None or t.ggml_type != GGML_F16 or isinstance(t.data, Compute):
            return
        n = t.source.n_elements
        t.data = Compute("f16_to_f32", t.data, (n,), 4 * n)
        t.ggml_type = GGML_F32

    def add_one_as_f32(self, name: str) -> None:
        """register_qwen35_norm_shift_load: the tensor becomes F32 holding source + 1."""
        t = self.tensors[name]
        src = t.source
        t.data = Compute(
            "add_one_f32", ((src.offset, src.nbytes),), (src.ggml_type,), 4 * src.n_elements
        )
        t.ggml_type = GGML_F32

    def concat_to_f32(self, names: list[str]) -> Compute | None:
        """register_concat_load_to_f32: the sources, each made F32 from its own type, one
        after another (None when one is missing or already computed, as upstream registers
        nothing then)."""
        ts = [self.tensors.get(n) for n in names]
        if any(t is None or isinstance(t.data, Compute) or len(t.data) != 1 for t in ts):
            return None
        sources = tuple(t.data[0] for t in ts)  # type: ignore[union-attr,index]
        params = tuple((t.ggml_type, math.prod(t.shape)) for t in ts)  # type: ignore[union-attr]
        return Compute("concat_to_f32", sources, params, 4 * sum(n for _, n in params))

    def concat_ranges(self, names: list[str]) -> tuple[tuple[int, int], ...]:
        """register_concat_load: the sources' bytes one after another, as served ranges."""
        out: list[tuple[int, int]] = []
        for n in names:
            data = self.tensors[n].data
            if isinstance(data, Compute):
                raise ValueError(f"{n}: cannot concatenate a computed tensor")
            out += data
        return tuple(out)


def check_tensor(t: TensorItem) -> None:
    """The size its shape and type call for must be the size of its data."""
    if t.ggml_type not in GGML_TYPES:
        raise ValueError(f"{t.name}: unknown ggml type {t.ggml_type}")
    want = tensor_nbytes(t.shape, t.ggml_type)
    if want != t.nbytes:
        raise ValueError(f"{t.name}: shape {t.shape} needs {want} bytes, data has {t.nbytes}")
