"""Manifests, last: what a pull writes once every blob a manifest names is present.

    ManifestWriter(layout, prefer).write_manifest(name, raw, had_v2) -> [paths]
    ManifestWriter(layout, prefer).write_list(name, list_raw, lst, children) -> [paths]
    existing_name(layout, name) -> (the store's spelling of name | None, it is a v2 entry)

Each file is written atomically (temp file in `.modelfs/tmp/`, fsync, rename), byte for byte:

- a plain manifest: `manifests/<host>/<ns>/<model>/<tag>`, the legacy file every Ollama
  version reads (and, if the store already has a `manifests-v2/` entry for that name, it is
  moved to the new manifest too, because v2 hides legacy);
- a manifest list: `store.listtag.write_list_tag` (the child manifest blobs, then the list
  blob and the `manifests-v2/…/<tag>` symlink to it, then the legacy anchor, then a legacy
  `<tag>-<runner>` file for each other pulled child), as every writer of a list does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from modelfs.store.blobs import BlobStore
from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.listtag import write_list_tag
from modelfs.store.manifest import Manifest, ManifestList
from modelfs.store.names import Name, name_from_path_parts
from modelfs.sync.client.peer import FetchedManifest
from modelfs.sync.errors import local_error

log = logging.getLogger(__name__)


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
        """A manifest list and the children of it fetched here (`store.listtag`, the one way
        every writer of a list leaves the store)."""
        try:
            return write_list_tag(
                self.store, name, list_raw, lst, [(i, m) for i, _, m in children], self.prefer
            )
        except OSError as exc:
            raise local_error(exc, self.layout, f"the manifests of {name.shortest}") from None
