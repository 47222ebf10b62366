"""A long-lived mount stays its size, and link counts tell the truth.

The kernel holds an inode from the lookup (or readdirplus entry) that handed it out until it
sends FORGET for it; a node the served tree no longer has may go then, and not before.
"""

from __future__ import annotations

import collections
import gc
import os
import subprocess
import time
import weakref
from pathlib import Path

import pyfuse3
import pytest
import trio

from modelfs.demo import build_demo_store
from modelfs.fsd.builder import NameTree, TreeBuilder
from modelfs.fsd.mount import Mount
from modelfs.fsd.nodes import DirNode, InodeTable, Node
from modelfs.fsd.ops import ModelOperations
from modelfs.store.digest import Digest
from modelfs.store.index import indexfile
from modelfs.store.layout import Layout
from modelfs.store.scan import DEFAULT_PREFER, ScanCache, scan_store
from tests.builders import TinyStore
from tests.mounting import fuse, mounted
from tests.test_tree import walk


def test_every_file_has_as_many_links_as_paths(tmp_path: Path) -> None:
    """`du`, `rsync -aH` and `tar` count a file once per link count: a file shown at three
    paths with a link count of 1 is copied three times. The demo store has a manifest list
    whose mlx child's `model.safetensors` shows at `@mlx/`, `.by-name/` and `.by-digest/`."""
    root = tmp_path / "models"
    build_demo_store(root)
    tree = TreeBuilder(InodeTable()).build(scan_store(root))
    paths: dict[int, list[str]] = collections.defaultdict(list)
    nodes: dict[int, Node] = {}
    for path, node in walk(tree.root).items():
        if not isinstance(node, DirNode):
            paths[node.inode].append(path)
            nodes[node.inode] = node
    wrong = {
        "; ".join(sorted(where)): nodes[ino].links
        for ino, where in paths.items()
        if nodes[ino].links != len(where)
    }
    assert not wrong
    merged = [p for p in walk(tree.root) if p.endswith("/model.safetensors")]
    assert len(merged) >= 3  # the case that was wrong is in the store


def _retag(tiny: TinyStore, i: int) -> None:
    tiny.gguf_model("m:1", payload=f"weights {i}".encode() * 100)


def _collect(tiny: TinyStore, i: int) -> None:
    """What a GC does after a re-tag: the weights no tag names any more go. (A blob the
    store still has keeps its inode number across rebuilds, so a store that only grew would
    grow the inode table with it.)"""
    os.unlink(Layout(tiny.root).blob(Digest.of_bytes(f"weights {i}".encode() * 100)))


def test_nodes_of_replaced_trees_go_once_the_kernel_forgets_them(tmp_path: Path) -> None:
    """Many re-tags: the mount's node table and inode table stay the size of one tree plus
    what the kernel still holds; an inode the kernel holds stays resolvable whatever was
    swapped in meanwhile."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("keep:1", payload=b"stays")
    _retag(tiny, 0)
    inodes = InodeTable()
    builder = TreeBuilder(inodes)
    ops = ModelOperations(builder.build(scan_store(tiny.root)), 0, 0, tiny.root)

    async def look(path: str) -> int:
        ino = 1
        for part in path.strip("/").split("/"):
            ino = (await ops.lookup(ino, part.encode())).st_ino
        return ino

    async def run() -> None:
        held = await look("m/1/model.gguf")  # the kernel keeps this one (an open file, say)
        held_node = ops.nodes[held]
        sizes = []
        for i in range(1, 41):
            _retag(tiny, i)
            if i > 1:
                _collect(tiny, i - 1)  # weights 0 stay: the kernel holds their file
            ops.swap(builder.build(scan_store(tiny.root)))
            # What a reader does after each change: look at the new file, then the kernel
            # forgets it (cache pressure, or the dentry timing out).
            ino = await look("m/1/.ollama/digest")
            await ops.forget([(ino, 1)])
            sizes.append((len(ops.nodes), len(inodes)))
        assert sizes[-1] == sizes[4], sizes  # flat, not growing with every re-tag
        assert ops.nodes[held] is held_node  # never let go while the kernel holds it
        assert (await ops.getattr(held)).st_size == len(b"weights 0") * 100
        await ops.forget([(held, 1)])
        assert held not in ops.nodes
        # The served tree's own nodes never go, forgotten or not.
        current = await look("keep/1/model.gguf")
        await ops.forget([(current, 1)])
        assert (await ops.getattr(current)).st_ino == current

    trio.run(run)


@fuse
def test_a_real_mount_forgets_and_still_serves_what_the_kernel_holds(tmp_path: Path) -> None:
    """Through a real kernel: readdirplus and lookups counted as the kernel counts them, so
    nothing it still holds is dropped (an open file and its fstat, every path), across
    re-tags that make the kernel forget the replaced names. (Not a global drop_caches: it
    disturbs the FUSE tests that run after this one.)"""
    tiny = TinyStore(tmp_path / "models")
    _retag(tiny, 0)
    tiny.gguf_model("keep:1", payload=b"stays")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        held = open(mnt / "m" / "1" / "model.gguf", "rb")  # noqa: SIM115
        try:
            for i in range(1, 8):
                _retag(tiny, i)
                want = f"weights {i}".encode() * 100
                deadline = time.monotonic() + 5
                while (mnt / "m" / "1" / "model.gguf").read_bytes() != want:
                    assert time.monotonic() < deadline, "re-tag not shown"
                    time.sleep(0.05)
                # Each rescan invalidates the changed names, and the kernel forgets the
                # inodes behind them that nothing holds: FORGETs reach the mount.
                subprocess.run(["ls", "-lR", str(mnt)], capture_output=True, check=True)
            assert os.fstat(held.fileno()).st_size == len(b"weights 0") * 100
            assert held.read() == b"weights 0" * 100
            for dirpath, _dirs, files in os.walk(mnt):
                for name in files:
                    os.stat(os.path.join(dirpath, name))
            assert (mnt / "keep" / "1" / "model.gguf").read_bytes() == b"stays"
            digest = Digest.of_bytes(b"weights 7" * 100)
            assert (
                os.getxattr(mnt / "m" / "1" / "model.gguf", "user.modelfs.digest")
                == str(digest).encode()
            )
        finally:
            held.close()


def _weights(token: str, i: int) -> bytes:
    # `token` keeps a test's digests apart from those other tests parsed in this process.
    return f"weights {i} of {token}".encode() * 100


def _replace(tiny: TinyStore, token: str, i: int) -> None:
    """A re-tag as a pull and a GC leave it: the replaced weights' blob is gone."""
    tiny.gguf_model("m:1", payload=_weights(token, i))
    (tiny.layout.blobs / Digest.of_bytes(_weights(token, i - 1)).blob_name).unlink()


def _live(kind: type) -> int:
    gc.collect()
    return sum(isinstance(o, kind) for o in gc.get_objects())


def test_a_view_through_many_rescans_keeps_no_digest_of_replaced_manifests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a mount rescans (a ScanCache, one builder, swaps): the digests a replaced manifest
    named go with it, whatever parsed them on the way."""
    # Every file kept from its first scan on: with the 2 s margin for racy stamps, `keep:1`
    # would join the cache somewhere in the loop on a slow machine, and the count with it.
    monkeypatch.setattr(indexfile, "RACY_NS", 0)
    token = os.urandom(8).hex()
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("keep:1", payload=b"stays")
    tiny.gguf_model("m:1", payload=_weights(token, 0))
    cache = ScanCache()
    builder = TreeBuilder(InodeTable())
    ops = ModelOperations(builder.build(scan_store(tiny.root, cache)), 0, 0, tiny.root)
    counts = []
    for i in range(1, 31):
        _replace(tiny, token, i)
        ops.swap(builder.build(scan_store(tiny.root, cache)))
        counts.append(_live(Digest))
    assert counts[-1] == counts[4], counts  # flat: one new digest a re-tag was kept


class _Cycle:
    """Stands for what a request in flight holds (an exception, its traceback and frames)."""

    def __init__(self) -> None:
        self.me = self


async def test_the_mounts_rebuilds_let_go_of_old_trees_and_of_what_they_froze(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mount's own loop of store changes (`Mount._follow`, no kernel): once a new tree is
    served, the tree it replaced is freed, and a reference cycle that was alive when a tree was
    frozen out of the collector's reach is collected after it dies, by the next rebuild."""
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda *args, **kwargs: None)
    token = os.urandom(8).hex()
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("keep:1", payload=b"stays")
    tiny.gguf_model("m:1", payload=_weights(token, 0))
    (tmp_path / "mnt").mkdir()
    mount = Mount(tiny.root, tmp_path / "mnt", prefer=DEFAULT_PREFER)
    in_flight = [_Cycle()]
    cycle = weakref.ref(in_flight[0])
    try:
        mount.ops = ModelOperations(mount._scan(), 0, 0, tiny.root)
        trees = [weakref.ref(mount.ops.tree)]
        swapped = [trio.Event()]
        swap = mount.ops.swap

        def swap_and_tell(tree: NameTree) -> None:
            swap(tree)
            swapped[0].set()

        monkeypatch.setattr(mount.ops, "swap", swap_and_tell)
        watch = mount._open_watch()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mount._follow, watch)
                for i in range(1, 4):
                    swapped[0] = trio.Event()
                    _replace(tiny, token, i)
                    with trio.fail_after(20):
                        await swapped[0].wait()
                    trees.append(weakref.ref(mount.ops.tree))
                    in_flight.clear()  # its request is done: the cycle is garbage now
                # Asked while the loop waits for the next change, as a mount does for hours.
                gc.collect()
                assert [t() for t in trees[:-1]] == [None] * (len(trees) - 1)
                assert cycle() is None
                nursery.cancel_scope.cancel()
        finally:
            if watch is not None:
                watch.close()
    finally:
        gc.unfreeze()  # the tests after this one run with a collector that sees everything
