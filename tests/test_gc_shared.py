"""GC on a store directory shared by hosts whose views of it lag behind (NFS, sshfs).

A network filesystem's client caches directory listings and attributes for seconds (sshfs: 20 s
by default; NFS: acdirmin/acdirmax, 30-60 s), so one host's GC may not see a manifest or a
lease another host wrote a moment ago. What keeps every wanted blob anyway, each by a test:

- a pull gives every blob of its model a fresh mtime before it writes the manifest, and a blob
  that vanishes under it (another host's GC) is fetched again: the pull never fails for it;
- GC decides each move on a fresh look (manifests and leases listed again, the candidate
  opened and its own mtime and ctime compared), and its grace is never below a floor that
  outlasts client caches unless a flag that names the risk says so;
- the trash puts back, first thing in a run, whatever any manifest, v2 link, list child or
  lease names, including a manifest blob a v2 link points at.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, build_demo_store
from store.blobs import BlobStore
from store.digest import Digest, is_blob_name
from store.layout import Layout
from store.names import parse_name
from sync.progress import NullProgress
from sync.pull import PullOptions, pull
from tests.fakepeer import FakePeer

OPTS = PullOptions(read_timeout=5.0)


def trash_everything(layout: Layout) -> list[str]:
    """What another host's GC does to every blob it takes for unneeded: a rename into the trash."""
    trash = layout.trash / "20260101T000000Z-otherhost"
    trash.mkdir(parents=True, exist_ok=True)
    moved = [n for n in os.listdir(layout.blobs) if is_blob_name(n)]
    for n in moved:
        os.rename(layout.blobs / n, trash / n)
    return moved


# -- a pull survives a concurrent GC ------------------------------------------------------------
def test_put_bytes_writes_anew_a_blob_that_leaves_between_the_look_and_the_touch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(tmp_path / "s")
    store = BlobStore(layout)
    data = b'{"schemaVersion":2}'
    digest = store.put_bytes(data)
    real_has = BlobStore.has

    def has_then_gone(self: BlobStore, d: Digest, size: int | None = None) -> bool:
        found = real_has(self, d, size)
        trash_everything(layout)  # another host's GC, right after our look
        return found

    monkeypatch.setattr(BlobStore, "has", has_then_gone)
    assert store.put_bytes(data) == digest
    assert layout.blob(digest).read_bytes() == data


class TrashOnFirstPresent(NullProgress):
    """Progress that, when the pull reports its first blob as already here, has another host's
    GC take every blob of the store: the window between "present" and "refreshed"."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.moved: list[str] = []

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        if not self.moved and completed == total:
            self.moved = trash_everything(self.layout)


async def test_a_re_pull_whose_present_blobs_are_collected_under_it_fetches_them_again(
    tmp_path: Path,
) -> None:
    demo = build_demo_store(tmp_path / "src")
    layout = Layout(tmp_path / "dst")
    with FakePeer(demo.root) as peer:
        await pull(layout, [GEMMA], [peer.url], options=OPTS)
        name = parse_name(GEMMA)
        # `ollama rm`: the tag's files go, its blobs stay (until a GC).
        layout.v2_manifest(name).unlink()
        layout.legacy_manifest(name).unlink()
        progress = TrashOnFirstPresent(layout)
        report = await pull(layout, [GEMMA], [peer.url], options=OPTS, progress=progress)
    assert progress.moved, "the re-pull found nothing present: the test tested nothing"
    [model] = report.models
    assert model.fetched > 0  # fetched again rather than failed
    lst = demo.lists[GEMMA]
    assert layout.v2_manifest(name).read_bytes() == lst.raw
    child = demo.manifests[f"{GEMMA}@llamacpp"]
    for d in (lst.digest, child.digest, *(layer.digest for layer in child.layers)):
        assert layout.blob(d).is_file(), d
    assert json.loads(layout.legacy_manifest(name).read_bytes())["layers"]
    shutil.rmtree(layout.trash)
