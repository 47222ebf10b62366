"""OCI model artifacts of other tools (Docker Model Runner, CNCF ModelPack), landed as Ollama
models.

    artifact_kind(manifest) -> OLLAMA | DOCKER_MODEL | MODELPACK    (UnknownArtifactError)
    land(store, manifest) -> the Ollama manifest's bytes   (its config and params blobs written)
    pack(manifest, config, fmt) -> Packed(raw, blobs)     an Ollama model as such an artifact
    source_artifact(layout, manifest, fmt) -> Manifest | None   a landed one as it came

A pulled manifest that is not Ollama's own is translated once its blobs are here: the weight
layers keep their digests (the artifact's own blobs, never copied or re-encoded, so a blob
shared with an Ollama model is stored once) under Ollama's media types, and a config blob
Ollama reads (ConfigV2, ollama/ollama@fb30760 types/model/config.go) is written beside them.
Ollama's GetModel (server/images.go:711-786 at that commit) switches on a layer's media type and
skips the ones it does not know, and Go's JSON decoder skips unknown config fields, so:

- the source artifact's config blob stays in the manifest as a layer of its own media type
  (our GC keeps it, a re-pull of the unchanged artifact finds every blob here and fetches
  nothing, and a push can give it back byte for byte);
- a Jinja chat template stays under its own media type: Ollama's `template` layer is a Go
  template (`template.Parse`, images.go:741-751), which a Jinja text is not; the GGUF carries
  its own `tokenizer.chat_template`, which Ollama reads;
- the config records the source in `modelfs_source`: the artifact's manifest digest, media type
  and artifact type (`modelfs show` and the history see where the model came from), and the
  source manifest's own bytes are a layer too, so a push in the same format gives the registry
  the artifact as it came, the same digest (`source_artifact`);
- safetensors weights become Ollama's safetensors layout: each weight file a `tensor` layer
  named by its path, each `.json` config file but the shard index a `json` layer;
- an uncompressed tar layer (weights, their config files, docs) is kept whole, and the files of
  it Ollama reads are copied out into blobs of their own (store.formats.oci_tar checks every
  member first); a compressed tar of weights is refused before any fetch.

`pack` is the way out: the layers Ollama's and the format's types both name (GGUF weights,
projector, license) are given the format's type, the others keep Ollama's; the Ollama config
blob and the Ollama manifest's own bytes travel as two more layers, so that `land` gives back
the identical Ollama model (those bytes, verbatim) when all the blobs they name came along.

The formats, as their own repositories define them:

Docker Model Runner, docker/model-runner@642c72117b2431a6b871796883af1aaf013fc3cf:
pkg/distribution/types/config.go (media types, the config's JSON fields), and
pkg/distribution/internal/partial/partial.go ManifestForLayers (an OCI image manifest, config
media type `...model.config.v0.1+json` unless the model says otherwise, no artifactType).

CNCF ModelPack, modelpack/model-spec@d78bf3231b4f26196c4a955e1007ccc47e19a77c:
docs/spec.md (manifest: OCI media type, artifactType and config media type required; layer
media types), specs-go/v1/mediatype.go, specs-go/v1/config.go (the config's JSON fields),
specs-go/v1/annotations.go (`org.cncf.model.filepath`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.errors import ManifestError, SafetensorsError
from modelfs.store.formats.oci_tar import TarMember, TarSlice, plain_path, tar_members
from modelfs.store.formats.safetensors import read_safetensors_header
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_CONFIG_BYTES,
    MEDIA_CONFIG,
    MEDIA_MANIFEST,
    MEDIA_OCI_MANIFEST,
    Layer,
    Manifest,
    ModelConfig,
    go_marshal,
    parse_config,
    parse_manifest,
)

OLLAMA = "ollama"
DOCKER_MODEL = "docker-model"
MODELPACK = "modelpack"

# Docker Model Runner: pkg/distribution/types/config.go
DMR_CONFIG_V01 = "application/vnd.docker.ai.model.config.v0.1+json"
DMR_CONFIG_V02 = "application/vnd.docker.ai.model.config.v0.2+json"
DMR_GGUF = "application/vnd.docker.ai.gguf.v3"
DMR_SAFETENSORS = "application/vnd.docker.ai.safetensors"
DMR_LICENSE = "application/vnd.docker.ai.license"
DMR_MMPROJ = "application/vnd.docker.ai.mmproj"
DMR_CHAT_TEMPLATE = "application/vnd.docker.ai.chat.template.jinja"
DMR_MODEL_FILE = "application/vnd.docker.ai.model.file"
DMR_VLLM_CONFIG_TAR = "application/vnd.docker.ai.vllm.config.tar"
DMR_DIR_TAR = "application/vnd.docker.ai.dir.tar"
DMR_CONFIGS = (DMR_CONFIG_V01, DMR_CONFIG_V02)

# ModelPack: specs-go/v1/mediatype.go
MP_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MP_CONFIG = "application/vnd.cncf.model.config.v1+json"
MP_WEIGHT_RAW = "application/vnd.cncf.model.weight.v1.raw"
MP_WEIGHT_CONFIG_RAW = "application/vnd.cncf.model.weight.config.v1.raw"
MP_DOC_RAW = "application/vnd.cncf.model.doc.v1.raw"
# The tar layers whose files a model needs (weights, their config files, its license): the
# `.raw` type of the same kind names each file unpacked. `+gzip`/`+zstd` ones are refused
# (_compressed); code and dataset tars, which no runner reads, are kept whole.
MP_UNPACKED = {
    "application/vnd.cncf.model.weight.v1.tar": MP_WEIGHT_RAW,
    "application/vnd.cncf.model.weight.config.v1.tar": MP_WEIGHT_CONFIG_RAW,
    "application/vnd.cncf.model.doc.v1.tar": MP_DOC_RAW,
}
MP_PREFIX = "application/vnd.cncf.model."
# Read by Docker Model Runner, not in the spec (docker/model-runner, pkg/distribution/
# modelpack/types.go: "a DMR extension ... kept for read-compatibility").
MP_WEIGHT_GGUF = "application/vnd.cncf.model.weight.v1.gguf"
MP_WEIGHT_SAFETENSORS = "application/vnd.cncf.model.weight.v1.safetensors"
# specs-go/v1/annotations.go AnnotationFilepath (docker/model-runner uses the same key)
ANNOTATION_FILEPATH = "org.cncf.model.filepath"

# Ollama's own: ollama/ollama@fb30760 server/images.go:711-786
OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR = "application/vnd.ollama.image.projector"
OLLAMA_LICENSE = "application/vnd.ollama.image.license"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"
# Ollama's safetensors layout (x/create/writer.go, x/create/pipeline.go importConfigBlobs at
# fb30760): `tensor` layers (its mlx runner loads every tensor of each such blob,
# x/mlxrunner/runner.go loadTensorsFromManifest) and a `json` layer per `.json` file but the
# shard index, each named by its path.
OLLAMA_TENSOR = "application/vnd.ollama.image.tensor"
OLLAMA_JSON = "application/vnd.ollama.image.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Config media types of manifests Ollama (and modelfs) write: Docker's, and the OCI one.
_OLLAMA_CONFIGS = (MEDIA_CONFIG, "application/vnd.oci.image.config.v1+json")

SOURCE_KEY = "modelfs_source"


class UnknownArtifactError(ManifestError):
    """A manifest that is neither an Ollama model nor an artifact format modelfs knows."""


class UnsupportedArtifactError(ManifestError):
    """A known artifact format whose layers modelfs cannot (yet) land as an Ollama model."""


@dataclass(frozen=True, slots=True)
class _Top:
    artifact_type: str
    media_type: str


def _top(manifest: Manifest) -> _Top:
    try:
        obj = json.loads(manifest.raw)
    except ValueError:
        obj = {}
    at = obj.get("artifactType") if isinstance(obj, dict) else None
    return _Top(at if isinstance(at, str) else "", manifest.media_type)


def _describe(manifest: Manifest, top: _Top) -> str:
    config = manifest.config.media_type if manifest.config else "none"
    layers = ", ".join(dict.fromkeys(layer.media_type for layer in manifest.layers)) or "none"
    return f"artifactType {top.artifact_type or 'none'}, config {config}, layers {layers}"


def artifact_kind(manifest: Manifest) -> str:
    """Which format a pulled plain manifest is in; an unknown one is an error naming its
    artifactType and media types (raised before anything is fetched or written)."""
    top = _top(manifest)
    config = manifest.config.media_type if manifest.config else ""
    if top.artifact_type == MP_ARTIFACT or config == MP_CONFIG:
        return MODELPACK
    if config in DMR_CONFIGS:
        return DOCKER_MODEL
    if not top.artifact_type and config in ("", *_OLLAMA_CONFIGS):
        return OLLAMA
    raise UnknownArtifactError(
        f"manifest {manifest.digest.short} is not a model modelfs knows "
        f"({_describe(manifest, top)})"
    )


# MediaTypeModelWeightGzip/Zstd and MediaTypeModelWeightConfigGzip/Zstd: their files would
# have to be inflated into blobs that are not the artifact's, with the tar kept beside them.
_COMPRESSED_WEIGHTS = frozenset(
    f"application/vnd.cncf.model.{kind}.v1.tar+{codec}"
    for kind in ("weight", "weight.config")
    for codec in ("gzip", "zstd")
)


def check_artifact(manifest: Manifest) -> str:
    """`artifact_kind`, and for another tool's artifact the refusals its manifest alone
    decides (before anything is fetched): a config larger than any, compressed weight tars, a
    GGUF in shards, a Docker Model Runner model with neither GGUF nor safetensors weights."""
    kind = artifact_kind(manifest)
    if kind == OLLAMA:
        return kind
    what = f"{kind} artifact {manifest.digest.short}"
    if manifest.config is not None and manifest.config.size > MAX_CONFIG_BYTES:
        # `land` reads it whole: refused now, not once gigabytes are on disk and in memory.
        raise UnsupportedArtifactError(
            f"{what}: a config of {manifest.config.size} bytes, more than a model's config can "
            f"be ({MAX_CONFIG_BYTES}); refused"
        )
    for layer in manifest.layers:
        if layer.media_type in _COMPRESSED_WEIGHTS:
            raise UnsupportedArtifactError(
                f"{what}: {layer.media_type} is a compressed tar; only uncompressed (.tar) and "
                "raw weight layers are landed"
            )
    media = [x.media_type for x in manifest.layers]
    ggufs = sum(m in (DMR_GGUF, MP_WEIGHT_GGUF) for m in media)
    _one_gguf(ggufs, what)
    if kind == DOCKER_MODEL and not ggufs and DMR_SAFETENSORS not in media:  # DDUF, …
        raise UnsupportedArtifactError(
            f"{what}: no GGUF or safetensors weights ({_describe(manifest, _top(manifest))})"
        )
    return kind


def _one_gguf(count: int, what: str) -> None:
    """A sharded GGUF is refused: Ollama runs one `model` layer (GetModel keeps the last,
    server/images.go:717-718 at fb30760), and its own create merges shards into a new blob
    (server/create.go mergeSplitGGUFLayers), which would not be the artifact's bytes."""
    if count > 1:
        raise UnsupportedArtifactError(
            f"{what}: a GGUF in {count} shards is not landed as an Ollama model yet"
        )


def _text(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    return value if isinstance(value, str) else ""


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the source config says, in Ollama's terms."""

    fmt: str
    family: str
    params: str
    quant: str
    context: int | None


# Docker Model Runner's `context_size` is a Go *int32 (types/config.go Config.ContextSize): a
# number past it is no context size that tool wrote or would read, and as Ollama's num_ctx it
# would be a KV cache no host can allocate (or, past int64, a Go conversion's garbage).
_MAX_CONTEXT = (1 << 31) - 1


def _dmr_facts(cfg: dict[str, Any]) -> _Facts:
    inner = cfg.get("config")
    inner = inner if isinstance(inner, dict) else {}
    ctx = inner.get("context_size")
    usable = isinstance(ctx, int) and not isinstance(ctx, bool) and 0 < ctx <= _MAX_CONTEXT
    return _Facts(
        _text(inner, "format"),
        _text(inner, "architecture"),
        _text(inner, "parameters"),
        _text(inner, "quantization"),
        ctx if usable else None,
    )


def _modelpack_facts(cfg: dict[str, Any]) -> _Facts:
    inner = cfg.get("config")
    inner = inner if isinstance(inner, dict) else {}
    desc = cfg.get("descriptor")
    desc = desc if isinstance(desc, dict) else {}
    # The spec's `architecture` is "transformer, cnn, ..."; the family (llama3, qwen2) is the
    # descriptor's.
    return _Facts(
        _text(inner, "format"),
        _text(desc, "family"),
        _text(inner, "paramSize"),
        _text(inner, "quantization"),
        None,
    )


def _filepath(layer_obj: dict[str, Any], what: str) -> str:
    """The file a raw layer is, by its annotation: held to a tar member's rule (it names a
    tensor or json layer, which the mount and other tools make a file of)."""
    ann = layer_obj.get("annotations")
    path = _text(ann, ANNOTATION_FILEPATH) if isinstance(ann, dict) else ""
    return plain_path(path, f"{what}: filepath") if path else ""


@dataclass(frozen=True, slots=True)
class _File:
    """One file of an artifact: a raw layer (its digest), or a member of a tar layer (copied
    out into a blob of its own only if Ollama reads it)."""

    index: int  # of its layer in the source manifest
    media: str  # a tar member's: the raw type of its tar's kind
    path: str
    size: int
    digest: Digest | None = None
    tar: Path | None = None
    member: TarMember | None = None

    @property
    def low(self) -> str:
        return self.path.lower()


def _is_gguf(f: _File, fmt: str) -> bool:
    if f.media in (DMR_GGUF, MP_WEIGHT_GGUF):
        return True
    return f.media == MP_WEIGHT_RAW and (
        f.low.endswith(".gguf") or (fmt.lower() == "gguf" and not f.low.endswith(".safetensors"))
    )


def _is_safetensors(f: _File, fmt: str) -> bool:
    if f.media in (DMR_SAFETENSORS, MP_WEIGHT_SAFETENSORS):
        return True
    return f.media == MP_WEIGHT_RAW and (
        f.low.endswith(".safetensors") or (fmt.lower() == "safetensors" and not f.path)
    )


def _weights(files: list[_File], fmt: str, what: str, describe: str) -> str:
    """`gguf` or `safetensors`: what the artifact's weights are; both or neither is refused."""
    gguf = any(_is_gguf(f, fmt) for f in files)
    safetensors = any(_is_safetensors(f, fmt) for f in files)
    if gguf and safetensors:
        raise UnsupportedArtifactError(f"{what}: both GGUF and safetensors weights; refused")
    if not (gguf or safetensors):
        raise UnsupportedArtifactError(f"{what}: no GGUF or safetensors weights ({describe})")
    return "gguf" if gguf else "safetensors"


def _is_json_config(path: str) -> bool:
    return path.endswith(".json") and _base(path) != SAFETENSORS_INDEX


def _ollama_type(kind: str, f: _File, weights: str, fmt: str, what: str) -> str | None:
    """Ollama's media type for one file of the source; None: kept under its own type (Ollama
    skips it). Weights Ollama cannot run as they are are refused."""
    media, path = f.media, f.low
    st = weights == "safetensors"
    if kind == DOCKER_MODEL:
        by_type = {DMR_GGUF: OLLAMA_MODEL, DMR_SAFETENSORS: OLLAMA_TENSOR}
        by_type |= {DMR_MMPROJ: OLLAMA_PROJECTOR, DMR_LICENSE: OLLAMA_LICENSE}
        if media == DMR_MODEL_FILE and st and _is_json_config(path):
            return OLLAMA_JSON
        return by_type.get(media)
    if media in (MP_WEIGHT_RAW, MP_WEIGHT_GGUF, MP_WEIGHT_SAFETENSORS):
        if not st and media == MP_WEIGHT_RAW and _base(path).startswith("mmproj"):
            return OLLAMA_PROJECTOR
        if not st and _is_gguf(f, fmt):
            return OLLAMA_MODEL
        if st and _is_safetensors(f, fmt):
            return OLLAMA_TENSOR
        raise UnsupportedArtifactError(
            f"{what}: {f.path or 'a weight layer'} ({media}, format {fmt or 'unset'}) is not "
            f"{'safetensors' if st else 'GGUF'} like the model's other weights; refused"
        )
    if media == MP_WEIGHT_CONFIG_RAW and st and _is_json_config(path):
        return OLLAMA_JSON
    if media == MP_DOC_RAW and _base(path).startswith(("license", "licence")):
        return OLLAMA_LICENSE
    return None


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _descriptor(media: str, digest: Digest, size: int) -> dict[str, Any]:
    return {"mediaType": media, "digest": str(digest), "size": size}


def _unpacked_type(kind: str, media: str) -> str | None:
    """The raw type of a tar layer's files, if the tar is unpacked (its files a model needs)."""
    if kind == DOCKER_MODEL:
        return DMR_MODEL_FILE if media in (DMR_VLLM_CONFIG_TAR, DMR_DIR_TAR) else None
    return MP_UNPACKED.get(media)


def _files(
    store: BlobStore, kind: str, manifest: Manifest, what: str
) -> tuple[list[_File], list[tuple[int, dict[str, Any]]]]:
    """Every file of the artifact (a tar's members checked whole, nothing copied yet), and
    the tar layers, kept as they came (a push gives them back byte for byte)."""
    # parse_manifest has read these bytes: a JSON object with a list of layer objects.
    layers_obj = json.loads(manifest.raw)["layers"]
    files: list[_File] = []
    tars: list[tuple[int, dict[str, Any]]] = []
    for i, (layer, obj) in enumerate(zip(manifest.layers, layers_obj, strict=True)):
        unpacked = _unpacked_type(kind, layer.media_type)
        if unpacked is None:
            path = _filepath(obj, what)
            files.append(_File(i, layer.media_type, path, layer.size, layer.digest))
            continue
        blob = store.layout.blob(layer.digest)
        label = f"{what}: tar layer {layer.digest.short}"
        for m in tar_members(blob, label):
            files.append(_File(i, unpacked, m.name, m.size, tar=blob, member=m))
        tars.append((i, _descriptor(layer.media_type, layer.digest, layer.size)))
    named: set[str] = set()
    for f in files:
        if f.path and f.path in named:
            raise UnsupportedArtifactError(f"{what}: two files are named {f.path!r}; refused")
        named.add(f.path)
    return files, tars


def _open(store: BlobStore, f: _File) -> BinaryIO:
    if f.tar is not None and f.member is not None:
        return io.BufferedReader(TarSlice(f.tar, f.member))
    assert f.digest is not None  # a raw layer's file
    return store.layout.blob(f.digest).open("rb")


def _blob_sizes(store: BlobStore) -> set[int]:
    """The sizes of the blobs here, one directory read: a member of a size none has is new."""
    sizes: set[int] = set()
    with contextlib.suppress(FileNotFoundError), os.scandir(store.layout.blobs) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                sizes.add(entry.stat(follow_symlinks=False).st_size)
    return sizes


def _copy_out(store: BlobStore, f: _File, sizes: set[int]) -> Digest:
    """A tar member's blob. One of a size some blob here has may be here already (a re-pull of
    an unchanged artifact, another artifact with the same file): hashed first, and if it is,
    only touched, not written again; any other is copied in one pass."""
    if f.size in sizes:
        h = hashlib.sha256()
        with _open(store, f) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
        digest = Digest(h.hexdigest())
        with contextlib.suppress(FileNotFoundError):
            if store.has(digest, f.size):
                os.utime(store.layout.blob(digest))  # a fresh mtime, as a write would give
                return digest
    with _open(store, f) as src:
        return store.put_stream(src)


def _check_safetensors(store: BlobStore, f: _File, what: str) -> None:
    with _open(store, f) as src:
        try:
            read_safetensors_header(src, f.path or "weights", f.size)
        except SafetensorsError as exc:
            raise UnsupportedArtifactError(f"{what}: {exc}") from None


def _check_gguf(store: BlobStore, f: _File, what: str) -> None:
    """A file landed as Ollama's model or projector starts with GGUF's magic: one taken for
    GGUF by the config's `format` alone (a `pytorch_model.bin` under format gguf) is no model
    Ollama could load, refused as a `.safetensors` that is none is."""
    with _open(store, f) as src:
        head = src.read(4)
    if head != b"GGUF":
        raise UnsupportedArtifactError(
            f"{what}: {f.path or 'the weights'} is no GGUF file (it starts {head!r}); refused"
        )


def _tensor_name(f: _File) -> str:
    """The layer's `name`: the file's path without `.safetensors` (the mount shows
    `tensors/<name>.safetensors`)."""
    if f.path:
        return f.path.removesuffix(".safetensors")
    return f"weights-{f.index}"


def land(store: BlobStore, manifest: Manifest) -> bytes:
    """The Ollama manifest for a Docker Model Runner or ModelPack artifact whose blobs are all
    in `store`: its config blob, a params blob for a context size, the source manifest and
    the tar members Ollama reads written here first (every refusal decided before); the same
    artifact always gives the same bytes."""
    kind = check_artifact(manifest)
    if kind == OLLAMA:
        return manifest.raw
    what = f"{kind} artifact {manifest.digest.short}"
    embedded = _embedded(store, manifest)
    if embedded is not None:
        return embedded
    if manifest.config is None:
        raise ManifestError(f"{what}: no config")
    src_cfg = manifest.config
    cfg = parse_config(store.layout.blob(src_cfg.digest).read_bytes(), f"{what}: config").extra
    facts = _dmr_facts(cfg) if kind == DOCKER_MODEL else _modelpack_facts(cfg)
    files, kept = _files(store, kind, manifest, what)
    weights = _weights(files, facts.fmt, what, _describe(manifest, _top(manifest)))
    mapped = [(f, _ollama_type(kind, f, weights, facts.fmt, what)) for f in files]
    models = [f for f, media in mapped if media == OLLAMA_MODEL]
    _one_gguf(len(models), what)
    for f, media in mapped:
        if media == OLLAMA_TENSOR:
            _check_safetensors(store, f, what)
        elif media in (OLLAMA_MODEL, OLLAMA_PROJECTOR):
            _check_gguf(store, f, what)

    # Every refusal is behind us: now blobs are written.
    sizes = _blob_sizes(store) if any(f.digest is None and m for f, m in mapped) else set()
    first: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    for f, media in mapped:
        if media is None:
            if f.digest is not None:  # a raw layer (a tar's member is in the kept tar)
                kept.append((f.index, _descriptor(f.media, f.digest, f.size)))
            continue
        digest = f.digest or _copy_out(store, f, sizes)
        d = _descriptor(media, digest, f.size)
        if media == OLLAMA_TENSOR:
            d["name"] = _tensor_name(f)
        elif media == OLLAMA_JSON:
            d["name"] = f.path
        (first if media in (OLLAMA_MODEL, OLLAMA_TENSOR) else others).append(d)
    if facts.context is not None:
        params = go_marshal({"num_ctx": facts.context})
        others.append(_descriptor(OLLAMA_PARAMS, store.put_bytes(params), len(params)))
    kept.sort(key=lambda x: x[0])
    tail = [d for _, d in kept]
    tail.append(_descriptor(src_cfg.media_type, src_cfg.digest, src_cfg.size))
    # The source manifest's own bytes: a push in its format gives them back (source_artifact).
    source_digest = store.put_bytes(manifest.raw)
    tail.append(_descriptor(manifest.media_type, source_digest, len(manifest.raw)))

    config_raw = go_marshal(_config_v2(facts, weights, manifest, kind))
    config_digest = store.put_bytes(config_raw)
    return go_marshal(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config_digest, len(config_raw)),
            "layers": [*first, *others, *tail],
        }
    )


def _config_v2(facts: _Facts, weights: str, manifest: Manifest, kind: str) -> dict[str, Any]:
    """Ollama's ConfigV2 in its Go field order (types/model/config.go at fb30760), with the
    source recorded after it (unknown to Ollama's decoder, so skipped)."""
    top = _top(manifest)
    source: dict[str, Any] = {"format": kind, "digest": str(manifest.digest)}
    source["mediaType"] = top.media_type
    if top.artifact_type:
        source["artifactType"] = top.artifact_type
    config: dict[str, Any] = {
        "model_format": weights,
        "model_family": facts.family,
        "model_families": [facts.family] if facts.family else None,
        "model_type": facts.params,
        "file_type": facts.quant,
    }
    if weights == "safetensors":
        # Ollama reads a safetensors model's capabilities from its config alone (server/
        # images.go configCapabilities; ggufCapabilities is for GGUF), and its own import
        # starts them at "completion" (x/create/client/create.go inferSafetensorsCapabilities).
        config["capabilities"] = ["completion"]
    return config | {"architecture": "amd64", "os": "linux", SOURCE_KEY: source}


def _embedded(store: BlobStore, manifest: Manifest) -> bytes | None:
    """The Ollama manifest `pack` put in the artifact, if every blob it names came along."""
    carried = [x for x in manifest.layers if x.media_type == MEDIA_MANIFEST]
    if len(carried) != 1:
        return None
    raw = store.layout.blob(carried[0].digest).read_bytes()
    try:
        inner = parse_manifest(raw, f"blob {carried[0].digest}")
    except ManifestError:
        return None
    if not isinstance(inner, Manifest):
        return None
    # Each blob by digest and size: the pull fetched and checked the artifact's sizes, and a
    # manifest naming another size would name a blob that is not here.
    present = {(x.digest, x.size) for x in manifest.layers}
    refs = [inner.config, *inner.layers] if inner.config is not None else inner.layers
    return raw if all((x.digest, x.size) in present for x in refs) else None


@dataclass(frozen=True, slots=True)
class Packed:
    """An artifact for a registry: its manifest, and the blobs it names that the store does not
    hold (its config, the carried Ollama manifest); the others are the Ollama model's."""

    raw: bytes
    blobs: dict[Digest, bytes]


_PACKED_TYPES = {
    DOCKER_MODEL: {
        OLLAMA_MODEL: DMR_GGUF,
        OLLAMA_PROJECTOR: DMR_MMPROJ,
        OLLAMA_LICENSE: DMR_LICENSE,
        OLLAMA_TENSOR: DMR_SAFETENSORS,
        OLLAMA_JSON: DMR_MODEL_FILE,
    },
    # As docker/model-runner's own ModelPack output maps them (pkg/distribution/modelpack/
    # convert.go ClassifyLayer at 642c7211): weights raw, config files weight config, docs.
    MODELPACK: {
        OLLAMA_MODEL: MP_WEIGHT_RAW,
        OLLAMA_PROJECTOR: MP_WEIGHT_RAW,
        OLLAMA_LICENSE: MP_DOC_RAW,
        OLLAMA_TENSOR: MP_WEIGHT_RAW,
        OLLAMA_JSON: MP_WEIGHT_CONFIG_RAW,
    },
}
# ModelPack names a raw layer's file (specs-go/v1/annotations.go); the names the mount gives.
_PACKED_PATHS = {
    OLLAMA_MODEL: "model.gguf",
    OLLAMA_PROJECTOR: "mmproj.gguf",
    OLLAMA_LICENSE: "LICENSE",
}


def _packed_weights(manifest: Manifest, config: ModelConfig) -> str | None:
    """`gguf` (one model layer) or `safetensors` (tensor layers, no model layer): what
    `pack` can lay out; None otherwise."""
    media = [x.media_type for x in manifest.layers]
    fmt = config.model_format
    if media.count(OLLAMA_MODEL) == 1 and OLLAMA_TENSOR not in media and fmt in ("", "gguf"):
        return "gguf"
    if OLLAMA_TENSOR in media and OLLAMA_MODEL not in media and fmt in ("", "safetensors"):
        return "safetensors"
    return None


def _packed_path(layer: Layer, fmt: str, seen: dict[str, int]) -> str | None:
    """The file a packed layer is (the filepath annotation): a tensor layer's name plus
    `.safetensors`, a json layer's name (both formats read it, docker/model-runner
    pkg/distribution/internal/partial/layer.go); for ModelPack also the GGUF, projector and
    license."""
    if layer.media_type == OLLAMA_TENSOR and layer.name:
        return f"{layer.name}.safetensors"
    if layer.media_type == OLLAMA_JSON and layer.name:
        return layer.name
    if fmt == MODELPACK and layer.media_type in _PACKED_PATHS:
        n = seen[layer.media_type] = seen.get(layer.media_type, 0) + 1
        return _PACKED_PATHS[layer.media_type] + (f"-{n}" if n > 1 else "")
    return None


def pack(manifest: Manifest, config: ModelConfig | None, fmt: str) -> Packed:
    """`manifest` (a plain Ollama model of one GGUF, or of safetensors tensor layers) as a
    `fmt` artifact (DOCKER_MODEL, MODELPACK)."""
    label = f"manifest {manifest.digest.short}"
    if config is None or manifest.config is None:
        raise UnsupportedArtifactError(f"{label}: no config blob to describe the model with")
    weights = _packed_weights(manifest, config)
    if weights is None:
        raise UnsupportedArtifactError(
            f"{label}: only a model of one GGUF layer or of safetensors tensor layers is pushed "
            f"as {fmt}"
        )
    types = _PACKED_TYPES[fmt]
    layers: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for layer in manifest.layers:
        d = _descriptor(types.get(layer.media_type, layer.media_type), layer.digest, layer.size)
        path = _packed_path(layer, fmt, seen)
        if path is not None:
            # Other tools unpack the artifact by these paths: a layer name that could leave
            # the model's directory goes nowhere, as a pull refuses it (`_filepath`).
            path = plain_path(path, f"{label}: layer {layer.digest.short}'s file")
            d["annotations"] = {ANNOTATION_FILEPATH: path}
        layers.append(d)
    layers.append(_descriptor(MEDIA_CONFIG, manifest.config.digest, manifest.config.size))
    layers.append(_descriptor(MEDIA_MANIFEST, manifest.digest, len(manifest.raw)))
    diff_ids = [d["digest"] for d in layers]
    if fmt == DOCKER_MODEL:
        # types/config.go ConfigFile; builder/builder.go:152-155 (rootfs type "rootfs")
        facts = {"format": weights, "quantization": config.file_type}
        facts |= {"parameters": config.model_type, "architecture": config.model_family}
        cfg: dict[str, Any] = {
            "config": {k: v for k, v in facts.items() if v},
            "descriptor": {},
            "rootfs": {"type": "rootfs", "diff_ids": diff_ids},
        }
        top: dict[str, Any] = {"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST}
        # v0.2: a layer per file, each named by its filepath (types/config.go)
        config_type = DMR_CONFIG_V01 if weights == "gguf" else DMR_CONFIG_V02
    else:
        # specs-go/v1/config.go Model; docs/spec.md (artifactType, config media type)
        facts = {"format": weights, "paramSize": config.model_type}
        facts["quantization"] = config.file_type
        cfg = {
            "descriptor": {"family": config.model_family} if config.model_family else {},
            "config": {k: v for k, v in facts.items() if v},
            "modelfs": {"type": "layers", "diffIds": diff_ids},
        }
        top = {"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST, "artifactType": MP_ARTIFACT}
        config_type = MP_CONFIG
    config_raw = go_marshal(cfg)
    top["config"] = _descriptor(config_type, Digest.of_bytes(config_raw), len(config_raw))
    top["layers"] = layers
    blobs = {Digest.of_bytes(config_raw): config_raw, manifest.digest: manifest.raw}
    return Packed(go_marshal(top), blobs)


def recorded_source(config: dict[str, Any]) -> dict[str, str] | None:
    """The source artifact a landed model's config records (`land`), or None."""
    source = config.get(SOURCE_KEY)
    if not isinstance(source, dict) or not isinstance(source.get("digest"), str):
        return None
    return {k: v for k, v in source.items() if isinstance(v, str)}


def source_artifact(layout: Layout, manifest: Manifest, fmt: str) -> Manifest | None:
    """The artifact a landed model came from, to push in its own format: its manifest's bytes
    as they came (the same digest, so a pull then a push gives the registry what the other
    tool wrote), if the model's config records that format and the model names that manifest
    and every blob it names. None: the model is packed anew (`pack`)."""
    config = _config_of(layout, manifest)
    source = recorded_source(config) if config is not None else None
    if source is None or source.get("format") != fmt:
        return None
    try:
        digest = Digest.parse(source["digest"])
        layers = {x.digest: x.size for x in manifest.layers}
        raw = layout.blob(digest).read_bytes() if digest in layers else b""
        if not raw or Digest.of_bytes(raw) != digest:
            return None
        parsed = parse_manifest(raw, f"the source of {manifest.digest.short}")
    except (ValueError, OSError, ManifestError):
        return None
    if not isinstance(parsed, Manifest):
        return None
    named = parsed.blob_sizes().items()
    return parsed if all(layers.get(d) == size for d, size in named) else None


def _config_of(layout: Layout, manifest: Manifest) -> dict[str, Any] | None:
    if manifest.config is None:
        return None
    try:
        raw = layout.blob(manifest.config.digest).read_bytes()
        return parse_config(raw, f"config of {manifest.digest.short}").extra
    except (OSError, ManifestError):
        return None


__all__ = [
    "DOCKER_MODEL",
    "MODELPACK",
    "OLLAMA",
    "Packed",
    "UnknownArtifactError",
    "UnsupportedArtifactError",
    "artifact_kind",
    "check_artifact",
    "land",
    "pack",
    "recorded_source",
    "source_artifact",
]
