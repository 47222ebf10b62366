"""Manifests, manifest lists and model configs.

Manifest bytes are opaque: we parse them to learn what they reference, but keep `raw` and
never re-serialize, because the model ID is the sha256 of exactly those bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from modelfs.store.digest import Digest, digest_hexes
from modelfs.store.errors import InvalidDigestError, ManifestError

MEDIA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_LIST = "application/vnd.ollama.manifest.list.v2+json"
MEDIA_CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER_PREFIX = "application/vnd.ollama.image."

# Real manifests are a few KiB (a safetensors model with a thousand tensor layers is ~300 KiB);
# anything far larger is hostile or not a manifest, and we will not hold it in memory.
MAX_MANIFEST_BYTES = 16 << 20
MAX_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Layer:
    media_type: str
    digest: Digest
    size: int
    name: str | None = None
    from_: str | None = None

    @property
    def kind(self) -> str:
        """`model`, `license`, `tensor`, … for Ollama's types; the whole media type otherwise."""
        if self.media_type.startswith(LAYER_PREFIX):
            return self.media_type[len(LAYER_PREFIX) :]
        return self.media_type


@dataclass(frozen=True, slots=True)
class Manifest:
    """One runnable manifest: a config and its layers."""

    raw: bytes
    digest: Digest
    media_type: str
    config: Layer | None
    layers: tuple[Layer, ...]
    runner: str | None = None
    format: str | None = None

    @property
    def size(self) -> int:
        """Layers plus config, as Ollama's Manifest.Size (no de-duplication)."""
        return sum(layer.size for layer in self.layers) + (self.config.size if self.config else 0)

    def blob_digests(self) -> list[Digest]:
        """Config first, then layers, each once."""
        return list(self.blob_sizes())

    def blob_sizes(self) -> dict[Digest, int]:
        """Digest -> size of every blob it names: config first, then layers, each once."""
        sizes: dict[Digest, int] = {}
        if self.config is not None:
            sizes[self.config.digest] = self.config.size
        for layer in self.layers:
            sizes.setdefault(layer.digest, layer.size)
        return sizes


@dataclass(frozen=True, slots=True)
class ManifestRefs:
    """The blobs a plain manifest names, by file name under `blobs/` (`sha256-<hex>`):
    config first, then layers, repeats kept (`parse_manifest_refs`)."""

    digest: Digest
    blob_names: list[str]


@dataclass(frozen=True, slots=True)
class ListChild:
    """An entry of a manifest list: a reference to a manifest blob, or an inline manifest."""

    digest: Digest
    runner: str | None
    format: str | None
    inline: Manifest | None = None


@dataclass(frozen=True, slots=True)
class ManifestList:
    raw: bytes
    digest: Digest
    children: tuple[ListChild, ...]
    media_type: str = MEDIA_LIST


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of Ollama's ConfigV2 that we show; unknown fields are kept in `extra`."""

    model_format: str = ""
    model_family: str = ""
    model_families: tuple[str, ...] = ()
    model_type: str = ""
    file_type: str = ""
    architecture: str = ""
    capabilities: tuple[str, ...] = ()
    context_length: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def _load_json(raw: bytes, source: str, limit: int) -> Any:
    if not raw:
        raise ManifestError(f"{source}: empty file")
    if len(raw) > limit:
        raise ManifestError(f"{source}: {len(raw)} bytes, more than a manifest can be")
    try:
        # Decode ourselves: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ManifestError(f"{source}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc.msg} at byte {exc.pos})") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ManifestError(f"{source}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ManifestError(f"{source}: JSON nested too deeply") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Lone surrogates (from `\\ud800` escapes) as U+FFFD, as Go's JSON decoder leaves them;
    they cannot be encoded, so they must not reach a file name or a file."""
    if text.isascii():  # nearly every string of every manifest: skip the regex
        return text
    return _SURROGATE.sub("\ufffd", text)


def _str(obj: dict[str, Any], key: str, source: str, *, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ManifestError(f"{source}: missing {key!r}")
        return None
    if not isinstance(value, str):
        raise ManifestError(f"{source}: {key!r} is not a string")
    return clean_text(value)


def _plain_digest_texts(objs: list[Any]) -> list[str] | None:
    """The digest string of each layer object, not yet checked as a digest, when every one
    has the shape nearly every layer has (an object of ASCII strings and an int size); None
    otherwise, and then `_checked_layer` judges each. A scan or a GC runs this over every
    layer of every manifest (GC: 100,000 of them): one loop per manifest, plain type checks,
    no regex and no object."""
    texts: list[str] = []
    append = texts.append
    for obj in objs:
        if type(obj) is not dict:
            return None
        media_type, text, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
        if not (
            type(media_type) is str
            and type(text) is str
            and type(size) is int
            and size >= 0
            and media_type.isascii()
        ):
            return None
        name, from_ = obj.get("name"), obj.get("from")
        if not (name is None or (type(name) is str and name.isascii())) or not (
            from_ is None or (type(from_) is str and from_.isascii())
        ):
            return None
        append(text)
    return texts


def _layers(objs: list[Any], source: str) -> tuple[Layer, ...]:
    texts = _plain_digest_texts(objs)
    if texts is not None:
        try:
            digests = [Digest.parse(text) for text in texts]
        except InvalidDigestError:
            pass  # the full check raises the ManifestError
        else:
            # Name and origin left to their defaults where a layer has neither: the frozen
            # dataclass's __init__ then sets two fewer attributes the slow way.
            return tuple(
                [
                    Layer(obj["mediaType"], digest, obj["size"])
                    if len(obj) == 3
                    else Layer(
                        obj["mediaType"], digest, obj["size"], obj.get("name"), obj.get("from")
                    )
                    for obj, digest in zip(objs, digests, strict=True)
                ]
            )
    return tuple([_checked_layer(obj, source) for obj in objs])


def _layer_blob_names(objs: list[Any], source: str) -> list[str]:
    """The blob file name of each layer, where `_layers` takes them all (by the same
    checks); ManifestError where it refuses one."""
    texts = _plain_digest_texts(objs)
    hexes = digest_hexes(texts) if texts is not None else None
    if hexes is None:
        hexes = [_checked_layer(obj, source).digest.hex for obj in objs]
    return ["sha256-" + hex_ for hex_ in hexes]


def _checked_layer(obj: Any, source: str) -> Layer:
    if not isinstance(obj, dict):
        raise ManifestError(f"{source}: a layer is not an object")
    media_type = _str(obj, "mediaType", source, required=True)
    digest_text = _str(obj, "digest", source, required=True)
    size = obj.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ManifestError(f"{source}: layer {digest_text} has a bad size {size!r}")
    try:
        digest = Digest.parse(digest_text or "")
    except InvalidDigestError:
        raise ManifestError(f"{source}: bad layer digest {digest_text!r}") from None
    assert media_type is not None
    return Layer(media_type, digest, size, _str(obj, "name", source), _str(obj, "from", source))


def _manifest_fields(
    obj: dict[str, Any], source: str
) -> tuple[str, Any, list[Any], str | None, str | None]:
    """A manifest's media type, config object, layer objects, runner and format, checked
    for type; the config and layers are then checked one by one."""
    media_type = _str(obj, "mediaType", source) or MEDIA_MANIFEST
    layers_obj = obj.get("layers")
    if not isinstance(layers_obj, list) and isinstance(obj.get("manifests"), list):
        # An OCI image index or a Docker manifest list (a multi-platform image, an artifact
        # per platform): said as what it is, not as a manifest missing its layers.
        raise ManifestError(
            f"{source}: an image index ({media_type}), not a model's manifest; only Ollama's "
            "manifest lists and single manifests are pulled"
        )
    if not isinstance(layers_obj, list):
        raise ManifestError(f"{source}: 'layers' is missing or not a list")
    runner = _str(obj, "runner", source) or None
    fmt = _str(obj, "format", source) or None
    return media_type, obj.get("config"), layers_obj, runner, fmt


def _manifest(obj: dict[str, Any], raw: bytes, digest: Digest, source: str) -> Manifest:
    media_type, config_obj, layers_obj, runner, fmt = _manifest_fields(obj, source)
    if not config_obj:
        return Manifest(raw, digest, media_type, None, _layers(layers_obj, source), runner, fmt)
    config, *layers = _layers([config_obj, *layers_obj], source)
    return Manifest(raw, digest, media_type, config, tuple(layers), runner, fmt)


def _manifest_refs(obj: dict[str, Any], digest: Digest, source: str) -> ManifestRefs:
    _, config_obj, layers_obj, _, _ = _manifest_fields(obj, source)
    return ManifestRefs(
        digest, _layer_blob_names([config_obj, *layers_obj] if config_obj else layers_obj, source)
    )


def go_marshal(obj: Any) -> bytes:
    """Bytes as Go's json.Marshal writes them: compact, with <, > and & escaped."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    try:
        return text.encode()
    except UnicodeEncodeError:
        # A lone surrogate, decoded from `"\ud800"`: Go's decoder reads each one as U+FFFD
        # (encoding/json decode.go, unquoteBytes), so that is what its encoder writes.
        return _LONE_SURROGATE.sub("\ufffd", text).encode()


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _inline_child_bytes(obj: dict[str, Any]) -> bytes:
    # Ollama names an inline child by the hash of its re-marshalled struct, whose field order
    # is fixed by the Go type, not by the order in the list's bytes.
    layer_keys = ("mediaType", "digest", "size", "from", "name")

    def layer(layer_obj: dict[str, Any]) -> dict[str, Any]:
        out = {k: layer_obj.get(k, "" if k != "size" else 0) for k in layer_keys[:3]}
        out.update({k: layer_obj[k] for k in layer_keys[3:] if layer_obj.get(k)})
        return out

    ordered: dict[str, Any] = {
        "schemaVersion": obj.get("schemaVersion", 0),
        "mediaType": obj.get("mediaType", ""),
        "config": layer(obj.get("config") or {}),
        "layers": [layer(x) for x in obj.get("layers") or []],
    }
    for key in ("runner", "format"):
        if obj.get(key):
            ordered[key] = obj[key]
    return go_marshal(ordered)


def _list(obj: dict[str, Any], raw: bytes, digest: Digest, source: str) -> ManifestList:
    children_obj = obj.get("manifests")
    if not isinstance(children_obj, list):
        raise ManifestError(f"{source}: manifest list has no 'manifests' array")
    children: list[ListChild] = []
    for child in children_obj:
        if not isinstance(child, dict):
            raise ManifestError(f"{source}: a manifest list entry is not an object")
        child_type = _str(child, "mediaType", source)
        if child_type == MEDIA_LIST:
            raise ManifestError(f"{source}: nested manifest lists are not supported")
        runner = _str(child, "runner", source) or None
        fmt = _str(child, "format", source) or None
        if child.get("layers") is None and child.get("config") is None:
            text = _str(child, "digest", source, required=True) or ""
            try:
                children.append(ListChild(Digest.parse(text), runner, fmt))
            except InvalidDigestError:
                raise ManifestError(f"{source}: bad child digest {text!r}") from None
        else:
            layers = child.get("layers")
            config = child.get("config")
            if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
                raise ManifestError(f"{source}: inline child has malformed 'layers'")
            if config is not None and not isinstance(config, dict):
                raise ManifestError(f"{source}: inline child has a malformed 'config'")
            child_raw = _inline_child_bytes(child)
            child_digest = Digest.of_bytes(child_raw)
            inline = _manifest(child, child_raw, child_digest, f"{source} (inline child)")
            children.append(ListChild(child_digest, runner, fmt, inline))
    return ManifestList(raw, digest, tuple(children))


def _top_object(raw: bytes, source: str) -> tuple[dict[str, Any], Digest]:
    obj = _load_json(raw, source, MAX_MANIFEST_BYTES)
    if not isinstance(obj, dict):
        raise ManifestError(f"{source}: not a JSON object")
    return obj, Digest.of_bytes(raw)


def parse_manifest(raw: bytes, source: str) -> Manifest | ManifestList:
    """Parse manifest or manifest-list bytes; `source` names the file in every error."""
    obj, digest = _top_object(raw, source)
    if obj.get("mediaType") == MEDIA_LIST:
        return _list(obj, raw, digest, source)
    return _manifest(obj, raw, digest, source)


# A plain manifest as Go's encoder writes Ollama's Manifest and Layer structs (fields in
# struct order, compact, empty `from`, `name`, `runner` and `format` left out, one newline
# after), every string printable ASCII with no escape. JSON read from such bytes holds what
# this pattern sees and passes every check `_manifest_refs` makes, so GC's reach can take the
# digests from the bytes: no decoding, no object per layer. Any other spelling (spaces, keys
# in another order, an escape, a list) misses the pattern and is parsed and checked in full.
_TEXT = rb'"[ !#-\[\]-~]*+"'
_LAYER = (
    rb'\{"mediaType":' + _TEXT + rb',"digest":"sha256:[0-9a-f]{64}","size":(?:0|[1-9][0-9]{0,17}+)'
    rb'(?:,"from":' + _TEXT + rb')?+(?:,"name":' + _TEXT + rb")?+\}"
)
_GO_MANIFEST = re.compile(
    rb'\{(?:"schemaVersion":(?:0|[1-9][0-9]{0,8}+),)?+"mediaType":('
    + _TEXT
    + rb'),"config":'
    + _LAYER
    + rb',"layers":\[(?:'
    + _LAYER
    + rb"(?:,"
    + _LAYER
    + rb")*+)?+\]"
    rb'(?:,"runner":' + _TEXT + rb')?+(?:,"format":' + _TEXT + rb")?+\}\n?"
)
# A text cannot hold a quote, so only the config's and the layers' digests follow this.
_DIGEST_KEY = '"digest":"sha256:'
_QUOTED_LIST = b'"' + MEDIA_LIST.encode() + b'"'


def _go_manifest_refs(raw: bytes) -> ManifestRefs | None:
    if len(raw) > MAX_MANIFEST_BYTES:
        return None
    m = _GO_MANIFEST.fullmatch(raw)
    if m is None or m.group(1) == _QUOTED_LIST:
        return None
    # Every `"digest":"sha256:` starts a digest of 64 hex digits (the pattern proved it).
    names = ["sha256-" + part[:64] for part in raw.decode("ascii").split(_DIGEST_KEY)[1:]]
    return ManifestRefs(Digest.of_bytes(raw), names)


def parse_manifest_refs(raw: bytes, source: str) -> ManifestRefs | ManifestList:
    """What `parse_manifest` gives, checked by the same rules and refused in the same cases,
    but a plain manifest comes back as the digests it names (`ManifestRefs`), with no layer
    objects: for GC's reach, which reads every manifest and needs only that. A list is
    parsed whole (its children are what matters)."""
    return _go_manifest_refs(raw) or _json_manifest_refs(raw, source)


def _json_manifest_refs(raw: bytes, source: str) -> ManifestRefs | ManifestList:
    obj, digest = _top_object(raw, source)
    if obj.get("mediaType") == MEDIA_LIST:
        return _list(obj, raw, digest, source)
    return _manifest_refs(obj, digest, source)


def parse_config(raw: bytes, source: str) -> ModelConfig:
    obj = _load_json(raw, source, MAX_CONFIG_BYTES)
    if not isinstance(obj, dict):
        raise ManifestError(f"{source}: config is not a JSON object")

    def text(key: str) -> str:
        value = obj.get(key)
        return clean_text(value) if isinstance(value, str) else ""

    def texts(key: str) -> tuple[str, ...]:
        value = obj.get(key)
        if not isinstance(value, list):
            return ()
        return tuple(clean_text(x) for x in value if isinstance(x, str))

    ctx = obj.get("context_length")
    return ModelConfig(
        model_format=text("model_format"),
        model_family=text("model_family"),
        model_families=texts("model_families"),
        model_type=text("model_type"),
        file_type=text("file_type"),
        architecture=text("architecture"),
        capabilities=texts("capabilities"),
        context_length=ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None,
        extra=obj,
    )


def infer_runner(manifest: Manifest, config: ModelConfig | None) -> str | None:
    """The runner a manifest targets: its own field, else from the weights' format."""
    if manifest.runner:
        return manifest.runner
    fmt = manifest.format or (config.model_format if config else "")
    if fmt == "safetensors" or any(layer.kind == "tensor" for layer in manifest.layers):
        return "mlx"
    if fmt == "gguf" or any(layer.kind == "model" for layer in manifest.layers):
        return "ggml"
    return None
