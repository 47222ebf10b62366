"""A stock Ollama's hands on a store it shares (its prune, rm and /api/tags), transcribed from
ollama/ollama at fb30760; its pull client is tests/ollama.py.

Only what decides which blobs Ollama deletes and what `GET /api/tags` answers; each function
cites the Go it stands for. Independent of modelfs's own code (names, manifests and GGUF are
read here afresh), so a test compares two readings of the same store.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOUR = 3600.0
DEFAULT_HOST = "registry.ollama.ai"


class OllamaError(Exception):
    pass


def _valid_part(kind: str, s: str) -> bool:
    """types/model/name.go:333-376 isValidLen + isValidPart."""
    if not 1 <= len(s) <= (350 if kind == "host" else 80):
        return False
    ok = re.compile(r"[A-Za-z0-9_]")
    for i, c in enumerate(s):
        if i == 0:
            if not ok.fullmatch(c):
                return False
        elif c in "_-":
            continue
        elif c == ".":
            if kind == "namespace":
                return False
        elif c == ":":
            if kind != "host":
                return False
        elif not ok.fullmatch(c):
            return False
    return True


def name_from_filepath(rel: str) -> tuple[str, str, str, str] | None:
    """types/model/name.go:182-197 ParseNameFromFilepath, then IsValid (manifest.go:204-205)."""
    parts = rel.split("/")
    if len(parts) != 4:
        return None
    kinds = ("host", "namespace", "model", "tag")
    if not all(_valid_part(k, p) for k, p in zip(kinds, parts, strict=True)):
        return None
    return (parts[0], parts[1], parts[2], parts[3])


def display_shortest(n: tuple[str, str, str, str]) -> str:
    """types/model/name.go:231-249."""
    host, ns, model, tag = n
    if host.lower() != DEFAULT_HOST:
        return f"{host}/{ns}/{model}:{tag}"
    if ns.lower() != "library":
        return f"{ns}/{model}:{tag}"
    return f"{model}:{tag}"


@dataclass
class OllamaManifest:
    name: tuple[str, str, str, str]
    path: Path
    obj: dict[str, Any]
    digest: str  # hex of the file's bytes
    mtime: float

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self.obj.get("layers") or [])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.obj.get("config") or {})

    def digests(self) -> list[str]:
        """`append(m.Layers, m.Config)` digests (manifest.go:83,91)."""
        return [d for d in (x.get("digest", "") for x in [*self.layers, self.config]) if d]

    def size(self) -> int:
        """manifest.go:27-33."""
        return sum(int(x.get("size", 0)) for x in [*self.layers, self.config])


def parse_named_manifest(root: Path, name: tuple[str, str, str, str]) -> OllamaManifest:
    """manifest/manifest.go:112-146: os.Open (follows links), f.Stat, JSON decode, sha256."""
    path = root / "manifests" / "/".join(name)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read()
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise OllamaError(f"{path}: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("layers", []), list):
        raise OllamaError(f"{path}: not a manifest")
    return OllamaManifest(name, path, obj, hashlib.sha256(raw).hexdigest(), st.st_mtime)


def manifests(
    root: Path, continue_on_error: bool
) -> dict[tuple[str, str, str, str], OllamaManifest]:
    """manifest/manifest.go:175-227: Glob(manifests/*/*/*/*), os.Stat each (an error ends
    the whole call, continueOnError or not), skip dirs, parse the name and the manifest."""
    base = root / "manifests"
    out: dict[tuple[str, str, str, str], OllamaManifest] = {}
    for match in sorted(base.glob("*/*/*/*")):
        try:
            st = os.stat(match)
        except OSError as exc:
            raise OllamaError(f"{match}: {exc}") from None
        if stat.S_ISDIR(st.st_mode):
            continue
        rel = str(match.relative_to(base))
        name = name_from_filepath(rel)
        if name is None:
            if not continue_on_error:
                raise OllamaError(f"{rel}: bad manifest name")
            continue
        try:
            out[name] = parse_named_manifest(root, name)
        except (OSError, OllamaError) as exc:
            if not continue_on_error:
                raise OllamaError(str(exc)) from None
    return out


_DIGEST = re.compile(r"sha256[:-][0-9a-fA-F]{64}")


def blobs_path(root: Path, digest: str) -> Path | None:
    """manifest/paths.go:40-60 BlobsPath: None for ErrInvalidDigestFormat."""
    if not _DIGEST.fullmatch(digest):
        return None
    return root / "blobs" / digest.replace(":", "-")


def delete_unused_layers(root: Path, delete: set[str]) -> set[str]:
    """server/images.go:843-872: drop what any manifest names (corrupt ones skipped), remove
    the rest. Returns the digests removed."""
    for m in manifests(root, True).values():
        delete -= set(m.digests())
    removed = set()
    for d in delete:
        path = blobs_path(root, d)
        if path is None:
            continue
        try:
            os.remove(path)
            removed.add(d)
        except OSError:
            continue
    return removed


def startup_prune(root: Path, now: float | None = None) -> set[str]:
    """`ollama serve` without OLLAMA_NOPRUNE: server/routes.go:1963-1981 (no prune when
    Manifests(false) fails), then PruneLayers, server/images.go:874-929 (blobs modified an hour
    ago or more, `-` read as `:`; files that are not digests are removed too)."""
    now = time.time() if now is None else now
    manifests(root, False)  # raises: "corrupt manifests detected, skipping prune operation"
    delete: set[str] = set()
    for entry in os.scandir(root / "blobs"):
        if entry.is_dir():
            continue
        if now - entry.stat().st_mtime < HOUR:
            continue
        name = entry.name.replace("-", ":")
        if blobs_path(root, name) is None:
            os.remove(entry.path)
            continue
        delete.add(name)
    return delete_unused_layers(root, delete)


def rm(root: Path, name: tuple[str, str, str, str]) -> set[str]:
    """`ollama rm`: DeleteHandler, server/routes.go:1247-1298: ParseNamedManifest, Remove
    (manifest.go:61-72: the file, then empty dirs), RemoveLayers (manifest.go:74-110: every
    layer and config digest of it no other manifest names; no grace, OLLAMA_NOPRUNE ignored)."""
    m = parse_named_manifest(root, name)
    os.remove(m.path)
    _prune_dirs(root / "manifests")
    in_use: set[str] = set()
    for other in manifests(root, True).values():
        in_use |= set(other.digests())
    removed = set()
    for d in m.digests():
        if d in in_use:
            continue
        path = blobs_path(root, d)
        if path is not None and path.exists():
            os.remove(path)
            removed.add(d)
    return removed


def repull(root: Path, name: tuple[str, str, str, str], raw: bytes) -> set[str]:
    """`ollama pull` of a tag that exists, once its blobs are here: server/images.go:998-1015
    (the old manifest's layers and config), :1107 (the new bytes written), :1115-1120
    (deleteUnusedLayers, unless OLLAMA_NOPRUNE)."""
    old = parse_named_manifest(root, name)
    (root / "manifests" / "/".join(name)).write_bytes(raw)
    return delete_unused_layers(root, set(old.digests()))


def _prune_dirs(path: Path) -> None:
    """manifest/manifest.go PruneDirectory: empty directories go, bottom up."""
    for dirpath, _, _ in sorted(os.walk(path), key=lambda t: -len(t[0])):
        if Path(dirpath) != path and not os.listdir(dirpath):
            os.rmdir(dirpath)


# -- GET /api/tags --------------------------------------------------------------------------
def _gguf_info(path: Path) -> tuple[list[str], int, int, str] | None:
    """server/model_list_cache.go:503-626 readModelListGGUF, read with the `gguf` package."""
    import gguf

    from modelfs.store.formats.gguf import (
        FILE_TYPES,  # fs/ggml/type.go's names, the table a test checks
    )

    try:
        reader = gguf.GGUFReader(path)
    except Exception:
        return None
    caps: list[str] = []
    arch, ctx, emb, ftype, pooling = "", 0, 0, "", False
    for fld in reader.fields.values():
        key = fld.name
        if key.startswith("GGUF."):
            continue
        value = fld.contents()
        if key == "general.architecture":
            arch = value
            continue
        if key == "general.file_type":
            ftype = FILE_TYPES.get(int(value), "unknown")
            continue
        if arch and key.startswith("tokenizer."):
            break
        if arch and key.startswith(arch + "."):
            sub = key[len(arch) + 1 :]
            if sub == "pooling_type":
                pooling = True
            elif sub in ("vision.block_count", "audio.block_count"):
                if sub.split(".")[0] not in caps:
                    caps.append(sub.split(".")[0])
            elif sub == "context_length":
                ctx = int(value)
            elif sub == "embedding_length":
                emb = int(value)
    caps.append("embedding" if pooling else "completion")
    return caps, ctx, emb, ftype


def _template_vars(text: str) -> set[str] | None:
    """template/template.go:171-189 Vars: field names in actions, lower-cased. Go's
    text/template parser is not transcribed; an unclosed action stands for a parse error."""
    actions = re.findall(r"\{\{(.*?)\}\}", text, re.DOTALL)
    if text.count("{{") != len(actions):
        return None
    return {f.lower() for a in actions for f in re.findall(r"(?<![\w)\]])\$?\.([A-Za-z_]\w*)", a)}


def _add(caps: list[str], cap: str) -> None:
    if cap and cap not in caps:
        caps.append(cap)


def summary(root: Path, m: OllamaManifest) -> dict[str, Any] | None:
    """server/model_list_cache.go:311-397 buildModelListSummary (an error leaves the model
    out, :101-106), readModelListConfig :416-433, readModelListLayers :435-470, the filters
    :399-414; api/types.go:822-842,933-942 for the JSON. Not transcribed: thinking inferred
    from the template's tags and the built-in parsers' tool/thinking support (:368-388)."""
    cfg: dict[str, Any] = {}
    if m.config.get("digest"):
        path = blobs_path(root, m.config["digest"])
        try:
            cfg = json.loads((path or Path("/nonexistent")).read_bytes())
        except (OSError, ValueError):
            return None
    model_path, parent, projectors, vars_ = None, "", 0, set()
    for layer in m.layers:
        media = layer.get("mediaType")
        if media == "application/vnd.ollama.image.model":
            model_path, parent = blobs_path(root, layer.get("digest", "")), layer.get("from", "")
            if model_path is None:
                return None
        elif media == "application/vnd.ollama.image.projector":
            projectors += 1
        elif media in (
            "application/vnd.ollama.image.prompt",
            "application/vnd.ollama.image.template",
        ):
            path = blobs_path(root, layer.get("digest", ""))
            try:
                text = (path or Path("/nonexistent")).read_bytes().decode("utf-8", "replace")
            except OSError:
                return None
            found = _template_vars(text)
            if found is None:
                return None
            vars_ = found
    details: dict[str, Any] = {
        "parent_model": parent,
        "format": cfg.get("model_format", ""),
        "family": cfg.get("model_family", ""),
        "families": cfg.get("model_families") or None,
        "parameter_size": cfg.get("model_type", ""),
        "quantization_level": cfg.get("file_type", ""),
        "context_length": cfg.get("context_length", 0),
        "embedding_length": cfg.get("embedding_length", 0),
    }
    caps: list[str] = []
    remote = {k: cfg[k] for k in ("remote_model", "remote_host") if cfg.get(k)}
    if not remote and model_path is not None:
        info = _gguf_info(model_path)
        if info is not None:
            caps += info[0]
            details["context_length"] = details["context_length"] or info[1]
            details["embedding_length"] = details["embedding_length"] or info[2]
            if details["quantization_level"] in ("", "unknown") and info[3] not in ("", "unknown"):
                details["quantization_level"] = info[3]
    for c in cfg.get("capabilities") or []:
        _add(caps, c)
    if "tools" in vars_:
        _add(caps, "tools")
    if "suffix" in vars_:
        _add(caps, "insert")
    if cfg.get("model_family") in ("gptoss", "gpt-oss"):
        _add(caps, "thinking")
    if projectors:
        _add(caps, "vision")
    fams = cfg.get("model_families") or []
    if cfg.get("model_format") == "safetensors" and (
        cfg.get("renderer") in ("gemma4", "gemma4-small", "gemma4-large")
        or "nemotron-3-nano" in (cfg.get("parser"), cfg.get("renderer"))
        or "nemotron_h_omni" in (cfg.get("model_family"), *fams)
    ):
        caps = [c for c in caps if c not in ("vision", "audio")]
    if cfg.get("model_format") == "safetensors" and cfg.get("renderer") == "glimmer":
        caps = [c for c in caps if c != "audio"]
    for k in ("context_length", "embedding_length"):  # omitempty
        if not details[k]:
            del details[k]
    short = display_shortest(m.name)
    out: dict[str, Any] = {"name": short, "model": short, **remote}
    out["modified_at"] = m.mtime
    out |= {"size": m.size(), "digest": m.digest, "details": details}
    if caps:
        out["capabilities"] = caps
    return out


def api_tags(root: Path) -> list[dict[str, Any]]:
    """GET /api/tags: server/routes.go:1632-1645 -> modelListCache.List,
    server/model_list_cache.go:145-230 (Manifests(true), a summary per manifest), sorted by
    ModifiedAt.Unix() descending, stable (:865-870; ties come in Go's random map order).
    `modified_at` is left as the mtime in seconds (float) for the caller to compare."""
    out = []
    for m in manifests(root, True).values():
        s = summary(root, m)
        if s is not None:
            out.append(s)
    out.sort(key=lambda s: -int(s["modified_at"]))
    return out


def mtime_of(rfc3339: str) -> float:
    """An RFC 3339 time with nanoseconds (as Go marshals time.Time) as seconds."""
    head, _, rest = rfc3339.partition(".")
    frac, zone = re.match(r"(\d*)(.*)", rest).groups()  # type: ignore[union-attr]
    dt = datetime.datetime.fromisoformat(head + (zone or "") if rest else rfc3339)
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)
