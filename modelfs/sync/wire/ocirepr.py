"""How an Ollama manifest list is kept in an OCI registry that does not know its media type.

A CNCF distribution registry (Debian's `docker-registry` 2.8) refuses
`application/vnd.ollama.manifest.list.v2+json` (400 MANIFEST_INVALID: it takes an unknown
type for a signed schema-1 manifest, "missing signature key"), and refuses the same bytes
under the Docker list or OCI index type because their `mediaType` field then disagrees. It
does store ordinary manifests whose config and layers have any media type, as long as every
descriptor names a blob already uploaded to that repository. So a list is pushed as:

- each child manifest, PUT by digest (`/v2/<repo>/manifests/sha256:…`) *and* uploaded as a
  blob, with the blobs it references;
- the list's own bytes, uploaded as a blob: its digest is the list's digest, the model ID;
- at the tag, a **carrier**: an OCI image manifest whose `config` is the list blob, with
  `config.mediaType` = the Ollama list type, and whose `layers` are the child manifests (as
  `application/vnd.docker.distribution.manifest.v2+json`, in list order) followed by every
  blob those children reference (config and layers, first appearance, each once):

      {"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
       "config":{"mediaType":"application/vnd.ollama.manifest.list.v2+json",
                 "digest":"sha256:<the list>","size":…},
       "layers":[{"mediaType":"…docker…manifest.v2+json","digest":"sha256:<child>",…},…,
                 {"mediaType":"application/vnd.ollama.image.model","digest":…},…]}

Why this shape:
- Decoding is unambiguous: no Ollama manifest has the list type as its config type, so "an
  OCI manifest whose config is a list" is a carrier and anything else is a model's manifest,
  pushed as it is (Ollama's manifests are valid Docker v2 manifests).
- The list bytes come back exactly: they are a content-addressed blob, fetched and verified
  like any other, and the carrier's config digest *is* the list's digest.
- The registry's garbage collector keeps everything from the tag alone, even
  `registry garbage-collect --delete-untagged` (which would drop the children, pushed only by
  digest): their manifests and all their blobs are the carrier's layers.
- An Ollama client asks only for Docker v2 (or the list type, then v2), so distribution
  answers it 404 MANIFEST_UNKNOWN "OCI manifest found, but accept header does not support OCI
  manifests" rather than a model it would save and fail to run. A Docker v2 carrier would be
  handed to it. An OCI index can reference the children, but the list bytes would have to
  ride in an annotation, and clients that do not ask for indexes get 404.
- A registry that is not told about the list media type needs nothing new; `skopeo inspect
  --raw` shows the carrier, and `skopeo copy` moves it like any artifact.

Children absent from the pushing store (Ollama pulls only one variant) are left out of the
carrier unless the registry already holds them; the list still names them, as it does in a
store where a child was never pulled.

    carrier = encode_list(list_raw, [child_raw, …])     # the children available
    c = parse_carrier(raw, content_type)                # None: a plain manifest
    the_list = decode_list(c, await fetch(c.list_ref))  # ManifestList, bytes verified
    the_list = await decode_carrier(raw, fetch_blob)    # both steps, or None
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.errors import InvalidDigestError, ManifestError
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    MEDIA_OCI_MANIFEST,
    Layer,
    ListChild,
    Manifest,
    ManifestList,
    parse_manifest,
)

MEDIA_CARRIER = MEDIA_OCI_MANIFEST
"""The media type a carrier is PUT with (and which a client must accept to get it)."""


@dataclass(frozen=True, slots=True)
class Carrier:
    """A parsed carrier manifest: where the list is, and what the registry keeps for it."""

    raw: bytes
    digest: Digest
    list_ref: Layer
    """The list blob: `digest` is the list's digest (the model ID), `size` its length."""
    layers: tuple[Layer, ...]
    """Child manifests first, then their blobs; GC anchors, not needed to decode."""

    def children_present(self, the_list: ManifestList) -> tuple[ListChild, ...]:
        """The list's children the carrier holds, i.e. the registry had when it was pushed.

        Inline children are always present (they are inside the list's bytes).
        """
        held = {layer.digest for layer in self.layers}
        return tuple(c for c in the_list.children if c.inline is not None or c.digest in held)


def _descriptor(media_type: str, digest: Digest, size: int) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": str(digest), "size": size}


def encode_list(list_raw: bytes, children: Iterable[bytes]) -> bytes:
    """The carrier manifest for a list, given the raw bytes of the referenced children that
    the registry will hold. Deterministic: the same inputs give the same bytes (and digest),
    so a second push finds the tag up to date.

    Raises ManifestError if `list_raw` is not a list, or a child is not one of its children
    or is itself a list.
    """
    the_list = parse_manifest(list_raw, "manifest list")
    if not isinstance(the_list, ManifestList):
        raise ManifestError("manifest list: not an Ollama manifest list")
    given: dict[Digest, Manifest] = {}
    for raw in children:
        child = parse_manifest(raw, "child manifest")
        if not isinstance(child, Manifest):
            raise ManifestError(f"child {child.digest} is itself a manifest list")
        given[child.digest] = child
    by_digest = {c.digest: c for c in the_list.children}
    for digest in given:
        if digest not in by_digest:
            raise ManifestError(f"manifest {digest} is not a child of list {the_list.digest}")

    layers: list[dict[str, Any]] = []
    seen: set[Digest] = {the_list.digest}
    manifests: list[Manifest] = []
    for entry in the_list.children:
        if entry.inline is not None:
            manifests.append(entry.inline)
            continue
        found = given.get(entry.digest)
        if found is None or found.digest in seen:
            continue
        seen.add(found.digest)
        manifests.append(found)
        layers.append(_descriptor(found.media_type or MEDIA_MANIFEST, found.digest, len(found.raw)))
    for child in manifests:
        refs = ([child.config] if child.config is not None else []) + list(child.layers)
        for ref in refs:
            if ref.digest not in seen:
                seen.add(ref.digest)
                layers.append(_descriptor(ref.media_type, ref.digest, ref.size))

    carrier = {
        "schemaVersion": 2,
        "mediaType": MEDIA_CARRIER,
        "config": _descriptor(MEDIA_LIST, the_list.digest, len(list_raw)),
        "layers": layers,
    }
    return json.dumps(carrier, separators=(",", ":")).encode()


def _layer(obj: Any, what: str) -> Layer:
    if not isinstance(obj, dict):
        raise ManifestError(f"carrier: {what} is not an object")
    media_type, digest, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
    if not isinstance(media_type, str) or not isinstance(digest, str):
        raise ManifestError(f"carrier: {what} has no mediaType or digest")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ManifestError(f"carrier: {what} has a bad size {size!r}")
    try:
        return Layer(media_type, Digest.parse(digest), size)
    except InvalidDigestError:
        raise ManifestError(f"carrier: {what} has a bad digest {digest[:80]!r}") from None


def parse_carrier(raw: bytes, content_type: str | None = None) -> Carrier | None:
    """The carrier in manifest bytes a registry returned, or None for any other manifest.

    `content_type` is the response's Content-Type (parameters allowed), used when the JSON has
    no `mediaType`. Bytes that do not parse as a JSON object are not a carrier (None): the
    caller's own parser reports them. A manifest whose config has the list type but is
    otherwise malformed raises ManifestError: it claims to be a carrier and is not a good one.
    """
    if not raw or len(raw) > MAX_MANIFEST_BYTES:
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    config = obj.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != MEDIA_LIST:
        return None
    media_type = obj.get("mediaType")
    if media_type is None and content_type:
        media_type = content_type.split(";", 1)[0].strip()
    if media_type not in (MEDIA_CARRIER, MEDIA_MANIFEST):
        raise ManifestError(f"carrier: media type {media_type!r} is not an image manifest")
    layers_obj = obj.get("layers")
    if not isinstance(layers_obj, list):
        raise ManifestError("carrier: 'layers' is missing or not a list")
    return Carrier(
        raw=raw,
        digest=Digest.of_bytes(raw),
        list_ref=_layer(config, "config"),
        layers=tuple(_layer(x, f"layer {i}") for i, x in enumerate(layers_obj)),
    )


def decode_list(carrier: Carrier, list_raw: bytes) -> ManifestList:
    """The list a carrier stands for, from the bytes of its config blob.

    Checks what a blob fetch may not have: the bytes hash to the config digest and have its
    size, and they are an Ollama manifest list. Raises ManifestError otherwise. The carrier's
    layers are not consulted: they only keep things alive in the registry.
    """
    ref = carrier.list_ref
    if len(list_raw) != ref.size or Digest.of_bytes(list_raw) != ref.digest:
        raise ManifestError(
            f"carrier {carrier.digest}: list blob does not match {ref.digest} ({ref.size} bytes)"
        )
    the_list = parse_manifest(list_raw, f"blob {ref.digest}")
    if not isinstance(the_list, ManifestList):
        raise ManifestError(f"carrier {carrier.digest}: blob {ref.digest} is not a manifest list")
    return the_list


async def decode_carrier(
    raw: bytes,
    fetch_blob: Callable[[Layer], Awaitable[bytes]],
    content_type: str | None = None,
) -> ManifestList | None:
    """`parse_carrier`, then fetch the list blob with `fetch_blob` and `decode_list` it.

    None when `raw` is not a carrier. `fetch_blob(ref)` returns the bytes of blob
    `ref.digest` (`ref.size` bytes, a few KiB) from the same repository.
    """
    carrier = parse_carrier(raw, content_type)
    if carrier is None:
        return None
    return decode_list(carrier, await fetch_blob(carrier.list_ref))


def child_manifests(carrier: Carrier, the_list: ManifestList) -> Sequence[Layer]:
    """The carrier's descriptors of the list's referenced children it holds, in list order."""
    held = {layer.digest: layer for layer in carrier.layers}
    return [held[c.digest] for c in the_list.children if c.inline is None and c.digest in held]
