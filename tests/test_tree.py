"""The name tree without a mount: paths, stable inodes, collisions."""

from __future__ import annotations

from pathlib import Path

from fsd.mount import changed_entries
from fsd.tree import BlobNode, DirNode, InodeTable, Node, TreeBuilder, short_path
from store.layout import Layout
from store.names import parse_name
from store.scan import scan_store
from store.watch import store_signature
from tests.builders import TinyStore


def walk(node: Node, path: str = "") -> dict[str, Node]:
    out = {path or "/": node}
    if isinstance(node, DirNode):
        for name, child in node.children.items():
            out.update(walk(child, f"{path}/{name}"))
    return out


def test_short_paths() -> None:
    assert short_path(parse_name("gemma4:26b")) == ("gemma4", "26b")
    assert short_path(parse_name("ollama.com/library/gemma4:26b")) == ("gemma4", "26b")
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
    from store.digest import Digest

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
