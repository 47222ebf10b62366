"""A store shared over a real sshfs mount (a loopback sshd started by the test, tests/sshfs.py),
as users share one between hosts: `-o cache=no,follow_symlinks`, the options docs/gc.md gives."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, DemoStore
from modelfs.store.compat.decisions import NAME as DECISIONS
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests import sshfs as sshfs_mod
from tests.mounting import fuse, mounted
from tests.test_ollama_serve import demo
from tests.test_pull_hosts import modelfs, modelfs_serve, pull

__all__ = ["demo"]  # fixtures
pytestmark = [
    fuse,
    pytest.mark.skipif(not sshfs_mod.available(), reason="needs sshfs, sshd and root"),
]
OPTIONS = ("cache=no", "follow_symlinks")


def leftovers(store: Path) -> list[str]:
    """Every file under `.modelfs/` that is no lease, GC or verify state, history, trash, the
    llama.cpp views' decisions, the scan and reach indexes or a mount's counts (their temp files are
    leftovers)."""
    kept = (
        "leases/",
        "trash/",
        "history/",
        "gc/",
        "verify/",
        DECISIONS,
        "scan-index",
        "reach-index",
        "mount-counts",
    )
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


@pytest.mark.slow
def test_two_hosts_share_a_store_over_sshfs_for_a_minute(demo: DemoStore, tmp_path: Path) -> None:
    """Two sshfs mounts of one directory stand for two hosts. For 60 s they take turns to
    pull, to remove a tag as `ollama rm` does (its manifest files), and to collect garbage
    with a grace of a second, while a modelfs mount of the first reads every model's weights
    throughout. Every file read had, as it was read, the bytes of the digest it had when it
    was opened; after it, `.modelfs/` holds nothing but GC state, history and the trash: no
    lease (every process is gone), no temp file, no `.fuse_hidden*`."""
    shared = tmp_path / "shared"
    shared.mkdir()
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    names = sorted(demo.names)
    reads: list[str] = []
    wrong: list[str] = []
    stop = threading.Event()

    def reader(mnt: Path) -> None:
        while not stop.is_set():
            try:
                models = sorted(mnt.glob("*/*/model.gguf"))
            except FileNotFoundError:
                continue  # a model removed while the listing walked it
            for model in models:
                try:
                    fd = os.open(model, os.O_RDONLY)
                except OSError:
                    continue  # removed since the listing
                try:
                    digest = os.getxattr(fd, "user.modelfs.digest").decode()
                    h = hashlib.sha256()
                    while chunk := os.read(fd, 1 << 20):
                        h.update(chunk)
                    if f"sha256:{h.hexdigest()}" != digest:
                        wrong.append(f"{model}: read {h.hexdigest()}, opened as {digest}")
                    reads.append(digest)
                except OSError as exc:
                    wrong.append(f"{model}: {exc}")
                finally:
                    os.close(fd)

    with (
        modelfs_serve(demo.root) as url,
        sshfs_mod.sshd(tmp_path / "ssh") as server,
        sshfs_mod.sshfs(server, shared, hosts[0], *OPTIONS),
        sshfs_mod.sshfs(server, shared, hosts[1], *OPTIONS),
    ):
        first = pull(hosts[0], *names, "--from", url)
        assert first.returncode == 0, first.stderr
        with mounted(hosts[0], tmp_path / "view"):
            thread = threading.Thread(target=reader, args=(tmp_path / "view",))
            thread.start()
            try:
                deadline = time.monotonic() + 60
                turn = 0
                while time.monotonic() < deadline:
                    host, other = hosts[turn % 2], hosts[(turn + 1) % 2]
                    name = names[turn % len(names)]
                    r = pull(host, name, "--all-variants", "--from", url)
                    assert r.returncode == 0, r.stderr
                    if turn % 3 == 2:
                        gone = parse_name(names[(turn + 1) % len(names)])
                        layout = Layout(other)
                        for path in (layout.legacy_manifest(gone), layout.v2_manifest(gone)):
                            with contextlib.suppress(FileNotFoundError):
                                path.unlink()
                    if turn % 4 == 3:
                        r = modelfs(
                            "gc", "--store", str(host), "--grace", "1s", "--grace-below-floor"
                        )
                        assert "Traceback" not in r.stderr, r.stderr
                    turn += 1
            finally:
                stop.set()
                thread.join(timeout=60)
        print(f"sshfs soak: {turn} turns, {len(reads)} whole reads, {len(set(reads))} blobs")
        assert not wrong, wrong[:10]
        assert len(reads) >= 10, reads
        assert turn >= 10
    assert leftovers(shared) == []
    assert list((shared / ".modelfs" / "leases").iterdir()) == []
