"""The link counts a mount start keeps for the next (fsd.counts): taken only when a build that
keeps nothing would count the same, and never harmful when the file is not what was saved."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from modelfs.fsd import counts
from modelfs.fsd.builder import TreeBuilder
from modelfs.fsd.nodes import DirNode, InodeTable, Node
from modelfs.fsd.ops import ModelOperations
from modelfs.store.digest import Digest
from modelfs.store.index import indexfile
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from modelfs.store.scan import ScanCache, scan_store
from tests.builders import TinyStore, compact
from tests.mounting import fuse, mounted
from tests.test_tree import counted, shared_tool_store


def kept_build(root: Path) -> tuple[dict[str, tuple[object, ...]], bool]:
    """What a mount's build shows (every path's link count), with the scan index and the
    counts kept as a mount keeps them; and whether it took the counts."""
    index = scan_store(root, ScanCache.open(Layout(root)))
    cache = index.cache
    tree = TreeBuilder(InodeTable()).build(index)
    assert cache is not None and tree._build is not None
    cache.save()
    return counted(tree), tree._build.known is not None


def fresh_build(root: Path) -> dict[str, tuple[object, ...]]:
    """The same from a scan that keeps nothing."""
    return counted(TreeBuilder(InodeTable()).build(scan_store(root)))


def settled(root: Path) -> None:
    """Counts saved, and taken by the next build."""
    for _ in range(2):
        kept_build(root)
    assert kept_build(root)[1]


def two_spellings(tiny: TinyStore) -> tuple[bytes, bytes]:
    """Two manifest lists of the same child (one with an annotation more)."""
    child = tiny.manifest([tiny.layer("model", b"weights"), tiny.layer("license", b"MIT")])
    first = tiny.manifest_list([(child, "ggml", "gguf")])
    spelled = json.loads(first)
    spelled["annotations"] = {"org.example": "another spelling"}
    return first, compact(spelled)


def move_link(tiny: TinyStore, name: str, old: bytes, new: bytes) -> None:
    """Point a `manifests-v2/` tag at another manifest blob already in the store (as a link
    renamed over it: blobs/ is not touched)."""
    link = tiny.layout.v2_manifest(parse_name(name))
    moved = link.with_name("moved")
    os.symlink(os.readlink(link).replace(Digest.of_bytes(old).hex, Digest.of_bytes(new).hex), moved)
    os.replace(moved, link)


def test_a_tag_retargeted_to_another_list_of_the_same_children_is_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tags naming lists of the same child, in two spellings: .by-digest/ shows both lists
    and the child's blobs are placed there three times. One tag's `manifests-v2/` link moved
    to the other list (the old list's blob stays in blobs/, whose stamp does not move; names,
    children and runners are the same): the lists' own digests are in the key too."""
    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # settled at once
    tiny = TinyStore(tmp_path / "models")
    first, second = two_spellings(tiny)
    tiny.v2("x:1", first, mtime_ns=2 * 10**18)
    tiny.v2("y:1", second, mtime_ns=10**18)
    settled(tiny.root)
    assert kept_build(tiny.root)[0] == fresh_build(tiny.root)

    blobs = os.stat(tiny.layout.blobs)
    move_link(tiny, "y:1", second, first)
    assert os.stat(tiny.layout.blobs) == blobs
    got, _ = kept_build(tiny.root)
    want = fresh_build(tiny.root)
    assert got == want


@fuse
@pytest.mark.parametrize("name", [counts.FILE_NAME, "scan-index"])
def test_a_fifo_in_place_of_a_kept_file_never_holds_up_a_mount(tmp_path: Path, name: str) -> None:
    """A FIFO where the counts (or the scan index) are kept: its open would wait for a writer
    for ever, and the mount never came up. It is passed over as any unusable file is, and
    replaced by the file the mount keeps."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights")
    time.sleep(2.1)  # settled: the start takes blobs/ as it is and looks for kept counts
    tiny.layout.state.mkdir(exist_ok=True)
    os.mkfifo(tiny.layout.state / name)
    with mounted(tiny.root, tmp_path / "mnt") as proc:
        assert (tmp_path / "mnt" / "m" / "1" / "model.gguf").read_bytes() == b"weights"
        assert proc.poll() is None


def rewritten(root: Path, field: int, value: Any) -> None:
    """The kept counts with one field (by its place in what fsd.counts saves) made `value`,
    every key of a mapping given `value` where `value` is no mapping itself; checksummed
    and owned as the mount writes it."""
    path = Layout(root).state / counts.FILE_NAME
    obj, why = indexfile.read_index(path, counts.MAGIC, counts.FORMAT_VERSION, root)
    assert obj is not None, why
    fields = list(obj)
    old = fields[field]
    if isinstance(old, dict) and old and not isinstance(value, dict):
        value = dict.fromkeys(old, value)
    fields[field] = value
    indexfile.write_index(path, counts.MAGIC, counts.FORMAT_VERSION, tuple(fields), root)


def attributes(root: Path) -> dict[str, int]:
    """Every path's link count as the mount answers a stat (pyfuse3's attributes), each blob's
    asked before any tool layout is laid out, as a first `ls -l` of a model directory does."""
    index = scan_store(root, ScanCache.open(Layout(root)))
    tree = TreeBuilder(InodeTable()).build(index)
    ops = ModelOperations(tree, 0, 0, root)
    blobs = tree.root.children[".blobs"]
    assert isinstance(blobs, DirNode)
    out = {f"/.blobs/{name}": ops._attrs(node).st_nlink for name, node in blobs.children.items()}

    def listed(node: Node, path: str) -> None:  # each asked before it is filled
        out[path] = ops._attrs(node).st_nlink
        if isinstance(node, DirNode):
            for name, child in node.children.items():
                listed(child, f"{path}/{name}")

    listed(tree.root, "")
    return out


HUGE = 1 << 80


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (1, HUGE),  # place_links
        (1, -5),
        (4, HUGE),  # merged_links
        (5, HUGE),  # gguf_places
        (8, (HUGE, 0)),  # hidden_subdirs
        (8, ("1", "2")),
        (9, 1),  # blob_repos
        (9, [None]),
        (9, [[["not", "a"], "repo"]]),
        (9, "registry.ollama.ai"),
        (9, {1}),  # marshal loads sets too: a set is no sign of a list worked out here
        (9, {("nope",)}),
    ],
)
def test_kept_counts_not_of_the_shape_saved_cost_only_the_counting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: int, value: Any
) -> None:
    """A counts file with its checksum right but a field of another shape or a count no store
    has (written by a bug, or by hand): every path still answers a stat with the link count
    a build that keeps nothing gives. A repository list of another shape failed every blob's
    stat with EIO, a huge count every stat of what showed it (st_nlink overflows)."""
    monkeypatch.setattr(indexfile, "RACY_NS", 0)
    shared_tool_store(tmp_path / "models")
    tiny = TinyStore(tmp_path / "models")
    child = tiny.manifest([tiny.layer("model", b"w"), tiny.layer("projector", b"p")])
    tiny.v2("lst:1", tiny.manifest_list([(child, "ggml", "gguf"), (child, "llamacpp", "gguf")]))
    settled(tiny.root)
    want = attributes(tiny.root)
    rewritten(tiny.root, field, value)
    assert attributes(tiny.root) == want


def stat_links(mnt: Path) -> dict[str, int]:
    """Every path of a mount and its st_nlink, as `find -links` and `du` see them."""
    out: dict[str, int] = {}
    for top, _dirs, files in os.walk(mnt):
        rel = top[len(str(mnt)) :] or "/"
        out[rel] = os.lstat(top).st_nlink
        for name in files:
            out[f"{rel.rstrip('/')}/{name}"] = os.lstat(os.path.join(top, name)).st_nlink
    return out


@fuse
def test_a_mount_after_a_tag_moved_to_another_list_shows_the_links_of_a_fresh_build(
    tmp_path: Path,
) -> None:
    """The retargeted list above, through real mounts: the first start saves the counts, the
    second takes them, the third (after the move) shows what a build that keeps nothing
    counts."""
    tiny = TinyStore(tmp_path / "models")
    first, second = two_spellings(tiny)
    tiny.v2("x:1", first, mtime_ns=2 * 10**18)  # one mtime: the order stays x, y
    tiny.v2("y:1", second, mtime_ns=2 * 10**18)
    tiny.gguf_model("a:b", payload=b"ab")
    time.sleep(2.1)  # settled: a start keeps its counts only then
    mnt = tmp_path / "mnt"
    for _ in range(2):
        with mounted(tiny.root, mnt):
            stat_links(mnt)
    assert (tiny.layout.state / counts.FILE_NAME).is_file()
    move_link(tiny, "y:1", second, first)
    with mounted(tiny.root, mnt):
        got = stat_links(mnt)
    want = {path or "/": shown[1] for path, shown in fresh_build(tiny.root).items()}
    assert {p: (got.get(p), n) for p, n in want.items() if got.get(p) != n} == {}
