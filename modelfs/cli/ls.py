"""`modelfs ls`: the models in a store, as `ollama list` and Ollama's /api/tags show them."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from modelfs.cli.human import go_strings, human_time, rfc3339_nano, table
from modelfs.store.errors import StoreError
from modelfs.store.formats.gguf import FILE_TYPES, read_gguf_header_path
from modelfs.store.manifest import Layer, go_marshal
from modelfs.store.scan import DEFAULT_PREFER, Entry, StoreIndex, listed_tag, ollama_entries
from modelfs.store.units import human_bytes

# Template actions, for the variables Ollama's template.Vars finds in them
# (ollama/ollama fb30760 template/template.go:171-189): `.Tools`, `$.Suffix`, …
_ACTION = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_FIELD = re.compile(r"(?<![\w)\]])\$?\.([A-Za-z_]\w*)")
_GEMMA4_RENDERERS = ("gemma4", "gemma4-small", "gemma4-large")  # server/renderer_resolution.go:11
T = TypeVar("T")


def _template_vars(text: str) -> set[str] | None:
    """The lower-cased fields a template's actions name; None where Go's text/template would
    refuse it (an action opened and never closed). A simplification of Go's parser."""
    if text.count("{{") != len(_ACTION.findall(text)):
        return None
    return {m.lower() for action in _ACTION.findall(text) for m in _FIELD.findall(action)}


def _gguf_summary(path: Path) -> tuple[list[str], int, int, str] | None:
    """What Ollama's list reads from a GGUF header (server/model_list_cache.go:503-626):
    capabilities, context and embedding length, file type; None when it cannot be read."""
    try:
        header = read_gguf_header_path(path)
    except (OSError, StoreError):
        return None
    caps: list[str] = []
    arch, ctx, emb, ftype, pooling = "", 0, 0, "", False
    for key, value in header.kv.items():
        if key == "general.architecture":
            if not isinstance(value, str):
                return None
            arch = value
            continue
        if key == "general.file_type":
            if not isinstance(value, int) or isinstance(value, bool):
                return None
            ftype = FILE_TYPES.get(value, "unknown")
            continue
        if arch and key.startswith("tokenizer."):
            break  # Ollama stops before the tokenizer's arrays
        if arch and key.startswith(arch + "."):
            sub = key[len(arch) + 1 :]
            if sub == "pooling_type":
                pooling = True
            elif sub in ("vision.block_count", "audio.block_count"):
                cap = sub.split(".")[0]
                if cap not in caps:
                    caps.append(cap)
            elif sub in ("context_length", "embedding_length"):
                if not isinstance(value, int) or isinstance(value, bool):
                    return None
                ctx, emb = (value, emb) if sub == "context_length" else (ctx, value)
    caps.append("embedding" if pooling else "completion")
    return caps, ctx, emb, ftype


def _fact(
    index: StoreIndex,
    kind: str,
    hex_: str,
    compute: Callable[[], T | None],
    valid: Callable[[Any], bool],
) -> T | None:
    """What a blob's bytes say, from the scan index when it holds it (store.index.scancache:
    a blob's bytes change only by a rename into blobs/, which the index notices). `valid`:
    whether a kept answer is of the shape `compute` gives; one that is not is computed again
    (the index, damaged, is rebuilt)."""
    if index.cache is None:
        return compute()
    return index.cache.fact(kind, hex_, compute, valid)


def _is_fields(value: Any) -> bool:
    """Of _template_fields' shape."""
    return type(value) is frozenset and set(map(type, value)) <= {str}


def _is_summary(value: Any) -> bool:
    """Of _gguf_summary's shape."""
    if type(value) is not tuple or len(value) != 4:
        return False
    caps, ctx, emb, ftype = value
    return (
        type(caps) is list
        and all(type(c) is str for c in caps)
        and type(ctx) is int
        and type(emb) is int
        and type(ftype) is str
    )


def _template_fields(path: Path) -> frozenset[str] | None:
    """_template_vars of a template blob; None when it cannot be read or parsed."""
    try:
        found = _template_vars(path.read_bytes().decode("utf-8", "replace"))
    except OSError:
        return None
    return None if found is None else frozenset(found)


def _add(caps: list[str], cap: str) -> None:
    if cap and cap not in caps:
        caps.append(cap)


def tag_record(index: StoreIndex, entry: Entry, prefer: tuple[str, ...]) -> dict[str, Any] | None:
    """One model as Ollama's ListModelResponse (ollama/ollama fb30760
    server/model_list_cache.go:311-397, api/types.go:822-842,933-942); None where Ollama
    leaves it out: its config or a template blob is missing or unreadable (a list tag with no
    present child, here)."""
    variant = entry.preferred(prefer)
    if variant is None:
        return None
    manifest = variant.manifest
    config = index.config(manifest)
    if manifest.config is not None and config is None:
        return None
    blobs = index.layout.blobs
    model: Layer | None = None
    parent = ""
    projectors = 0
    vars_: frozenset[str] = frozenset()
    for layer in manifest.layers:
        if layer.kind == "model":
            model, parent = layer, layer.from_ or ""
        elif layer.kind == "projector":
            projectors += 1
        elif layer.kind in ("prompt", "template"):
            read = partial(_template_fields, blobs / layer.digest.blob_name)
            found = _fact(index, "template:", layer.digest.hex, read, _is_fields)
            if found is None:
                return None
            vars_ = found
    extra = config.extra if config else {}
    remote = {
        k: extra[k]
        for k in ("remote_model", "remote_host")
        if isinstance(extra.get(k), str) and extra[k]
    }

    def number(key: str) -> int:
        value = extra.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    fmt = config.model_format if config else ""
    quant = config.file_type if config else ""
    ctx, emb = number("context_length"), number("embedding_length")
    caps: list[str] = []
    if not remote and model is not None:
        summary = partial(_gguf_summary, blobs / model.digest.blob_name)
        found_gguf = _fact(index, "gguf:", model.digest.hex, summary, _is_summary)
        if found_gguf is not None:
            gguf_caps, gguf_ctx, gguf_emb, gguf_ftype = found_gguf
            caps += gguf_caps
            ctx, emb = ctx or gguf_ctx, emb or gguf_emb
            if quant in ("", "unknown") and gguf_ftype not in ("", "unknown"):
                quant = gguf_ftype
    for cap in config.capabilities if config else ():
        _add(caps, cap)
    if "tools" in vars_:
        _add(caps, "tools")
    if "suffix" in vars_:
        _add(caps, "insert")
    if config is not None and config.model_family in ("gptoss", "gpt-oss"):
        _add(caps, "thinking")
    if projectors:
        _add(caps, "vision")
    renderer = extra.get("renderer")
    if fmt == "safetensors" and (renderer in _GEMMA4_RENDERERS or _nemotron_nano(extra)):
        caps = [c for c in caps if c not in ("vision", "audio")]
    if fmt == "safetensors" and renderer == "glimmer":
        caps = [c for c in caps if c != "audio"]

    details: dict[str, Any] = {
        "parent_model": parent,
        "format": fmt,
        "family": config.model_family if config else "",
        "families": list(config.model_families) if config and config.model_families else None,
        "parameter_size": config.model_type if config else "",
        "quantization_level": quant,
    }
    if ctx:
        details["context_length"] = ctx
    if emb:
        details["embedding_length"] = emb
    record: dict[str, Any] = {"name": entry.name.shortest, "model": entry.name.shortest}
    record |= remote
    record |= {
        "modified_at": rfc3339_nano(entry.modified_ns),
        "size": manifest.size,
        "digest": manifest.digest.hex,
        "details": details,
    }
    if caps:
        record["capabilities"] = caps
    return record


def _nemotron_nano(cfg: dict[str, Any]) -> bool:
    """server/images.go:510-516, for a safetensors config."""
    families = cfg.get("model_families")
    return (
        cfg.get("parser") == "nemotron-3-nano"
        or cfg.get("renderer") == "nemotron-3-nano"
        or cfg.get("model_family") == "nemotron_h_omni"
        or (isinstance(families, list) and "nemotron_h_omni" in families)
    )


def listing(
    index: StoreIndex, prefer: tuple[str, ...] = DEFAULT_PREFER
) -> list[tuple[Entry, dict[str, Any]]]:
    """Every model Ollama lists, newest first, with its /api/tags record."""
    out = []
    for entry in ollama_entries(index):
        record = tag_record(index, entry, prefer)
        if record is not None:
            out.append((entry, record))
    return out


def tags(index: StoreIndex, prefer: tuple[str, ...] = DEFAULT_PREFER) -> dict[str, Any]:
    return {"models": [record for _, record in listing(index, prefer)]}


def tags_json(index: StoreIndex, prefer: tuple[str, ...] = DEFAULT_PREFER) -> bytes:
    """The /api/tags body byte for byte as Ollama's server sends it: Go's json.Marshal
    (compact, `<`, `>`, `&` escaped, invalid text as U+FFFD)."""
    return go_marshal(go_strings(tags(index, prefer)))


def render_table(
    index: StoreIndex, prefer: tuple[str, ...] = DEFAULT_PREFER, now: float | None = None
) -> str:
    rows = [["NAME", "ID", "SIZE", "MODIFIED", "FORMAT", "QUANT"]]
    for entry, m in listing(index, prefer):
        rows.append(
            [
                m["name"],
                listed_tag(index, entry).digest.short,
                # Ollama prints no size for a cloud model (its weights are elsewhere).
                "-" if m.get("remote_model") else human_bytes(m["size"]),
                human_time(entry.modified_ns / 1e9, now),
                m["details"]["format"] or "-",
                m["details"]["quantization_level"] or "-",
            ]
        )
    return table(rows)
