"""The name tree without a mount: paths, stable inodes, collisions."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

import modelfs.fsd.builder as fsd_builder
from modelfs.demo import build_demo_store
from modelfs.fsd import tool_dirs
from modelfs.fsd.builder import NameTree, TreeBuilder, short_path
from modelfs.fsd.mount import Mount, changed_entries
from modelfs.fsd.nodes import BlobNode, DirNode, InodeTable, Node
from modelfs.fsd.ops import ModelOperations
from modelfs.store.digest import Digest
from modelfs.store.index import indexfile
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from modelfs.store.scan import ScanCache, StoreIndex, scan_store
from modelfs.store.watch import store_signature
from tests.builders import TinyStore


def walk(node: Node, path: str = "") -> dict[str, Node]:
    out = {path or "/": node}
    if isinstance(node, DirNode):
        for name, child in node.children.items():
            out.update(walk(child, f"{path}/{name}"))
    return out


def test_short_paths() -> None:
    assert short_path(parse_name("gemma4:26b")) == ("gemma4", "26b")
    assert short_path(parse_name("ollama.com/library/gemma4:26b")) == (
        "ollama.com",
        "library",
        "gemma4",
        "26b",
    )
    assert short_path(parse_name("u/m:t")) == ("u", "m", "t")
    assert short_path(parse_name("hf.co/a/b:c")) == ("hf.co", "a", "b", "c")


def test_inodes_stable_across_rebuilds_and_new_content_gets_new_inode(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"a")
    tiny.gguf_model("b:1", payload=b"b")
    builder = TreeBuilder(InodeTable())
    first = builder.build(scan_store(tiny.root))
    before = {p: n.inode for p, n in walk(first.root).items()}
    tiny.gguf_model("b:1", payload=b"b2")  # re-tag b
    tiny.gguf_model("c:1", payload=b"c")
    second = builder.build(scan_store(tiny.root))
    after = {p: n.inode for p, n in walk(second.root).items()}
    assert after["/a/1/model.gguf"] == before["/a/1/model.gguf"]
    assert after["/a/1"] == before["/a/1"] and after["/b/1"] == before["/b/1"]
    assert after["/b/1/model.gguf"] != before["/b/1/model.gguf"]
    assert after["/c/1/model.gguf"] not in before.values()
    # the shared template blob is one inode wherever it shows
    assert after["/a/1/template.txt"] == after["/b/1/template.txt"]
    stale = set(changed_entries(first, second))
    assert (before["/b/1"], "model.gguf") in stale
    assert all(name != "model.gguf" or parent != before["/a/1"] for parent, name in stale)


def test_collisions_keep_every_model_under_by_name(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("hf.co:x", payload=b"library model called hf.co")
    tiny.gguf_model("hf.co/x/m:t", payload=b"other host")
    tiny.gguf_model("a:model.gguf", payload=b"tag named like a file")
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    paths = walk(tree.root)
    assert "/.by-name/registry.ollama.ai/library/hf.co/x/model.gguf" in paths
    assert "/.by-name/hf.co/x/m/t/model.gguf" in paths
    assert isinstance(paths["/a/model.gguf"], DirNode)


def test_missing_blob_not_listed_and_status(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"weights")
    from modelfs.store.digest import Digest

    tiny.layout.blob(Digest.of_bytes(b"weights")).unlink()
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    paths = walk(tree.root)
    assert "/a/1/model.gguf" not in paths and "/a/1/LICENSE" in paths
    status = paths["/a/1/.ollama/status"]
    assert status.data.decode().startswith("missing blob sha256:")  # type: ignore[attr-defined]
    assert all(not isinstance(n, BlobNode) or n.path.exists() for n in paths.values())


def test_signature_moves_on_each_kind_of_change(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"a")
    layout = Layout(tiny.root)
    s0 = store_signature(layout)
    assert store_signature(layout) == s0
    tiny.v2("b:1", tiny.manifest([tiny.layer("model", b"b")]))
    s1 = store_signature(layout)
    assert s1 != s0
    tiny.layout.legacy_manifest(parse_name("a:1")).unlink()
    s2 = store_signature(layout)
    assert s2 != s1
    tiny.blob(b"just a blob")
    assert store_signature(layout) != s2


@pytest.mark.parametrize(
    "change", ["none", "add", "rewrite", "remove-top", "blob", "remove-v2", "remove-blobs"]
)
def test_the_first_look_after_a_start_sees_changes_made_during_its_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A mount start takes no signature before its scan; the first look after it tells by the
    ctimes whether the store changed since the scan began: a tag added, one rewritten with its
    mtime put back, a whole name removed from the top of manifests/, a blob added, the whole
    of manifests-v2/ or blobs/ removed (no ctime of theirs is left to look at)."""
    monkeypatch.setattr(indexfile, "RACY_NS", 20_000_000)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"a")
    tiny.gguf_model("hf.co/o/r:q4", payload=b"r")
    tiny.v2("v:1", tiny.manifest([tiny.layer("model", b"v")]))
    time.sleep(0.05)  # settled, as far as the margin above goes
    mount = Mount(tiny.root, tmp_path / "mnt", prefer=("ggml",))
    try:
        mount._scan(first=True)
    finally:
        gc.unfreeze()  # the mount keeps what its scan made out of the collector's reach
    time.sleep(0.05)  # a change after the scan began, past the margin
    tag = tiny.layout.legacy_manifest(parse_name("a:1"))
    if change == "add":
        tiny.gguf_model("b:1", payload=b"b")
    elif change == "rewrite":
        st = tag.stat()
        with open(tag, "r+b") as f:
            f.write(b" ")  # the same size, its first byte was `{`... and is a space now
        os.utime(tag, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "remove-top":
        shutil.rmtree(tiny.layout.manifests / "hf.co")
    elif change == "blob":
        tiny.blob(b"just a blob")
    elif change == "remove-v2":
        shutil.rmtree(tiny.layout.manifests_v2)
    elif change == "remove-blobs":
        shutil.rmtree(tiny.layout.blobs)
    first = store_signature(Layout(tiny.root))
    assert mount._served_as(first) == (change == "none")
    assert mount._served_as(store_signature(Layout(tiny.root))) == (change == "none")


def test_models_never_nest_and_links_count_places(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("llama3/8b:q4", payload=b"namespace model")
    tiny.legacy("llama3:8b", tiny.manifest([tiny.layer("model", b"library model")]), mtime=2e9)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    paths = walk(tree.root)
    assert "/llama3/8b/model.gguf" in paths
    assert "/llama3/8b/q4" not in paths  # still reachable by its full name:
    assert "/.by-name/registry.ollama.ai/llama3/8b/q4/model.gguf" in paths
    model = paths["/llama3/8b/model.gguf"]
    shown = [p for p, n in paths.items() if n is model]
    assert model.links == len(shown) >= 3  # short name, .by-name, .by-digest, .blobs


def test_text_layers_are_read_by_their_real_size(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    big = b"x" * (2 << 20)
    lie = tiny.layer("license", big)
    lie["size"] = 3  # the manifest claims 3 bytes
    tiny.legacy("m:1", tiny.manifest([tiny.layer("model", b"w"), lie]))
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    paths = walk(tree.root)
    assert "/m/1/LICENSE" not in paths  # wrong size: not served
    assert b"LICENSE" not in paths["/m/1/Modelfile"].data  # type: ignore[attr-defined]


# -- lazy directories (.by-name/, .by-digest/ model dirs and .blobs/ are filled on first use) --
def shown(node: Node, path: str = "") -> dict[str, tuple[object, ...]]:
    """What listings show without filling anything: every entry of every filled directory."""
    nlink = node.nlink if isinstance(node, DirNode) else node.links
    out = {path or "/": (node.inode, node.mode, node.size, nlink, node.mtime_ns)}
    if isinstance(node, DirNode) and node.loaded:
        for name, child in node._children.items():
            out.update(shown(child, f"{path}/{name}"))
    return out


def relative(tree: dict[str, Node], top: str) -> dict[str, tuple[object, ...]]:
    """The files below `top`, by relative path: kind, size and bytes (inodes differ by path)."""
    return {
        p.removeprefix(top): (type(n).__name__, n.size, getattr(n, "data", None), n.links)
        for p, n in tree.items()
        if p.startswith(top + "/")
    }


@pytest.fixture(scope="module")
def demo_index(tmp_path_factory: pytest.TempPathFactory) -> StoreIndex:
    root = tmp_path_factory.mktemp("demo") / "models"
    build_demo_store(root)
    return scan_store(root)


@pytest.mark.parametrize("data", ["fuse", "symlink"])
def test_lazy_directories_show_what_an_eager_build_shows(demo_index: StoreIndex, data: str) -> None:
    tree = TreeBuilder(InodeTable(), data=data).build(demo_index)
    lazy = [n for n in walk_loaded(tree.root) if isinstance(n, DirNode) and not n.loaded]
    assert len(lazy) > 5  # the hidden model dirs and .blobs/ are not filled yet
    before = shown(tree.root)
    paths = walk(tree.root)  # fills everything
    assert all(n.loaded for n in paths.values() if isinstance(n, DirNode))
    after = shown(tree.root)
    # Nothing a listing showed before (inode, mode, size, link count, mtime) has moved.
    assert {p: after[p] for p in before} == before
    # Every blob's link count is the number of places that show it, as an eager build had it.
    for blob in tree.blob_nodes.values():
        assert blob.links == sum(n is blob for n in paths.values())
    # Every model shows the same files in each of its places.
    compared = 0
    # gemma4:26b-mlx is the bytes of gemma4:26b's mlx child: one digest, two tags.
    held_by = Counter(
        d for e in demo_index for d in {e.digest, *(v.manifest.digest for v in e.variants)}
    )
    for entry in demo_index:
        preferred = entry.preferred()
        if preferred is None:
            continue
        short = "/" + "/".join(short_path(entry.name))
        if (
            paths.get(short) is None
            or paths[short].xattrs.get(  # taken by a newer model
                "user.modelfs.manifest_digest"
            )
            != str(preferred.manifest.digest).encode()
        ):
            continue
        files = relative(paths, short)
        assert files and "/Modelfile" in files and "/.ollama/status" in files
        assert relative(paths, "/.by-name/" + "/".join(entry.name.legacy_parts())) == files
        if held_by[entry.digest] == 1:  # else its Modelfile names one of the tags holding it
            assert relative(paths, f"/.by-digest/{entry.digest.hex}") == files
        compared += 1
    assert compared >= 4
    assert set(relative(paths, "/.blobs")) == {f"/{b}" for b in demo_index.blob_names}


def walk_loaded(node: Node) -> list[Node]:
    out = [node]
    if isinstance(node, DirNode) and node.loaded:
        for child in node._children.values():
            out.extend(walk_loaded(child))
    return out


def test_lazy_fill_after_a_swap_is_served_and_old_trees_are_freed(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"a")
    builder = TreeBuilder(InodeTable())
    first = builder.build(scan_store(tiny.root))
    ops = ModelOperations(first, 0, 0, tiny.root)
    old_by_digest = first.root.children[".by-digest"]
    assert isinstance(old_by_digest, DirNode)
    tiny.gguf_model("b:1", payload=b"b")
    second = builder.build(scan_store(tiny.root))
    gc.disable()  # what follows must hold by reference counting alone (the mount freezes)
    try:
        ops.swap(second)
        # A directory of the served tree, filled after the swap: its entries resolve.
        by_digest = second.root.children[".by-digest"]
        assert isinstance(by_digest, DirNode)
        for d in by_digest.children.values():
            assert isinstance(d, DirNode) and not d.loaded
            for child in d.children.values():
                assert ops.nodes[child.inode] is child
        # The old tree's directories no longer displace the new tree's nodes.
        old_dirs = list(old_by_digest.children.values())
        for d in old_dirs:
            assert isinstance(d, DirNode)
            for name, child in d.children.items():
                assert child.inode in ops.nodes
                if name == ".ollama":
                    assert ops.nodes[child.inode] is not child
        del d, old_dirs, old_by_digest, by_digest, child
        gone = weakref.ref(first)
        del first
        ops.swap(builder.build(scan_store(tiny.root)))
        assert gone() is None  # no reference cycle keeps a replaced tree alive
    finally:
        gc.enable()


def test_changed_entries_fills_only_what_was_looked_at(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"a")
    tiny.gguf_model("b:1", payload=b"b")
    builder = TreeBuilder(InodeTable())
    first = builder.build(scan_store(tiny.root))
    seen = walk(first.root)  # fills everything, as if someone had listed it all
    b_digest = seen["/b/1/.ollama/digest"].data.decode().strip()  # type: ignore[attr-defined]
    tiny.gguf_model("b:1", payload=b"b2")  # re-tag b
    second = builder.build(scan_store(tiny.root))
    stale = set(changed_entries(first, second))
    by_digest = second.root.children[".by-digest"]
    assert isinstance(by_digest, DirNode)
    old_hex = Digest.parse(b_digest).hex
    assert (seen["/.by-digest"].inode, old_hex) in stale  # the old manifest's dir is gone
    assert (seen["/.by-name/registry.ollama.ai/library/b/1"].inode, "model.gguf") in stale
    # a's hidden dirs were compared (filled in `second`), and nothing of a is stale
    assert all(seen["/a/1"].inode != parent for parent, _ in stale)
    third = builder.build(scan_store(tiny.root))
    assert list(changed_entries(second, third)) == []
    lazy = [n for n in walk_loaded(third.root) if isinstance(n, DirNode) and not n.loaded]
    assert lazy  # only what `second` had filled was filled in `third`


def shared_tool_store(root: Path) -> StoreIndex:
    """Blobs the tool layouts show more than once: one GGUF in two tags of a repository (one
    LM Studio folder, two hub snapshots), in another repository too, a projector beside it,
    safetensors shards with their config, and the demo store's models around them."""
    build_demo_store(root)
    tiny = TinyStore(root)
    weights = tiny.layer("model", b"shared GGUF weights")
    projector = tiny.layer("projector", b"shared projector")
    for name in ("hf.co/org/Shared-GGUF:Q4_K_M", "hf.co/org/Shared-GGUF:Q8_0", "shared:1b"):
        tiny.legacy(name, tiny.manifest([weights, projector, tiny.layer("license", b"MIT")]))
    config = tiny.layer("json", b'{"model_type":"x"}', name="config.json")
    shards = [tiny.layer("tensor", bytes([t]) * 16, name=f"w{t}") for t in range(3)]
    st = {"model_format": "safetensors", "model_family": "llama", "file_type": "F16"}
    for name in ("st:a", "st:b"):
        tiny.legacy(name, tiny.manifest([*shards, config], st))
    return scan_store(root)


def test_tool_link_counts_asked_first_agree_with_the_whole_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob's link count asked before any tool layout was looked into (the layouts of the
    repositories holding it) is the one the whole layouts give, and the places shown."""
    monkeypatch.setattr(tool_dirs, "COUNT_ALONE", 1 << 30)  # every blob from its repositories
    index = shared_tool_store(tmp_path / "models")
    early = TreeBuilder(InodeTable()).build(index)
    blobs = early.root.children[".blobs"]  # makes every blob's node, and no tool layout
    assert isinstance(blobs, DirNode) and len(blobs.children) == len(early.blob_nodes) > 20
    assert all(b.links_pending for b in early.blob_nodes.values())
    first = {d: b.count_links() for d, b in early.blob_nodes.items()}  # each alone
    assert not any(b.links_pending for b in early.blob_nodes.values())
    whole = TreeBuilder(InodeTable()).build(index)
    paths = walk(whole.root)  # fills the tool tops first: the whole layouts count
    assert {d: whole.blob_nodes[d].links for d in first} == first
    for blob in whole.blob_nodes.values():
        assert blob.links == sum(n is blob for n in paths.values())
    # The three GGUF tags name one manifest (one .by-digest/ directory, one hub snapshot for
    # both hf.co tags, in which the GGUF has a name per tag); the two safetensors tags too, and
    # their shards have one name in that snapshot: each place counted once (an eager build
    # counted a file of a snapshot once per tag naming it: 8 links for 7 places).
    gguf = Digest.of_bytes(b"shared GGUF weights")
    model_dirs = 3 + 3 + 1  # short names, .by-name, .by-digest
    assert first[gguf] == 1 + model_dirs + 2 + 2  # .blobs, two LM Studio folders, two hub names
    assert first[Digest.of_bytes(bytes([1]) * 16)] == 1 + (2 + 2 + 1) + 1


def test_what_a_build_counts_is_what_the_plans_show(tmp_path: Path) -> None:
    """The build counts a model directory's blobs from its manifest's layers, its plan made
    when it is filled: both say the same of every manifest (which blobs, config, tensors,
    model.gguf, mmproj.gguf, the .gguf files and each blob's media type), json layers taking
    a GGUF's name, two layers of a kind and a `.gguf` kind of its own among them."""
    index = shared_tool_store(tmp_path / "models")
    tiny = TinyStore(tmp_path / "models")
    taken = tiny.layer("json", b"{}", name="model.gguf")
    two = [tiny.layer("model", b"first"), tiny.layer("model", b"second")]
    late = tiny.layer("json", b"[]", name="mmproj.gguf")
    tiny.legacy("odd:taken", tiny.manifest([taken, *two, tiny.layer("projector", b"p"), late]))
    own = tiny.layer("x.gguf", b"a kind of its own")  # shown as .ollama/layers/3-x.gguf
    tiny.legacy("odd:two", tiny.manifest([*two, tiny.layer("projector", b"p"), own]))
    index = scan_store(tiny.root)
    tree = TreeBuilder(InodeTable()).build(index)
    build = tree._build
    assert build is not None
    manifests = {v.manifest.digest: v.manifest for e in index for v in e.variants}
    shapes = {d: build._shape(m) for d, m in manifests.items()}  # before any node is made
    media = dict(build.media)  # by hex
    walk(tree.root)
    gguf: set[Digest] = set()
    for digest, m in manifests.items():
        plan, shape = build._plan(m), shapes[digest]
        by_path = {f.path: f.layer.digest for f, _ in plan.shown}
        assert shape.shown == tuple(f.layer.digest for f, _ in plan.shown)
        assert shape.config == (plan.config.digest if plan.config else None)
        assert shape.tensors == plan.tensors
        assert (shape.model, shape.projector) == (
            by_path.get("model.gguf"),
            by_path.get("mmproj.gguf"),
        )
        gguf |= {f.layer.digest for f, _ in plan.shown if f.path.endswith(".gguf")}
        for f, blob in plan.shown:  # the media type of the first layer met with its digest
            assert blob.media_type == media[blob.digest.hex] == media.get(f.layer.digest.hex)
    assert build.gguf_blobs == {d.hex for d in gguf}
    assert shapes[manifests_of(index, "odd:taken")].model == Digest.of_bytes(b"{}")
    assert shapes[manifests_of(index, "odd:two")].model == Digest.of_bytes(b"first")
    assert tree.blob_nodes[Digest.of_bytes(b"second")].gguf  # shown as model-2.gguf
    assert Digest.of_bytes(b"a kind of its own").hex in build.gguf_blobs


def manifests_of(index: StoreIndex, name: str) -> Digest:
    return index.lookup(name).digest


def test_a_blob_keeps_its_inode_across_rebuilds_made_before_it_is_shown(tmp_path: Path) -> None:
    """A blob's node is made when first shown; its number stays from tree to tree all the same
    (and goes once the store no longer has the blob)."""
    tiny = TinyStore(tmp_path)
    tiny.gguf_model("a:1", payload=b"a")
    builder = TreeBuilder(InodeTable())
    first = builder.build(scan_store(tiny.root))
    ops = ModelOperations(first, 0, 0, tiny.root)
    weights = Digest.of_bytes(b"a")

    def inode_of(tree: NameTree) -> int:
        blobs = tree.root.children[".blobs"]
        assert isinstance(blobs, DirNode)
        return blobs.children[weights.blob_name].inode

    before = inode_of(first)
    for payload in (b"b", b"c"):  # two rebuilds, the blob not looked at in the first
        tiny.gguf_model(f"{payload.decode()}:1", payload=payload)
        ops.swap(builder.build(scan_store(tiny.root)))
    assert inode_of(ops.tree) == before
    tiny.layout.legacy_manifest(parse_name("a:1")).unlink()
    tiny.layout.blob(weights).unlink()
    ops.swap(builder.build(scan_store(tiny.root)))
    assert ("blob", weights) not in builder.inodes._by_key


def test_a_warm_build_counts_from_the_scan_index_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With blobs/ as the scan index listed it, the build counts what each model directory
    shows from the blob sizes kept there, stat'ing no blob (13,000 stats on a big store), and
    every listing shows what a build from a cold scan shows: a layer at the wrong size and a
    missing one included."""
    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # this test's writes are kept at once
    root = tmp_path / "models"
    shared_tool_store(root)
    tiny = TinyStore(root)
    wrong = {**tiny.layer("model", b"short weights"), "size": 99}
    gone = {**tiny.layer("license", b"x"), "digest": str(Digest.of_bytes(b"never written"))}
    tiny.legacy("odd:sizes", tiny.manifest([wrong, gone, tiny.layer("license", b"MIT")]))
    layout = Layout(root)
    cold = TreeBuilder(InodeTable()).build(scan_store(layout))
    scan_store(layout, ScanCache.open(layout))  # saves the index, blobs/'s sizes in it
    warm_index = scan_store(layout, ScanCache.open(layout))
    assert warm_index._sizes
    looked: list[str] = []
    look_at_blob = StoreIndex._look_at_blob

    def counted(self: StoreIndex, hex_: str) -> object:
        looked.append(hex_)
        return look_at_blob(self, hex_)

    monkeypatch.setattr(StoreIndex, "_look_at_blob", counted)
    warm = TreeBuilder(InodeTable()).build(warm_index)
    assert looked == []
    walk(cold.root)
    walk(warm.root)
    assert shown(warm.root) == shown(cold.root)
    status = warm.root.children["odd"].children["sizes"].children[".ollama"].children["status"]
    assert b"missing blob" in status.data


def test_a_mount_starts_without_the_llama_cpp_rules() -> None:
    """Importing the mount, its build and the tree's nodes leaves the llama.cpp rules, the
    view builder and the computed tensors' cache unimported (a quarter of the mount's import
    time): they load when a view is first made, after the mount is ready."""
    code = (
        "import sys, modelfs.fsd.mount, modelfs.fsd.builder\n"
        "print(sorted(m for m in sys.modules if m.startswith('modelfs.store.compat.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['modelfs.store.compat.decisions']"]


def test_other_tools_layouts_that_fail_to_lay_out_cost_only_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`.lmstudio/` and `.huggingface/hub/` are laid out when first asked for, and every
    blob's link count asks for them. A model that makes that fail (a bug, an oddity) must not
    fail every listing of the mount: the two show empty, link counts agree with the places a
    walk finds, and one line says why."""
    root = tmp_path / "models"
    build_demo_store(root)

    def broken(*args: object, **kwargs: object) -> list[object]:
        raise RuntimeError("an oddity")

    monkeypatch.setattr(tool_dirs, "layout_files", broken)
    tree = TreeBuilder(InodeTable()).build(scan_store(root))
    nodes = walk(tree.root)  # the old code raised here, from the first blob's link count
    assert not nodes["/.lmstudio"].children and not nodes["/.huggingface/hub"].children
    places = Counter(n.inode for n in nodes.values() if isinstance(n, BlobNode))
    wrong = {
        p: n.count_links()
        for p, n in nodes.items()
        if isinstance(n, BlobNode) and n.count_links() != places[n.inode]
    }
    assert not wrong
    assert len([r for r in caplog.records if "not shown" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({}, {"data": "symlink"}),  # a blob's model directories are links, not its places
        ({}, {"prefer": ("mlx", "ggml")}),  # another variant at the plain tag
        ({"prefer": ("mlx", "ggml")}, {}),
    ],
)
def test_counts_kept_for_the_next_start_are_taken_only_by_the_same_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: dict[str, Any], then: dict[str, Any]
) -> None:
    """A mount start takes the link counts the last build of the same store saved (fsd.counts);
    a mount with another --data or --prefer works its own out, and each shows what a build
    that keeps nothing shows."""
    monkeypatch.setattr(indexfile, "RACY_NS", 0)  # the store below is settled at once
    root = tmp_path / "models"
    shared_tool_store(root)

    def build(**options: Any) -> tuple[dict[str, tuple[object, ...]], bool]:
        index = scan_store(root, ScanCache.open(Layout(root)))
        tree = TreeBuilder(InodeTable(), **options).build(index)
        assert tree._build is not None
        return counted(tree), tree._build.known is not None

    def fresh(**options: Any) -> dict[str, tuple[object, ...]]:
        return counted(TreeBuilder(InodeTable(), **options).build(scan_store(root)))

    assert build(**first) == (fresh(**first), False)  # worked out, and saved
    assert build(**first) == (fresh(**first), True)  # taken
    assert build(**then) == (fresh(**then), False)
    assert fresh(**then) != fresh(**first)


def counted(tree: NameTree) -> dict[str, tuple[object, ...]]:
    """Every path of the whole tree with its kind and link count (a blob's media type too)."""
    out: dict[str, tuple[object, ...]] = {}
    for path, node in walk(tree.root).items():
        if isinstance(node, DirNode):
            out[path] = ("dir", node.nlink)
        elif isinstance(node, BlobNode):
            out[path] = ("blob", node.count_links(), node.media_type, node.gguf)
        else:
            out[path] = (type(node).__name__, node.links)
    return out


def test_a_node_an_old_trees_worker_places_never_displaces_the_new_trees(tmp_path: Path) -> None:
    """A worker thread filling a directory asks whether its tree is still the one served, then
    places its node: a swap of trees in between must not let the replaced tree's node take the
    inode from the new tree's (the mount asks and places under the lock a swap takes)."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"a")
    builder = TreeBuilder(InodeTable())
    ops = ModelOperations(builder.build(scan_store(tiny.root)), 0, 0, tiny.root)
    old = ops.tree
    new = builder.build(scan_store(tiny.root))
    fresh = new.root.children[".by-name"]
    stale = DirNode(fresh.inode, 0, {}, path=(".by-name",))  # made by the old tree's worker
    asked, go = threading.Event(), threading.Event()

    def current() -> bool:
        assert old._build is not None
        answer = old._build.current  # True: the old tree is still served
        asked.set()
        go.wait(5)  # the GIL lets the request loop swap now
        return answer

    worker = threading.Thread(target=ops.place, args=(stale, current))
    worker.start()
    assert asked.wait(5)
    swapper = threading.Thread(target=ops.swap, args=(new,))
    swapper.start()
    time.sleep(0.2)
    go.set()
    worker.join(5)
    swapper.join(5)
    assert ops.tree is new
    assert ops.nodes[fresh.inode] is fresh


def test_getattr_works_out_a_pending_link_count_in_a_worker_thread(tmp_path: Path) -> None:
    """Working out a directory's link count may read a GGUF's header (whether it gets a
    `llama.cpp/` view) or lay out other tools' layouts (~0.2 s for 5,000 models): never in the
    request loop, for a getattr (the kernel asks one of a directory it has not listed since a
    rebuild) as for a lookup."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"a")
    ops = ModelOperations(TreeBuilder(InodeTable()).build(scan_store(tiny.root)), 0, 0, tiny.root)
    holder = ops.tree.root.children["a"]
    assert isinstance(holder, DirNode)
    model = holder.children["1"]
    assert isinstance(model, DirNode) and model.nlink_pending
    count = model._count_subdirs
    assert count is not None
    threads: list[threading.Thread] = []

    def counting() -> int:
        threads.append(threading.current_thread())
        return count()

    model._count_subdirs = counting
    attrs = trio.run(ops.getattr, model.inode)
    assert threads and threads[0] is not threading.main_thread()
    assert attrs.st_nlink == model.nlink


def one_tensor(name: str) -> bytes:
    text = json.dumps({name: {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"abc"


@pytest.mark.parametrize("tensors", [1, 2])
def test_small_tensor_headers_are_read_in_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensors: int
) -> None:
    """A model directory's `model.safetensors` needs its tensor blobs' headers (up to 4 MB
    read and merged at once): read in a worker thread before it is filled, not in the request
    loop, for one tensor blob as for several."""
    tiny, n = TinyStore(tmp_path / "models"), tensors
    layers = [tiny.layer("tensor", one_tensor(f"w{i}.weight"), name=f"w{i}") for i in range(n)]
    tiny.legacy("st:1", tiny.manifest(layers, {"model_format": "safetensors"}))
    ops = ModelOperations(TreeBuilder(InodeTable()).build(scan_store(tiny.root)), 0, 0, tiny.root)
    threads: list[threading.Thread] = []
    real = fsd_builder.read_safetensors_header_path

    def reading(path: str) -> object:
        threads.append(threading.current_thread())
        return real(path)

    monkeypatch.setattr(fsd_builder, "read_safetensors_header_path", reading)
    holder = ops.tree.root.children["st"]
    assert isinstance(holder, DirNode)
    model = holder.children["1"]
    fh = trio.run(ops.opendir, model.inode, None)
    assert "model.safetensors" in dict(ops._dir_handles[fh][1])
    assert len(threads) == tensors
    assert not any(t is threading.main_thread() for t in threads)


def test_a_rebuild_forgets_gone_blobs_while_workers_add_views(tmp_path: Path) -> None:
    """A rebuild drops the views of blobs the store no longer has from the mount's caches,
    which worker threads of the served tree fill meanwhile (a tensor blob's names, a merged
    header): one added between two of its steps must not fail the rebuild."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1", payload=b"a")
    builder = TreeBuilder(InodeTable())
    index = scan_store(tiny.root)
    builder.build(index)
    builder.tensor_names[Digest.of_bytes(b"gone")] = None
    real = index.has_blob

    def worker_adds_meanwhile(digest: Digest) -> bool:
        builder.tensor_names.setdefault(Digest.of_bytes(b"added by a worker"), None)
        return real(digest)

    index.has_blob = worker_adds_meanwhile  # type: ignore[method-assign]
    builder._drop_gone(index)
    assert Digest.of_bytes(b"gone") not in builder.tensor_names
