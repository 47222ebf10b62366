"""A manifest-list tag as every writer of one leaves it: pull, the mirror, the daemon (which
pulls) and `modelfs demo-store` all call `write_list_tag`, so they leave the same store.

    write_list_tag(store, name, list_raw, lst, present, prefer) -> [paths written]

What a stock Ollama (ollama/ollama fb30760) does with the store decides the shape: it reads
only `manifests/*/*/*/*` (manifest/manifest.go:175-227) and its startup prune, `ollama rm`
and a re-pull delete every blob no file there names (server/images.go:843-929,998-1015;
manifest/manifest.go:74-110). So every blob of a child that is here, and the list and child
manifest blobs, must be named by some legacy file, or that Ollama deletes them while modelfs
still shows the variant. A child that is not here (a pull of the preferred child only) needs
no legacy file: it has no blobs to keep.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import read_file
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    go_marshal,
    parse_manifest,
)
from modelfs.store.names import Name
from modelfs.store.scan import child_runner, rank_children, read_limited

log = logging.getLogger(__name__)


def anchor_bytes(
    child_raw: bytes, list_raw: bytes, refs: Sequence[tuple[str, Digest, int]]
) -> bytes:
    """The legacy anchor written for a manifest list: the chosen child manifest's own JSON,
    with one more layer per manifest blob the tag depends on (the list, then each child
    manifest blob that is present, in list order), as Go's json.Marshal writes it, without a
    trailing newline."""
    obj = json.loads(child_raw.decode("utf-8"))
    layers = list(obj.get("layers") or [])
    layers.append(
        {"mediaType": MEDIA_LIST, "digest": str(Digest.of_bytes(list_raw)), "size": len(list_raw)}
    )
    for media_type, digest, size in refs:
        layers.append({"mediaType": media_type, "digest": str(digest), "size": size})
    obj["layers"] = layers
    return go_marshal(obj)


def _is_gguf(runner: str | None, fmt: str | None, manifest: Manifest) -> bool:
    if (fmt or manifest.format or "").lower() == "gguf":
        return True
    if (runner or "").lower() in ("llamacpp", "ggml"):
        return True
    return any(layer.kind == "model" for layer in manifest.layers)


def _child_media_type(list_raw: bytes, index: int) -> str:
    """The `mediaType` a list gives its child at `index` (the anchor's reference says the same)."""
    try:
        value = json.loads(list_raw.decode("utf-8"))["manifests"][index].get("mediaType")
    except (ValueError, LookupError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else MEDIA_MANIFEST


def present_children(layout: Layout, lst: ManifestList) -> list[tuple[int, Manifest]]:
    """The children of `lst` that are whole in the store: the manifest (inline, or a blob
    whose bytes hash to the child's digest) and every blob it names, of the size it says."""
    store = BlobStore(layout)
    whole: list[tuple[int, Manifest]] = []
    for i, child in enumerate(lst.children):
        manifest = child.inline
        if manifest is None:
            try:
                raw = read_file(layout.blob(child.digest), MAX_MANIFEST_BYTES)
                parsed = parse_manifest(raw, f"blobs/{child.digest.blob_name}")
            except (OSError, StoreError):
                continue  # not fetched, or not a manifest: not a child that is here
            if Digest.of_bytes(raw) != child.digest or not isinstance(parsed, Manifest):
                continue
            manifest = parsed
        if all(store.has(d, size) for d, size in manifest.blob_sizes().items()):
            whole.append((i, manifest))
    return whole


def write_list_tag(
    store: BlobStore,
    name: Name,
    list_raw: bytes,
    lst: ManifestList,
    present: Sequence[tuple[int, Manifest]],
    prefer: Sequence[str],
) -> list[Path]:
    """Write the tag `name` for the list `list_raw` (parsed: `lst`), whose children at the
    given indexes are here (their manifests parsed, every blob they name in `blobs/`), with
    every other child that is whole here too (`present_children`), the way Ollama's
    manifest-list migration leaves a store:

    1. each present child the list references by digest, as a blob `blobs/sha256-<child>`
       (exact bytes; an inline child has no blob of its own);
    2. the list itself as a blob, and `manifests-v2/<host>/<ns>/<model>/<tag>` pointing at it
       (`BlobStore.write_v2_manifest`). Ollama with manifest lists reads this, and it hides
       the legacy file of the same name;
    3. the legacy anchor `manifests/<host>/<ns>/<model>/<tag>`: the preferred present gguf
       child (else the first present child by `prefer`) with one extra layer per manifest
       blob above (the list, then the present child manifests in list order). An Ollama from
       before manifest lists reads only `manifests/`: the anchor lets it list and run that
       variant, and its prune keeps the list and child manifest blobs;
    4. for every other present child, `manifests/…/<tag>-<runner>`: its own bytes, as `ollama
       pull` of that child would write them, so that its layers are named too.

    Lists after their children, the anchor last: each file only names what is already there.
    Returns the paths written, in that order (the v2 entry first).
    """
    # Children already here from an earlier write (another `--prefer`) count too: the anchor
    # and the variant files are rewritten from all of them, or what names them would be lost.
    given = dict(present)
    for i, manifest in present_children(store.layout, lst):
        given.setdefault(i, manifest)
    if not given:
        raise StoreError(f"{name.shortest}: no child of its manifest list is here")
    present = sorted(given.items())
    ours = {c.digest for c in lst.children} | _list_children(store, name)
    refs: list[tuple[str, Digest, int]] = []
    for i, manifest in present:
        if lst.children[i].inline is None:
            store.put_bytes(manifest.raw)
            refs.append((_child_media_type(list_raw, i), manifest.digest, len(manifest.raw)))
    store.put_bytes(list_raw)
    written = [store.write_v2_manifest(name, list_raw)]

    ranked = rank_children(lst, prefer, {m.digest: m for _, m in present})

    def rank(item: tuple[int, Manifest]) -> tuple[bool, int]:
        i, m = item
        c = lst.children[i]
        return (not _is_gguf(c.runner, c.format, m), ranked.index(i))

    chosen_i, chosen = min(present, key=rank)
    written.append(store.write_legacy_manifest(name, anchor_bytes(chosen.raw, list_raw, refs)))
    others = [(i, m.raw) for i, m in present if i != chosen_i]
    written += _variant_anchors(store, name, lst, others, ours)
    return written


def _list_children(store: BlobStore, name: Name) -> set[Digest]:
    """The children of the list the store's `manifests-v2/` entry for `name` holds now."""
    try:
        old = parse_manifest(
            read_limited(store.layout.v2_manifest(name), MAX_MANIFEST_BYTES), name.shortest
        )
    except (OSError, StoreError):
        return set()
    return {c.digest for c in old.children} if isinstance(old, ManifestList) else set()


def _variant_anchors(
    store: BlobStore,
    name: Name,
    lst: ManifestList,
    others: list[tuple[int, bytes]],
    ours: set[Digest],
) -> list[Path]:
    """A legacy manifest `<tag>-<runner>` for each present child the anchor is not: the
    child's own bytes.

    The anchor names the layers of one child only; this names the other children's, so they
    live as long as this tag. It names no list or child manifest blob, so an `ollama rm` of
    the main tag still removes the list. An existing file of that name is replaced only when
    it is a child of this list or of the list it replaces (another model of that name is left
    alone, and the variant's blobs unnamed; a warning says so).
    """
    written: list[Path] = []
    taken: set[str] = set()
    for i, raw in others:
        child = lst.children[i]
        base = f"{name.tag}-{(child_runner(child) or 'variant').lower()}"
        tag, n = base, 1
        while tag.lower() in taken:
            n += 1
            tag = f"{base}-{n}"
        taken.add(tag.lower())
        try:
            variant = name.with_tag(tag)
        except StoreError:
            log.warning(
                "%s: no legacy name for its child %s (%s is too long)",
                name.shortest,
                child.digest,
                tag,
            )
            continue
        path = store.layout.legacy_manifest(variant)
        try:
            there = Digest.of_bytes(read_limited(path, MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            there = None
        if there is not None and there not in ours:
            log.warning(
                "%s exists and is another model; %s's child %s is named by no legacy "
                "manifest, so a stock Ollama's prune would delete its blobs",
                variant.shortest,
                name.shortest,
                child.digest,
            )
            continue
        written.append(store.write_legacy_manifest(variant, raw))
    return written
