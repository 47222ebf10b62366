"""What changed between two versions of a model, and what kind of change it is.

Each side is a tag of the store (its preferred variant, by `prefer`: store.scan) or a manifest
digest (`sha256:<hex>`, or 12 or more hex digits of it) found among the tags, in `blobs/` or in
the tag history (store.history). The compared manifests are the variants: for a manifest list,
the child chosen by `prefer` among those whose manifest is at hand.

Blobs are compared by digest (config and layers). The kind of change, decided in this order:

1. `identical`: the same manifest digest (of the list, for a list).
2. The weight blobs (layer kinds `model`, `tensor`, `projector`, `adapter`, `draft`) are the
   same digests on both sides:
   - `new packaging` when the arrangement differs: a plain manifest against a list, another
     manifest or config media type, the weight layers in another order or under other media
     types or names, or the config's description of the weights (`model_format`,
     `model_family`, `model_families`, `architecture`, `model_type`, `file_type`) differs; and
     also when no blob differs at all but the manifest bytes do (layers reordered, `from`
     fields, JSON spelling);
   - `only accessories` otherwise: some non-weight blob differs (template, system, params,
     license, messages, `json` files, and the config's other fields, such as `renderer`,
     `parser`, `capabilities`, or an old config's `rootfs`), packaging is the same.
3. The weights differ:
   - `different quantization`: the tally of quantization types (tensor count per type over
     every weight blob: ggml types such as `Q4_K`, safetensors quant types such as `int4` or
     dtypes) differs while the tensor names are the same (the same model, re-quantized). When
     a side's weight headers cannot be read (blobs absent, e.g. pruned by Ollama after a
     re-pull), the configs decide: `file_type` differs, `model_family` and `model_type` agree;
   - `fixed conversion`: the same weight layers (kinds and names), every changed weight blob
     has the same tensors (names, shapes, types, quant metadata) on both sides, and a strict
     minority of the tensors changed: fewer than half of all tensors have other data
     (FIXED_FRACTION). A tensor's data is compared in full up to 64 KiB, else by 8 windows of
     4 KiB spread over it; new weights change every window, a conversion fix leaves most
     tensors byte-identical. A GGUF whose tensors are all unchanged (a metadata fix: tokenizer,
     rope parameters, chat template) is a fixed conversion. Without headers on both sides:
     fewer than half of the weight blobs changed, each changed one keeping its size;
   - `new weights`: anything else.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import InvalidDigestError, ModelNotFoundError, StoreError
from modelfs.store.formats.gguf import GGUFHeader
from modelfs.store.formats.quant import (
    QuantRow,
    quantization_breakdown_gguf,
    quantization_breakdown_safetensors,
    weight_header,
)
from modelfs.store.formats.safetensors import SafetensorsHeader
from modelfs.store.history import TagHistory
from modelfs.store.manifest import (
    Layer,
    Manifest,
    ManifestList,
    ModelConfig,
    infer_runner,
    parse_manifest,
)
from modelfs.store.names import Name
from modelfs.store.scan import DEFAULT_PREFER, StoreIndex, Variant, child_variant, choose_variant

log = logging.getLogger(__name__)

WEIGHT_KINDS = frozenset({"model", "tensor", "projector", "adapter", "draft"})
PACKAGING_KEYS = (
    "model_format",
    "model_family",
    "model_families",
    "architecture",
    "model_type",
    "file_type",
)
FIXED_FRACTION = 0.5  # a fixed conversion changes fewer than this share of the tensors
WHOLE = 64 << 10  # tensors up to this size are compared in full
WINDOWS, WINDOW = 8, 4 << 10

KINDS = (
    "identical",
    "only accessories",
    "new packaging",
    "different quantization",
    "fixed conversion",
    "new weights",
)

_HEX_REF = re.compile(r"(?:sha256[:-])?([0-9a-fA-F]{12,64})")

Header = GGUFHeader | SafetensorsHeader


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a diff: what the user named and the manifest compared."""

    ref: str
    source: str  # "tag" | "blobs" | "history"
    top: Manifest | ManifestList
    variant: Variant
    name: Name | None = None

    @property
    def manifest(self) -> Manifest:
        return self.variant.manifest


@dataclass(frozen=True, slots=True)
class BlobRow:
    digest: Digest
    kind: str  # a layer kind (`model`, `template`, …) or `config`
    media_type: str
    size: int
    name: str | None
    present: bool

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "digest": str(self.digest),
            "kind": self.kind,
            "media_type": self.media_type,
            "size": self.size,
            "present": self.present,
        }
        if self.name:
            out["name"] = self.name
        return out


@dataclass
class SideFacts:
    """What was learned about a side's weights."""

    config: ModelConfig | None
    headers: dict[Digest, Header | None]  # per weight blob; None when it cannot be read
    quantization: list[QuantRow] | None  # None unless every weight header was read

    @property
    def complete(self) -> bool:
        return all(h is not None for h in self.headers.values())

    def config_field(self, key: str) -> Any:
        return self.config.extra.get(key) if self.config else None


@dataclass
class Diff:
    a: Side
    b: Side
    kind: str
    reason: str
    shared: list[BlobRow]
    only_a: list[BlobRow]
    only_b: list[BlobRow]
    facts_a: SideFacts
    facts_b: SideFacts
    tensors_total: int | None = None
    tensors_changed: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        def side(s: Side, facts: SideFacts) -> dict[str, Any]:
            return {
                "ref": s.ref,
                "name": s.name.shortest if s.name else None,
                "source": s.source,
                "digest": str(s.top.digest),
                "list": isinstance(s.top, ManifestList),
                "manifest": str(s.manifest.digest),
                "runner": s.variant.runner,
                "format": s.variant.format,
                "size": s.manifest.size,
                "file_type": facts.config_field("file_type") or "",
                "quantization": None
                if facts.quantization is None
                else [
                    {"type": q.type, "count": q.count, "bytes": q.nbytes}
                    for q in facts.quantization
                ],
            }

        def total(rows: list[BlobRow]) -> int:
            return sum(r.size for r in rows)

        return {
            "kind": self.kind,
            "reason": self.reason,
            "a": side(self.a, self.facts_a),
            "b": side(self.b, self.facts_b),
            "blobs": {
                "shared": [r.as_json() for r in self.shared],
                "only_a": [r.as_json() for r in self.only_a],
                "only_b": [r.as_json() for r in self.only_b],
            },
            "bytes": {
                "shared": total(self.shared),
                "only_a": total(self.only_a),
                "only_b": total(self.only_b),
            },
            "tensors": None
            if self.tensors_total is None
            else {"total": self.tensors_total, "changed": self.tensors_changed},
            "notes": self.notes,
        }


# -- resolving a side ----------------------------------------------------------------------
def _variant_of(
    index: StoreIndex, history: TagHistory, top: Manifest | ManifestList, prefer: Iterable[str]
) -> Variant | None:
    """The variant to compare of a manifest or list read from bytes."""
    if isinstance(top, Manifest):
        config = _config(index, history, top)
        fmt = top.format or (config.model_format if config else None)
        return Variant(top, infer_runner(top, config), fmt or None, False)
    variants = []
    for child in top.children:
        manifest = child.inline or _parse(history.manifest_bytes(child.digest), child.digest)
        if isinstance(manifest, Manifest):
            variants.append(child_variant(child, manifest, _config(index, history, manifest)))
    return choose_variant(variants, prefer)


def _parse(raw: bytes | None, digest: Digest) -> Manifest | ManifestList | None:
    if raw is None:
        return None
    try:
        return parse_manifest(raw, str(digest))
    except StoreError:
        return None


def _config(index: StoreIndex, history: TagHistory, manifest: Manifest) -> ModelConfig | None:
    if manifest.config is None:
        return None
    return index.config(manifest) or history.config(manifest.config.digest)


def _known_manifests(index: StoreIndex) -> dict[Digest, Manifest | ManifestList]:
    known: dict[Digest, Manifest | ManifestList] = {}
    for entry in index:
        known[entry.top.digest] = entry.top
        for v in entry.variants:
            known.setdefault(v.manifest.digest, v.manifest)
    return known


def find_manifest(
    index: StoreIndex, history: TagHistory, ref: str
) -> tuple[Manifest | ManifestList, str] | None:
    """The manifest a digest or hex prefix names, and where it was found; None when `ref` is
    not shaped like one or nothing matches. StoreError when the prefix is ambiguous."""
    m = _HEX_REF.fullmatch(ref)
    if m is None:
        return None
    prefix = m.group(1).lower()
    known = _known_manifests(index)
    candidates: dict[Digest, str] = {d: "tag" for d in known if d.hex.startswith(prefix)}
    for d in history.saved():
        if d.hex.startswith(prefix):
            candidates.setdefault(d, "history")
    for blob in index.blob_names:
        if blob.startswith("sha256-" + prefix):
            candidates.setdefault(Digest(blob[7:]), "blobs")
    found: dict[Digest, tuple[Manifest | ManifestList, str]] = {}
    for digest, source in sorted(candidates.items()):
        parsed = known.get(digest) or _parse(history.manifest_bytes(digest), digest)
        if parsed is not None:
            found[digest] = (parsed, source)
    if len(found) > 1:
        some = ", ".join(d.hex[:16] for d in list(found)[:3])
        raise StoreError(f"{ref!r} matches {len(found)} manifests ({some}, …); give more digits")
    if not found:
        return None
    return next(iter(found.values()))


def _name_of(index: StoreIndex, digest: Digest) -> Name | None:
    for entry in index:
        if entry.top.digest == digest:
            return entry.name
    return None


def resolve(
    index: StoreIndex,
    history: TagHistory,
    ref: str,
    prefer: Iterable[str] = DEFAULT_PREFER,
) -> Side:
    """A tag of the store, else a manifest digest (full or a prefix of 12+ hex digits)."""
    prefer = tuple(prefer)
    hit = find_manifest(index, history, ref)
    if hit is not None:
        top, source = hit
        variant = _variant_of(index, history, top, prefer)
        if variant is None:
            raise StoreError(f"{ref}: no child manifest of this list is present here")
        return Side(ref, source, top, variant, _name_of(index, top.digest))
    if ref.lower().startswith("sha256"):
        if _HEX_REF.fullmatch(ref) is None:
            raise InvalidDigestError(f"invalid digest {ref!r}")
        raise ModelNotFoundError(f"no manifest {ref} in the store or its history")
    try:
        entry = index.lookup(ref)
    except ModelNotFoundError:
        if _HEX_REF.fullmatch(ref):
            raise ModelNotFoundError(
                f"no model or manifest {ref!r} in the store or its history"
            ) from None
        raise
    variant = entry.preferred(prefer)
    if variant is None:
        raise StoreError(f"{entry.name.shortest}: no variant of this list is present here")
    return Side(ref, "tag", entry.top, variant, entry.name)


def resolve_previous(
    index: StoreIndex,
    history: TagHistory,
    side: Side,
    prefer: Iterable[str] = DEFAULT_PREFER,
) -> Side:
    """The version `side` replaced, from the tag history."""
    if side.name is not None:
        found = history.previous(side.name, current=side.top.digest)
        what = side.name.shortest
    else:
        found = history.before(side.top.digest)
        what = side.ref
    if found is None:
        raise ModelNotFoundError(
            f"no previous version of {what} in the tag history (.modelfs/history); "
            "name the other side: modelfs diff A B"
        )
    digest, raw = found
    top = parse_manifest(raw, f"history {digest}")
    variant = _variant_of(index, history, top, prefer)
    if variant is None:
        raise StoreError(f"the previous version of {what} ({digest.short}) has no child at hand")
    return Side(f"{what} (previous)", "history", top, variant, side.name)


# -- comparing -----------------------------------------------------------------------------
def _rows(index: StoreIndex, manifest: Manifest) -> dict[Digest, BlobRow]:
    rows: dict[Digest, BlobRow] = {}
    if manifest.config is not None:
        c = manifest.config
        present = index.blob_info(c.digest) is not None
        rows[c.digest] = BlobRow(c.digest, "config", c.media_type, c.size, None, present)
    for layer in manifest.layers:
        if layer.digest not in rows:
            present = index.blob_info(layer.digest) is not None
            rows[layer.digest] = BlobRow(
                layer.digest, layer.kind, layer.media_type, layer.size, layer.name, present
            )
    return rows


def _weights(manifest: Manifest) -> list[Layer]:
    return [layer for layer in manifest.layers if layer.kind in WEIGHT_KINDS]


def _slots(manifest: Manifest) -> dict[tuple[str, str, int], Layer]:
    """Weight layers keyed by (kind, name, n-th of that kind and name)."""
    seen: Counter[tuple[str, str]] = Counter()
    slots = {}
    for layer in _weights(manifest):
        key = (layer.kind, layer.name or "")
        slots[(*key, seen[key])] = layer
        seen[key] += 1
    return slots


def _read_header(index: StoreIndex, layer: Layer) -> Header | None:
    try:
        return weight_header(index, layer)
    except (OSError, StoreError) as exc:
        log.warning("%s: %s", layer.digest, exc)
        return None


def _facts(index: StoreIndex, history: TagHistory, manifest: Manifest) -> SideFacts:
    headers = {layer.digest: _read_header(index, layer) for layer in _weights(manifest)}
    facts = SideFacts(_config(index, history, manifest), headers, None)
    if facts.complete and headers:
        tally: dict[str, list[int]] = {}
        gguf = [h for h in headers.values() if isinstance(h, GGUFHeader)]
        st = [h for h in headers.values() if isinstance(h, SafetensorsHeader)]
        rows = [r for h in gguf for r in quantization_breakdown_gguf(h)]
        rows += quantization_breakdown_safetensors(st) if st else []
        for r in rows:
            t = tally.setdefault(r.type, [0, 0])
            t[0] += r.count
            t[1] += r.nbytes
        quant = [QuantRow(k, c, b) for k, (c, b) in tally.items()]
        facts.quantization = sorted(quant, key=lambda r: (-r.nbytes, -r.count, r.type))
    return facts


def _tensor_names(facts: SideFacts) -> set[str] | None:
    if not facts.complete:
        return None
    names: set[str] = set()
    for h in facts.headers.values():
        assert h is not None
        names.update(t.name for t in h.tensors)
    return names


def _signature(header: Header) -> tuple[Any, ...]:
    if isinstance(header, GGUFHeader):
        return tuple((t.name, t.shape, t.type_name) for t in header.tensors)
    meta = tuple(sorted((k, v) for k, v in header.metadata.items() if "quant" in k))
    return (meta, tuple((t.name, t.dtype, t.shape) for t in header.tensors))


def _extents(header: Header) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute file offset, byte count)."""
    if isinstance(header, GGUFHeader):
        return {t.name: (t.offset, t.nbytes) for t in header.tensors}
    return {t.name: (header.data_offset + t.begin, t.nbytes) for t in header.tensors}


def _windows(offset: int, nbytes: int) -> list[tuple[int, int]]:
    if nbytes <= WHOLE:
        return [(offset, nbytes)]
    step = (nbytes - WINDOW) / (WINDOWS - 1)
    return [(offset + int(i * step), WINDOW) for i in range(WINDOWS)]


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _changed_tensors(
    index: StoreIndex, layer_a: Layer, layer_b: Layer, ha: Header, hb: Header
) -> int:
    """How many tensors hold other data (sampled, see the module docstring)."""
    ea, eb = _extents(ha), _extents(hb)
    changed = 0
    with contextlib.ExitStack() as stack:
        fa = stack.enter_context(open_binary(index.layout.blob(layer_a.digest)))
        fb = stack.enter_context(open_binary(index.layout.blob(layer_b.digest)))
        for name, (off_a, n) in ea.items():
            off_b, n_b = eb[name]
            if n != n_b:
                changed += 1
                continue
            for (wa, size), (wb, _) in zip(_windows(off_a, n), _windows(off_b, n), strict=True):
                if _read_at(fa, wa, size) != _read_at(fb, wb, size):
                    changed += 1
                    break
    return changed


def _packaging(side: Side, facts: SideFacts) -> dict[str, Any]:
    m = side.manifest
    return {
        "form": "list" if isinstance(side.top, ManifestList) else "manifest",
        "media_type": m.media_type,
        "config_media_type": m.config.media_type if m.config else None,
        "weights": [(layer.media_type, layer.name) for layer in _weights(m)],
        "config": None
        if facts.config is None
        else {k: facts.config_field(k) for k in PACKAGING_KEYS},
    }


def _packaging_change(pa: dict[str, Any], pb: dict[str, Any]) -> str | None:
    if pa["form"] != pb["form"]:
        return f"a {pa['form']} against a {pb['form']}"
    if pa["media_type"] != pb["media_type"] or pa["config_media_type"] != pb["config_media_type"]:
        return "other manifest or config media types"
    if pa["weights"] != pb["weights"]:
        return "the weight layers are arranged, typed or named differently"
    if pa["config"] is not None and pb["config"] is not None and pa["config"] != pb["config"]:
        keys = [k for k in PACKAGING_KEYS if pa["config"][k] != pb["config"][k]]
        return "the config describes the weights differently (" + ", ".join(keys) + ")"
    return None


def _tally(facts: SideFacts) -> Counter[str] | None:
    if facts.quantization is None:
        return None
    return Counter({q.type: q.count for q in facts.quantization})


def _quant_text(facts: SideFacts) -> str:
    if facts.quantization:
        return ", ".join(f"{q.type}×{q.count}" for q in facts.quantization)
    return facts.config_field("file_type") or "?"


def diff(index: StoreIndex, history: TagHistory, a: Side, b: Side) -> Diff:
    rows_a, rows_b = _rows(index, a.manifest), _rows(index, b.manifest)
    fa, fb = _facts(index, history, a.manifest), _facts(index, history, b.manifest)
    result = Diff(
        a,
        b,
        "",
        "",
        shared=[r for d, r in rows_a.items() if d in rows_b],
        only_a=[r for d, r in rows_a.items() if d not in rows_b],
        only_b=[r for d, r in rows_b.items() if d not in rows_a],
        facts_a=fa,
        facts_b=fb,
    )
    for side, facts, label in ((a, fa, "A"), (b, fb, "B")):
        if not facts.complete:
            result.notes.append(
                f"weights of {label} are not all present here (pruned?): decided from its "
                "manifest and config"
            )
        if facts.config is None and side.manifest.config is not None:
            result.notes.append(f"config of {label} is not at hand")
    result.kind, result.reason = _classify(index, a, b, fa, fb, result)
    if result.kind in ("different quantization", "fixed conversion", "new weights"):
        others = {r.kind for r in result.only_a + result.only_b}
        others -= WEIGHT_KINDS | {"config"}
        if others:
            result.reason += "; also changed: " + ", ".join(sorted(others))
    return result


def _classify(
    index: StoreIndex, a: Side, b: Side, fa: SideFacts, fb: SideFacts, result: Diff
) -> tuple[str, str]:
    if a.top.digest == b.top.digest:
        return "identical", "the same manifest"
    wa = sorted(layer.digest for layer in _weights(a.manifest))
    wb = sorted(layer.digest for layer in _weights(b.manifest))
    if wa == wb:
        change = _packaging_change(_packaging(a, fa), _packaging(b, fb))
        if change is not None:
            return "new packaging", f"the same weights; {change}"
        if not result.only_a and not result.only_b:
            if a.manifest.digest == b.manifest.digest:
                return "new packaging", "the same variant manifest in another manifest list"
            return "new packaging", "the same blobs; the manifest itself was rewritten"
        kinds = sorted({r.kind for r in result.only_a + result.only_b})
        return "only accessories", "the same weights; changed: " + ", ".join(kinds)

    # The weights differ.
    ta, tb = _tally(fa), _tally(fb)
    if ta is not None and tb is not None:
        quant_differs = ta != tb
        same_model = _tensor_names(fa) == _tensor_names(fb)
    else:
        fta, ftb = fa.config_field("file_type"), fb.config_field("file_type")
        quant_differs = bool(fta and ftb and fta != ftb)
        same_model = all(
            fa.config_field(k) == fb.config_field(k) for k in ("model_family", "model_type")
        )
    if quant_differs:
        if same_model:
            return "different quantization", f"{_quant_text(fa)} (A) against {_quant_text(fb)} (B)"
        return "new weights", "other tensors in another quantization"

    slots_a, slots_b = _slots(a.manifest), _slots(b.manifest)
    if slots_a.keys() != slots_b.keys():
        return "new weights", "other weight layers"
    changed_slots = [k for k in slots_a if slots_a[k].digest != slots_b[k].digest]
    total = changed = 0
    for key, la in slots_a.items():
        lb = slots_b[key]
        ha, hb = fa.headers.get(la.digest), fb.headers.get(lb.digest)
        if ha is None or hb is None:
            total = -1
            break
        n = len(ha.tensors)
        total += n
        if la.digest == lb.digest:
            continue
        if _signature(ha) != _signature(hb):
            return (
                "new weights",
                f"the tensors of {key[0]} {key[1]} differ in names, shapes or types",
            )
        try:
            changed += _changed_tensors(index, la, lb, ha, hb)
        except OSError as exc:
            log.warning("comparing %s: %s", key, exc)
            total = -1
            break
    if total >= 0:
        result.tensors_total, result.tensors_changed = total, changed
        if changed < FIXED_FRACTION * total or (total == 0 and changed == 0):
            what = "metadata only" if changed == 0 else f"{changed} of {total} tensors changed"
            return "fixed conversion", f"the same tensors; {what}"
        return "new weights", f"the same tensor layout, but {changed} of {total} tensors changed"
    # Headers missing on a side: judge by the blobs of the manifests.
    same_sizes = all(slots_a[k].size == slots_b[k].size for k in changed_slots)
    if same_sizes and len(changed_slots) < FIXED_FRACTION * len(slots_a):
        return (
            "fixed conversion",
            f"{len(changed_slots)} of {len(slots_a)} weight blobs changed, sizes kept",
        )
    return "new weights", f"{len(changed_slots)} of {len(slots_a)} weight blobs changed"
