"""Manifests, last: what a pull writes once every blob a manifest names is present.

    ManifestWriter(layout, prefer).write_manifest(name, raw, had_v2) -> [paths]
    ManifestWriter(layout, prefer).write_list(name, list_raw, lst, children) -> [paths]
    existing_name(layout, name) -> (the store's spelling of name | None, it is a v2 entry)

Each file is written atomically (temp file in `.modelfs/tmp/`, fsync, rename), byte for byte:

- a plain manifest: `manifests/<host>/<ns>/<model>/<tag>`, the legacy file every Ollama
  version reads (and, if the store already has a `manifests-v2/` entry for that name, it is
  moved to the new manifest too, because v2 hides legacy);
- a manifest list (see `write_list`): the child manifest blobs, then the list blob and the
  `manifests-v2/…/<tag>` symlink to it, then the legacy anchor, then a legacy
  `<tag>-<runner>` file for each other pulled child.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
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
from modelfs.store.names import Name, name_from_path_parts
from modelfs.store.scan import child_runner, rank_children, read_limited
from modelfs.sync.client.peer import FetchedManifest
from modelfs.sync.errors import local_error

log = logging.getLogger(__name__)


def _is_gguf(runner: str | None, fmt: str | None, manifest: Manifest) -> bool:
    if (fmt or manifest.format or "").lower() == "gguf":
        return True
    if (runner or "").lower() in ("llamacpp", "ggml"):
        return True
    return any(layer.kind == "model" for layer in manifest.layers)


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


def _child_media_type(list_raw: bytes, index: int) -> str:
    """The `mediaType` a list gives its child at `index` (the anchor's reference says the same)."""
    try:
        value = json.loads(list_raw.decode("utf-8"))["manifests"][index].get("mediaType")
    except (ValueError, LookupError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else MEDIA_MANIFEST


def existing_name(layout: Layout, name: Name) -> tuple[Name | None, bool]:
    """The spelling a store already has for `name` (each part matched case-insensitively, as
    Ollama's getExistingName), and whether that is a `manifests-v2/` entry (which hides the
    legacy file). Looks only along the name's own path, not at the whole store."""
    trees = (
        (layout.manifests_v2, name.v2_parts(), True),
        (layout.manifests, name.legacy_parts(), False),
    )
    for root, parts, v2 in trees:
        path, found = root, []
        for part in parts:
            try:
                entries = sorted(os.listdir(path))
            except OSError:
                break
            hit = (
                part
                if part in entries
                else next((e for e in entries if e.lower() == part.lower()), None)
            )
            if hit is None:
                break
            path = path / hit
            found.append(hit)
        else:
            if path.is_file():
                try:
                    return name_from_path_parts(found, v2=v2), v2
                except StoreError:
                    pass
    return None, False


class ManifestWriter:
    """Writes the manifests of pulled models into one store, each only once all it names is
    there; `prefer` picks the legacy anchor of a list as it picks the children to pull."""

    def __init__(self, layout: Layout, prefer: Sequence[str]) -> None:
        self.layout = layout
        self.store = BlobStore(layout)
        self.prefer = tuple(prefer)

    def _manifest_blob(self, raw: bytes) -> Digest:
        """`raw` as a blob; a blob of that name with other bytes is replaced (renamed over)."""
        try:
            return self.store.put_bytes(raw)
        except OSError as exc:
            raise local_error(exc, self.layout, f"manifest blob {Digest.of_bytes(raw)}") from None

    def write_manifest(self, name: Name, raw: bytes, had_v2: bool) -> list[Path]:
        """A plain manifest: the legacy file, which every Ollama version reads. If the store
        has a `manifests-v2/` entry for the name, it would hide the legacy file, so it is
        pointed at this manifest too (stored as a blob, as Ollama's v2 writer does)."""
        try:
            written = [self.store.write_legacy_manifest(name, raw)]
            if had_v2:
                self._manifest_blob(raw)
                written.append(self.store.write_v2_manifest(name, raw))
        except OSError as exc:
            raise local_error(exc, self.layout, f"the manifest of {name.shortest}") from None
        return written

    def write_list(
        self,
        name: Name,
        list_raw: bytes,
        lst: ManifestList,
        children: list[tuple[int, FetchedManifest | None, Manifest]],
    ) -> list[Path]:
        """A manifest list, written the way Ollama's manifest-list migration leaves a store:

        1. each pulled child manifest that the list references by digest, as a blob
           `blobs/sha256-<child>` (exact bytes; inline children have no blob of their own);
        2. the list itself as a blob, and `manifests-v2/<host>/<ns>/<model>/<tag>`, a
           relative symlink to it (a hardlink, then a copy, where symlinks fail), made in
           `.modelfs/tmp/` and renamed into place. Ollama with manifest lists reads this, and
           it hides the legacy file of the same name;
        3. the legacy anchor `manifests/<host>/<ns>/<model>/<tag>`: the preferred pulled gguf
           child (else the first pulled child) with one extra layer per manifest blob above
           (the list, then the pulled child manifests in list order). An Ollama from before
           manifest lists reads only `manifests/`: the anchor lets it list and run the gguf
           variant, and because its prune keeps every blob a legacy manifest names, it keeps
           the list and child manifest blobs too. This is the same anchor `modelfs
           demo-store` and Ollama's own migration leave;
        4. for every other pulled child, `manifests/…/<tag>-<runner>`: its own bytes
           (`_variant_anchors`), so that an Ollama reading only `manifests/` keeps its layers.

        Lists after their children; the anchor last, so each file only names what is already
        there.
        """
        try:
            ours = {c.digest for c in lst.children} | self._list_children(name)
            refs: list[tuple[str, Digest, int]] = []
            for i, fetched, manifest in sorted(children, key=lambda c: c[0]):
                if fetched is not None:
                    self._manifest_blob(fetched.raw)
                    media_type = _child_media_type(list_raw, i)
                    refs.append((media_type, manifest.digest, len(fetched.raw)))
            self._manifest_blob(list_raw)
            written = [self.store.write_v2_manifest(name, list_raw)]

            known = {m.digest: m for _, _, m in children}
            ranked = rank_children(lst, self.prefer, known)

            def rank(item: tuple[int, FetchedManifest | None, Manifest]) -> tuple[bool, int]:
                i, _, m = item
                c = lst.children[i]
                return (not _is_gguf(c.runner, c.format, m), ranked.index(i))

            chosen_i, _, chosen = min(children, key=rank)
            anchor = anchor_bytes(chosen.raw, list_raw, refs)
            written.append(self.store.write_legacy_manifest(name, anchor))
            extra = [
                (i, f.raw)
                for i, f, _ in sorted(children, key=lambda c: c[0])
                if i != chosen_i and f is not None
            ]
            written += self._variant_anchors(name, lst, extra, ours)
        except OSError as exc:
            raise local_error(exc, self.layout, f"the manifests of {name.shortest}") from None
        return written

    def _list_children(self, name: Name) -> set[Digest]:
        """The children of the list the store's `manifests-v2/` entry for `name` holds now."""
        try:
            old = parse_manifest(
                read_limited(self.layout.v2_manifest(name), MAX_MANIFEST_BYTES), name.shortest
            )
        except (OSError, StoreError):
            return set()
        return {c.digest for c in old.children} if isinstance(old, ManifestList) else set()

    def _variant_anchors(
        self, name: Name, lst: ManifestList, extra: list[tuple[int, bytes]], ours: set[Digest]
    ) -> list[Path]:
        """A legacy manifest `<tag>-<runner>` for each pulled child the anchor is not: the
        child's own bytes, as `ollama pull` of that child would write them.

        A stock Ollama reads only `manifests/` and deletes every blob no file there names:
        its startup prune (ollama/ollama fb30760 server/images.go:874-929), `ollama rm`
        (manifest/manifest.go:74-110) and a re-pull (server/images.go:998-1015,1115-1120).
        The anchor names the layers of one child only; this names the other children's, so
        they live as long as this tag. It names no list or child manifest blob, so an
        `ollama rm` of the main tag still removes the list. An existing file of that name is
        replaced only when it is a child of this list or of the list it replaces (another
        model of that name is left alone, and the variant's blobs unnamed; a warning says so).
        """
        written: list[Path] = []
        taken: set[str] = set()
        for i, raw in extra:
            child = lst.children[i]
            base = f"{name.tag}-{(child_runner(child) or 'variant').lower()}"
            tag, n = base, 1
            while tag.lower() in taken:
                n += 1
                tag = f"{base}-{n}"
            taken.add(tag.lower())
            try:
                anchor = name.with_tag(tag)
            except StoreError:
                log.warning(
                    "%s: no legacy name for its child %s (%s is too long)",
                    name.shortest,
                    child.digest,
                    tag,
                )
                continue
            path = self.layout.legacy_manifest(anchor)
            try:
                there = Digest.of_bytes(read_limited(path, MAX_MANIFEST_BYTES))
            except FileNotFoundError:
                there = None
            if there is not None and there not in ours:
                log.warning(
                    "%s exists and is another model; %s's child %s is named by no legacy "
                    "manifest, so a stock Ollama's prune would delete its blobs",
                    anchor.shortest,
                    name.shortest,
                    child.digest,
                )
                continue
            written.append(self.store.write_legacy_manifest(anchor, raw))
        return written
