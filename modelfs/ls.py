"""`modelfs ls`: the models in a store, as `ollama list` and Ollama's /api/tags show them."""

from __future__ import annotations

from typing import Any

from modelfs.human import go_strings, human_bytes, human_time, rfc3339_nano, table
from store.manifest import go_marshal
from store.scan import DEFAULT_PREFER, Entry, StoreIndex


def tag_record(index: StoreIndex, entry: Entry, prefer: tuple[str, ...]) -> dict[str, Any] | None:
    """One model as Ollama's ListModelResponse; None if no variant is present locally."""
    variant = entry.preferred(prefer)
    if variant is None:
        return None
    manifest = variant.manifest
    config = index.config(manifest)
    record: dict[str, Any] = {
        "name": entry.name.shortest,
        "model": entry.name.shortest,
    }
    extra = config.extra if config else {}
    for key in ("remote_model", "remote_host"):
        if isinstance(extra.get(key), str) and extra[key]:
            record[key] = extra[key]
    record |= {
        "modified_at": rfc3339_nano(entry.mtime_ns),
        "size": manifest.size,
        "digest": manifest.digest.hex,
        "details": {
            "parent_model": "",
            "format": config.model_format if config else "",
            "family": config.model_family if config else "",
            "families": list(config.model_families) if config and config.model_families else None,
            "parameter_size": config.model_type if config else "",
            "quantization_level": config.file_type if config else "",
        },
    }
    return record


def listing(
    index: StoreIndex, prefer: tuple[str, ...] = DEFAULT_PREFER
) -> list[tuple[Entry, dict[str, Any]]]:
    """Every model with a present variant, newest first, with its /api/tags record."""
    out = []
    for entry in index.sorted_entries():
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
                m["digest"][:12],
                # Ollama prints no size for a cloud model (its weights are elsewhere).
                "-" if m.get("remote_model") else human_bytes(m["size"]),
                human_time(entry.mtime, now),
                m["details"]["format"] or "-",
                m["details"]["quantization_level"] or "-",
            ]
        )
    return table(rows)
