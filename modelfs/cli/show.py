"""`modelfs show NAME`: variants, layers, the file each becomes, quantization by type."""

from __future__ import annotations

from typing import Any

from modelfs.cli.human import rfc3339_nano, table
from modelfs.store.compat import (
    COMPATIBLE_RUNNERS,
    CompatViews,
    GGUFView,
    compat_views,
    may_need_mmproj_view,
    may_need_view,
    mmproj_view,
)
from modelfs.store.errors import StoreError
from modelfs.store.formats.artifacts import recorded_source
from modelfs.store.formats.quant import manifest_quantization
from modelfs.store.manifest import ManifestList
from modelfs.store.scan import DEFAULT_PREFER, Entry, StoreIndex, Variant
from modelfs.store.tagid import TagId
from modelfs.store.tools.files import ModelFile, model_files
from modelfs.store.units import human_bytes


def _variant_record(
    index: StoreIndex, variant: Variant, preferred: bool, with_quant: bool
) -> dict[str, Any]:
    manifest = variant.manifest
    config = index.config(manifest)
    missing = set(index.missing_blobs(manifest))
    layers = [
        {
            "media_type": f.layer.media_type,
            "digest": str(f.layer.digest),
            "size": f.layer.size,
            **({"name": f.layer.name} if f.layer.name else {}),
            "file": f.path,
            "present": f.layer.digest not in missing,
        }
        for f in model_files(manifest)
    ]
    record: dict[str, Any] = {
        "runner": variant.runner,
        "format": variant.format,
        "digest": str(manifest.digest),
        "preferred": preferred,
        "size": manifest.size,
        "config": {
            "digest": str(manifest.config.digest) if manifest.config else None,
            "present": manifest.config is not None and manifest.config.digest not in missing,
            "model_format": config.model_format if config else "",
            "model_family": config.model_family if config else "",
            "model_type": config.model_type if config else "",
            "file_type": config.file_type if config else "",
            "capabilities": list(config.capabilities) if config else [],
            "source": recorded_source(config.extra) if config else None,
        },
        "layers": layers,
    }
    record["llama_cpp"] = _llama_cpp(
        index, model_files(manifest), missing, variant.runner not in COMPATIBLE_RUNNERS
    )
    if with_quant:
        record["quantization"] = [
            {"type": q.type, "count": q.count, "bytes": q.nbytes}
            for q in manifest_quantization(index, manifest)
        ]
    return record


def _llama_cpp(
    index: StoreIndex, files: list[ModelFile], missing: set[Any], translate: bool
) -> dict[str, Any]:
    """Which files of the model directory to hand llama.cpp (`--model`, `--mmproj`)."""
    model = next((f for f in files if f.path == "model.gguf"), None)
    projector = next((f for f in files if f.path == "mmproj.gguf"), None)
    out: dict[str, Any] = {"model": None, "mmproj": None, "view": None, "mmproj_view": None}
    if model is None or model.layer.digest in missing:
        return out
    out["model"] = model.path
    if projector is not None and projector.layer.digest not in missing:
        out["mmproj"] = projector.path
    else:
        projector = None
    if not translate:
        return out
    path = index.layout.blob(model.layer.digest)
    views: CompatViews | None = None
    if may_need_view(path):
        try:
            views = compat_views(path, model.layer.digest.hex)
        except (OSError, StoreError, ValueError) as exc:
            out["error"] = str(exc)
    clip = views.mmproj if views is not None else None
    if clip is None and projector is not None:
        # A separate projector llama.cpp refuses as it is (LLaVA's, without a type).
        ppath = index.layout.blob(projector.layer.digest)
        if may_need_mmproj_view(ppath):
            try:
                clip = mmproj_view(ppath, projector.layer.digest.hex)
            except (OSError, StoreError, ValueError) as exc:
                out["mmproj_error"] = str(exc)
    if clip is not None:
        out["mmproj"] = "llama.cpp/mmproj.gguf"
        out["mmproj_view"] = _view_record(clip)
    if views is None:
        return out
    out["model"] = "llama.cpp/model.gguf"
    v = views.model
    out["view"] = _view_record(v)
    vision_hidden = any(n.startswith(("v.", "mm.", "a.")) for n in v.hidden)
    if vision_hidden and out["mmproj"] is None:
        out["view"]["notes"].append(
            "the embedded vision/audio tensors are hidden; no clip rule reads them"
        )
    return out


def _view_record(v: GGUFView) -> dict[str, Any]:
    return {
        "rules": v.handler,
        "size": v.size,
        "tensors": len(v.tensors),
        "hidden": len(v.hidden),
        "computed": len(v.computed),
        "notes": list(v.notes),
    }


def show_record(
    index: StoreIndex, entry: Entry, prefer: tuple[str, ...] = DEFAULT_PREFER
) -> dict[str, Any]:
    chosen = entry.preferred(prefer)
    rel = entry.rel
    ids = entry.tag_ids(prefer)
    return {
        "name": entry.name.shortest,
        "full_name": entry.name.full,
        "source": rel,
        "digest": str(entry.digest),
        "id": ids.id,
        "child": ids.child,
        "child_id": ids.child_id,
        "list": isinstance(entry.top, ManifestList),
        "modified_at": rfc3339_nano(entry.modified_ns),
        "variants": [_variant_record(index, v, v is chosen, True) for v in entry.variants],
        "absent_variants": [
            {"runner": c.runner, "format": c.format, "digest": str(c.digest)}
            for c in entry.absent_children
        ],
        "problems": [str(p) for p in index.problems if p.path == rel],
    }


def _id_sentence(record: dict[str, Any]) -> str:
    return str(TagId(record["id"], record["list"], record["child"], record["child_id"]))


def render(record: dict[str, Any]) -> str:
    out = [
        f"Model    {record['name']}  ({record['full_name']})",
        f"ID       {_id_sentence(record)}  ({record['source']})",
        f"Modified {record['modified_at']}",
        "",
    ]
    rows = [["VARIANT", "FORMAT", "SIZE", "MANIFEST", ""]]
    for v in record["variants"]:
        rows.append(
            [
                v["runner"] or "-",
                v["format"] or "-",
                human_bytes(v["size"]),
                v["digest"].removeprefix("sha256:")[:12],
                "preferred" if v["preferred"] else "",
            ]
        )
    for c in record["absent_variants"]:
        rows.append([c["runner"] or "-", c["format"] or "-", "-", c["digest"][7:19], "not local"])
    out += [table(rows), ""]
    for v in record["variants"]:
        cfg = v["config"]
        out.append(
            f"{v['runner'] or 'model'}: {cfg['model_family'] or '?'} {cfg['model_type']} "
            f"{cfg['file_type']}".rstrip()
        )
        if cfg["source"]:
            out.append(f"  from the {cfg['source']['format']} artifact {cfg['source']['digest']}")
        rows = [["FILE", "MEDIA TYPE", "SIZE", "DIGEST"]]
        for layer in v["layers"]:
            rows.append(
                [
                    layer["file"] + ("" if layer["present"] else "  (missing)"),
                    layer["media_type"].removeprefix("application/vnd.ollama.image."),
                    human_bytes(layer["size"]),
                    layer["digest"][7:19],
                ]
            )
        out += ["  " + line for line in table(rows).splitlines()]
        lc = v.get("llama_cpp") or {}
        if lc.get("model"):
            args = f"--model {lc['model']}" + (f" --mmproj {lc['mmproj']}" if lc["mmproj"] else "")
            out.append(f"  llama.cpp: {args}")
            for label, key in (("view", "view"), ("mmproj view", "mmproj_view")):
                view = lc.get(key)
                if view:
                    out.append(
                        f"    {label} by {view['rules']}: {view['tensors']} tensors,"
                        f" {view['hidden']} hidden, {view['computed']} computed"
                    )
                    out += [f"    note: {n}" for n in view["notes"]]
        if v.get("quantization"):
            rows = [["QUANT", "TENSORS", "BYTES"]]
            for q in v["quantization"]:
                rows.append([q["type"], str(q["count"]), human_bytes(q["bytes"])])
            out += ["  " + line for line in table(rows).splitlines()]
        out.append("")
    for p in record["problems"]:
        out.append(f"problem: {p}")
    return "\n".join(out).rstrip()
