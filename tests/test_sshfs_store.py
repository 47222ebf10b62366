"""A store shared over a real sshfs mount (a loopback sshd started by the test, tests/sshfs.py),
as users share one between hosts: `-o cache=no,follow_symlinks`, the options the README gives."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, DemoStore
from modelfs.store.scan import scan_store
from tests import sshfs as sshfs_mod
from tests.mounting import fuse
from tests.test_ollama_serve import demo
from tests.test_pull_hosts import modelfs_serve, pull

__all__ = ["demo"]  # fixtures
pytestmark = [
    fuse,
    pytest.mark.skipif(not sshfs_mod.available(), reason="needs sshfs, sshd and root"),
]
OPTIONS = ("cache=no", "follow_symlinks")


def leftovers(store: Path) -> list[str]:
    """Every file under `.modelfs/` that is no lease, GC state, history or trash."""
    kept = ("leases/", "trash/", "history/", "gc-")
    found = []
    for top, _dirs, files in os.walk(store / ".modelfs"):
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), store / ".modelfs")
            if not rel.startswith(kept) or name.startswith(".fuse_hidden"):
                found.append(rel)
    return sorted(found)


def test_a_list_pulled_over_sshfs_keeps_its_v2_links_and_leaves_nothing(
    demo: DemoStore, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    mnt = tmp_path / "mnt"
    with (
        modelfs_serve(demo.root) as url,
        sshfs_mod.sshd(tmp_path / "ssh") as server,
        sshfs_mod.sshfs(server, shared, mnt, *OPTIONS),
    ):
        for argv in (("qwen3:0.6b",), (GEMMA, "--all-variants")):
            r = pull(mnt, *argv, "--from", url)
            assert r.returncode == 0, r.stderr
        assert leftovers(shared) == []
        # What the store says through the mount is what it says on the disk behind it.
        assert {e.name.shortest for e in scan_store(mnt)} == {
            e.name.shortest for e in scan_store(shared)
        }
    # Each v2 tag is a link to its manifest blob, never a copy: a symlink where the client
    # makes one cleanly, else a hard link (sshfs with follow_symlinks fails every symlink(2)
    # it makes: the kernel finds the new entry is no symlink through it).
    v2 = [p for p in (shared / "manifests-v2").rglob("*") if not p.is_dir()]
    assert v2
    for tag in v2:
        blob = shared / "blobs" / f"sha256-{hashlib.sha256(tag.read_bytes()).hexdigest()}"
        assert tag.is_symlink() or os.stat(tag).st_ino == os.stat(blob).st_ino, tag
