"""llama.cpp views of separate projectors (LLaVA's, without clip.projector_type): a small
GGUF in the Ollama layout built here, its view read back with the reference reader
(`gguf.GGUFReader`), checked against what Ollama's upstream handler (ollama/ollama
llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from modelfs.store.compat import compat_views  # noqa: E402
from modelfs.store.compat.view import GGUFView  # noqa: E402
from tests.builders import TinyStore  # noqa: E402
from tests.compat_gguf import (  # noqa: E402
    HEX,
    V,
    check_aligned,
    check_renamed,
    f32,
    fields,
    llava_projector,
    materialize,
    tensors,
    tokenizer,
    write_gguf,
)
from tests.mounting import fuse, mounted  # noqa: E402


def test_llava_projector_without_type_gets_a_view(tmp_path: Path) -> None:
    from modelfs.store.compat import may_need_mmproj_view, mmproj_view

    src = llava_projector(tmp_path)
    assert compat_views(src, HEX) is None  # no text rule reads a clip file
    assert may_need_mmproj_view(src)
    view = mmproj_view(src, HEX)
    assert view is not None and view.handler == "handle_missing_llava_projector_type"
    reader = gguf.GGUFReader(materialize(view, tmp_path))
    check_aligned(reader)
    kv, source = fields(reader), gguf.GGUFReader(src)
    assert kv["clip.projector_type"] == "mlp"
    assert {k: v for k, v in kv.items() if k != "clip.projector_type"} == fields(source)
    got, want = tensors(reader), tensors(source)
    assert list(got) == list(want)
    check_renamed(got, want, {n: n for n in want})  # every tensor, byte for byte
    assert not view.computed
    # A projector that names its type, or has no vision encoder, is loaded as it is.
    typed = llava_projector(tmp_path, ("clip.projector_type", "mlp", V.STRING), name="typed")
    assert mmproj_view(typed, HEX) is None
    typed = llava_projector(tmp_path, ("clip.vision.projector_type", "ldp", V.STRING), name="v")
    assert mmproj_view(typed, HEX) is None
    assert mmproj_view(llava_projector(tmp_path, vision=False, name="blind"), HEX) is None
    # A text model used as a projector file has no projector view unless a clip rule reads it.
    plain = write_gguf(
        tmp_path / "plain.gguf", "llama", tokenizer(8), [("token_embd.weight", f32(8, 32))]
    )
    assert mmproj_view(plain, HEX) is None


def llava_store(tmp_path: Path) -> tuple[TinyStore, Path]:
    """llava:tiny, a plain llama text model (no view) with a LLaVA projector layer."""
    tiny = TinyStore(tmp_path / "models")
    text = write_gguf(
        tmp_path / "llava-text.gguf",
        "llama",
        [("llama.context_length", 4096, V.UINT32), *tokenizer(8)],
        [("token_embd.weight", f32(8, 32))],
    )
    projector = llava_projector(tmp_path)
    raw_manifest = tiny.manifest(
        [tiny.layer("model", text.read_bytes()), tiny.layer("projector", projector.read_bytes())],
        {"model_format": "gguf", "model_family": "llama", "file_type": "F32"},
    )
    tiny.legacy("llava:tiny", raw_manifest)
    return tiny, projector


def test_a_llava_model_gets_its_projector_view(tmp_path: Path) -> None:
    from modelfs.cli.show import render, show_record
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import CompatNode, DirNode, InodeTable
    from modelfs.store.scan import scan_store

    tiny, projector = llava_store(tmp_path)
    index = scan_store(tiny.root)
    tree = TreeBuilder(InodeTable()).build(index)
    short = tree.root.children["llava"].children["tiny"]
    assert isinstance(short, DirNode)
    assert "mmproj.gguf" in short.children  # the raw layer stays
    holder = short.children["llama.cpp"]
    assert isinstance(holder, DirNode) and sorted(holder.children) == ["mmproj.gguf"]
    node = holder.children["mmproj.gguf"]
    assert isinstance(node, CompatNode) and node.view is not None
    assert node.view.handler == "handle_missing_llava_projector_type"
    assert node.size == mmproj_view_of(projector).size
    assert node.xattrs["user.modelfs.compat.source"] == str(node.digest).encode()
    assert node.digest == short.children["mmproj.gguf"].digest  # type: ignore[attr-defined]
    # The lazy .by-name/ directory counts llama.cpp/ before it is filled.
    lazy = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "llava", "tiny"):
        lazy = lazy.children[part]
    assert isinstance(lazy, DirNode) and not lazy.loaded
    before = lazy.nlink
    assert sorted(lazy.children) == sorted(short.children)
    assert lazy.nlink == before == short.nlink
    # `modelfs show` names the files to pass.
    record = show_record(index, next(iter(index)))
    lc = record["variants"][0]["llama_cpp"]
    assert lc["model"] == "model.gguf" and lc["mmproj"] == "llama.cpp/mmproj.gguf"
    assert lc["view"] is None
    assert lc["mmproj_view"]["rules"] == "handle_missing_llava_projector_type"
    text = render(record)
    assert "llama.cpp: --model model.gguf --mmproj llama.cpp/mmproj.gguf" in text
    assert "mmproj view by handle_missing_llava_projector_type" in text


def mmproj_view_of(path: Path) -> GGUFView:
    from modelfs.store.compat import mmproj_view

    view = mmproj_view(path, HEX)
    assert view is not None
    return view


@fuse
def test_mount_shows_a_llava_projector_view(tmp_path: Path) -> None:
    tiny, projector = llava_store(tmp_path)
    want = materialize(mmproj_view_of(projector), tmp_path).read_bytes()
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "llava" / "tiny"
        assert os.listdir(d / "llama.cpp") == ["mmproj.gguf"]
        assert (d / "mmproj.gguf").read_bytes() == projector.read_bytes()  # raw stays raw
        assert (d / "llama.cpp" / "mmproj.gguf").read_bytes() == want
        digest = os.getxattr(d / "llama.cpp" / "mmproj.gguf", "user.modelfs.compat.source")
        assert digest == os.getxattr(d / "mmproj.gguf", "user.modelfs.digest")
        lazy = mnt / ".by-name" / "registry.ollama.ai" / "library" / "llava" / "tiny"
        before = os.stat(lazy).st_nlink
        assert "llama.cpp" in os.listdir(lazy)
        assert os.stat(lazy).st_nlink == before == os.stat(d).st_nlink
        assert (d / ".ollama" / "status").read_text() == "ok\n"
