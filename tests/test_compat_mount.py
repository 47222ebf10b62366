"""llama.cpp views through a real mount, in `show`, and loaded by llama.cpp itself: a small
GGUF in the Ollama layout built here, its view read back with the reference reader
(`gguf.GGUFReader`), checked against what Ollama's upstream handler (ollama/ollama
llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from modelfs.demo.vocab import GEMMA_SPECIALS, spm_vocab  # noqa: E402
from modelfs.store.compat.compute import ComputeCache  # noqa: E402
from tests.builders import TinyStore  # noqa: E402
from tests.compat_gguf import (  # noqa: E402
    KV,
    Tensor,
    V,
    bpe_tokenizer,
    f16,
    f32,
    gemma3_runnable,
    llama_cpp_loads_only_the_view,
    materialize,
    tokenizer,
    views_of,
    write_gguf,
)
from tests.mounting import fuse, mounted  # noqa: E402


def compat_store(tmp_path: Path) -> tuple[TinyStore, Path]:
    tiny = TinyStore(tmp_path / "models")
    src = gemma3_runnable(tmp_path)
    raw_manifest = tiny.manifest(
        [tiny.layer("model", src.read_bytes()), tiny.layer("license", b"Gemma")],
        {"model_format": "gguf", "model_family": "gemma3", "file_type": "F32"},
    )
    tiny.legacy("gemma3:tiny", raw_manifest)
    plain = write_gguf(
        tmp_path / "plain.gguf",
        "llama",
        [("llama.context_length", 4096, V.UINT32), *tokenizer(8)],
        [("token_embd.weight", f32(8, 32))],
    )
    tiny.legacy("plain:tiny", tiny.manifest([tiny.layer("model", plain.read_bytes())]))
    return tiny, src


def test_show_names_the_llama_cpp_files(tmp_path: Path) -> None:
    from modelfs.cli.show import render, show_record
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    index = scan_store(tiny.layout)
    records = {e.name.model: show_record(index, e) for e in index}
    lc = records["gemma3"]["variants"][0]["llama_cpp"]
    assert lc["model"] == "llama.cpp/model.gguf" and lc["mmproj"] == "llama.cpp/mmproj.gguf"
    assert lc["view"]["rules"] == "handle_gemma3" and lc["view"]["hidden"] == 3
    text = render(records["gemma3"])
    assert "llama.cpp: --model llama.cpp/model.gguf --mmproj llama.cpp/mmproj.gguf" in text
    plain = records["plain"]["variants"][0]["llama_cpp"]
    assert plain == {"model": "model.gguf", "mmproj": None, "view": None, "mmproj_view": None}


@fuse
def test_mount_shows_llama_cpp_views(tmp_path: Path) -> None:
    tiny, src = compat_store(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None
    want_model = materialize(views.model, tmp_path, ComputeCache(None)).read_bytes()
    want_mmproj = materialize(views.mmproj, tmp_path, ComputeCache(None)).read_bytes()
    child = tiny.manifest([tiny.layer("model", src.read_bytes())])
    tiny.v2("gemma3:listed", tiny.manifest_list([(child, "llamacpp", "gguf")]))
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "gemma3" / "tiny"
        assert sorted(os.listdir(d / "llama.cpp")) == ["mmproj.gguf", "model.gguf"]
        assert (d / "model.gguf").read_bytes() == src.read_bytes()  # raw stays raw
        assert (d / "llama.cpp" / "model.gguf").stat().st_size == len(want_model)
        assert (d / "llama.cpp" / "model.gguf").read_bytes() == want_model
        assert (d / "llama.cpp" / "mmproj.gguf").read_bytes() == want_mmproj
        digest = os.getxattr(d / "llama.cpp" / "model.gguf", "user.modelfs.compat.source")
        assert digest == os.getxattr(d / "model.gguf", "user.modelfs.digest")
        # The computed tensors of the projector view were cached by the mount.
        cached = list((tiny.root / ".modelfs" / "compat").rglob("*f16_to_f32*"))
        assert len(cached) == 2
        assert not (mnt / "plain" / "tiny" / "llama.cpp").exists()
        assert not (mnt / "gemma3" / "listed@llamacpp" / "llama.cpp").exists()
        assert (mnt / "gemma3" / "listed@llamacpp" / "model.gguf").is_file()
        assert "model.gguf" in os.listdir(mnt / "plain" / "tiny")


@fuse
@pytest.mark.slow
def test_llama_cpp_loads_the_view_it_refuses_raw(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    tiny, _ = compat_store(tmp_path)
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / "gemma3" / "tiny"
        # Raw, llama.cpp stops at the missing gemma3.attention.layer_norm_rms_epsilon.
        with pytest.raises(ValueError):
            llama_cpp.Llama(model_path=str(d / "model.gguf"), n_ctx=64, verbose=False)
        # The view loads in full (every tensor, no vision ones left over) and runs.
        llm = llama_cpp.Llama(
            model_path=str(d / "llama.cpp" / "model.gguf"), n_ctx=64, verbose=False
        )
        assert llm.n_vocab() == len(spm_vocab(GEMMA_SPECIALS).tokens)  # image tokens cut
        tokens = llm.tokenize(b"hello world", add_bos=False)
        assert llm.detokenize(tokens).lstrip() == b"hello world"  # SPM: a leading space
        out = llm("hello", max_tokens=3, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1


def test_llamacpp_children_and_non_gguf_blobs_get_no_view(tmp_path: Path) -> None:
    """A manifest-list child made for llama.cpp is in its layout by definition (upstream runs
    those with its compat layer off); a blob that is no GGUF is never parsed as one."""
    from modelfs.cli.show import show_record
    from modelfs.store.compat import may_need_view
    from modelfs.store.scan import scan_store

    tiny, src = compat_store(tmp_path)
    child = tiny.manifest([tiny.layer("model", src.read_bytes())])
    tiny.v2("gemma3:listed", tiny.manifest_list([(child, "llamacpp", "gguf")]))
    index = scan_store(tiny.layout)
    entry = next(e for e in index if e.name.tag == "listed")
    lc = show_record(index, entry)["variants"][0]["llama_cpp"]
    assert lc == {"model": "model.gguf", "mmproj": None, "view": None, "mmproj_view": None}
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a gguf at all, but long enough to look")
    assert not may_need_view(junk)
    assert may_need_view(src)


@pytest.mark.slow
def test_llama_cpp_reads_the_gptoss_view_it_refuses_raw(tmp_path: Path) -> None:
    """llama.cpp knows no architecture "gptoss"; the view's gpt-oss hyperparameters and
    vocabulary load (vocab-only: its MXFP4 experts are not built here)."""
    from modelfs.demo.vocab import bpe_vocab

    vocab = bpe_vocab(("<|startoftext|>", "<|endoftext|>", "<|return|>"))
    hparams = {
        "context_length": 4096,
        "embedding_length": 64,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "expert_count": 4,
        "expert_used_count": 2,
        "attention.sliding_window": 128,
    }
    kvs: list[KV] = [(f"gptoss.{k}", v, V.UINT32) for k, v in hparams.items()]
    kvs += [
        ("gptoss.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("gptoss.rope.freq_base", 150000.0, V.FLOAT32),
        *bpe_tokenizer(
            vocab,
            "default",
            bos=vocab.specials["<|startoftext|>"],
            eos=vocab.specials["<|return|>"],
        ),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", f32(len(vocab.tokens), 64)),
        ("blk.0.ffn_gate_exps.weight", f32(4, 96, 64)),
        ("blk.0.attn_sinks", f32(2)),
    ]
    src = write_gguf(tmp_path / "gptoss.gguf", "gptoss", kvs, ts)
    llm = llama_cpp_loads_only_the_view(src, tmp_path)
    assert llm.n_vocab() == len(vocab.tokens)
    tokens = llm.tokenize(b" hello world", add_bos=False)
    assert len(tokens) == 2  # the merged words, with their leading spaces
    assert llm.detokenize(tokens) == b" hello world"


@pytest.mark.slow
def test_llama_cpp_reads_the_qwen25vl_view_it_refuses_raw(tmp_path: Path) -> None:
    """llama.cpp knows no architecture "qwen25vl"; the view's qwen2vl hyperparameters (M-RoPE
    sections padded to four) and vocabulary load (vocab-only)."""
    from modelfs.demo.vocab import bpe_vocab

    vocab = bpe_vocab(("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    hparams = {
        "context_length": 4096,
        "embedding_length": 64,
        "block_count": 1,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
    }
    kvs: list[KV] = [(f"qwen25vl.{k}", v, V.UINT32) for k, v in hparams.items()]
    kvs += [
        ("qwen25vl.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
        ("qwen25vl.rope.freq_base", 1e6, V.FLOAT32),
        ("qwen25vl.rope.mrope_section", [4, 6, 6], V.ARRAY, V.INT32),
        *bpe_tokenizer(vocab, "qwen2", eos=vocab.specials["<|im_end|>"]),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", f32(len(vocab.tokens), 64)),
        ("v.blk.0.attn_q.weight", f16(32, 32)),
        ("v.merger.mlp.0.weight", f16(64, 32)),
    ]
    src = write_gguf(tmp_path / "qwen25vl.gguf", "qwen25vl", kvs, ts)
    llm = llama_cpp_loads_only_the_view(src, tmp_path)
    assert llm.n_vocab() == len(vocab.tokens)
    assert llm.token_eos() == vocab.specials["<|im_end|>"]
    tokens = llm.tokenize(b" hello world", add_bos=False)
    assert llm.detokenize(tokens) == b" hello world"


def test_a_lazy_model_dir_counts_its_llama_cpp_dir_before_it_is_filled(tmp_path: Path) -> None:
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import DirNode, InodeTable
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    short = tree.root.children["gemma3"].children["tiny"]
    assert isinstance(short, DirNode) and "llama.cpp" in short.children
    lazy = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "gemma3", "tiny"):
        lazy = lazy.children[part]
    assert isinstance(lazy, DirNode) and not lazy.loaded
    before = lazy.nlink
    assert sorted(lazy.children) == sorted(short.children)
    assert lazy.nlink == before == short.nlink
    plain = tree.root.children[".by-name"]
    for part in ("registry.ollama.ai", "library", "plain", "tiny"):
        plain = plain.children[part]
    before = plain.nlink
    assert "llama.cpp" not in plain.children and plain.nlink == before


def test_a_later_mount_reads_no_header_until_llama_cpp_is_looked_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import modelfs.fsd.compat_dirs as fsd_compat_dirs
    from modelfs.fsd.builder import TreeBuilder
    from modelfs.fsd.nodes import CompatNode, DirNode, InodeTable
    from modelfs.store.compat.decisions import Decisions
    from modelfs.store.names import parse_name
    from modelfs.store.scan import scan_store

    tiny, _ = compat_store(tmp_path)
    first = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    first_dir = first.root.children["gemma3"].children["tiny"].children["llama.cpp"]
    first_view = first_dir.children["model.gguf"]
    assert isinstance(first_view, CompatNode)
    # A blob is decided when a directory holding it is first looked into (or listed).
    assert "llama.cpp" not in first.root.children["plain"].children["tiny"].children
    first.save_decisions()  # as the mount does when it ends (or at its next build)
    decided = json.loads((tiny.layout.state / "compat-decisions.json").read_bytes())
    assert sorted(decided["decisions"].values()) == ["model+mmproj", "none"]  # gemma3, plain

    # The next mount: nothing reads a GGUF header while building, link counts included.
    made: list[Path] = []
    real_views, real_peek = fsd_compat_dirs.compat_views, fsd_compat_dirs.may_need_view

    def watched(path: Path, source_hex: str) -> object:
        made.append(path)
        return real_views(path, source_hex)

    def no_peek(path: Path) -> bool:
        raise AssertionError(f"peeked at {path}")

    monkeypatch.setattr(fsd_compat_dirs, "compat_views", watched)
    monkeypatch.setattr(fsd_compat_dirs, "may_need_view", no_peek)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    short = tree.root.children["gemma3"].children["tiny"]
    assert isinstance(short, DirNode) and short.nlink == 4  # .., .ollama/, llama.cpp/
    assert "llama.cpp" in short.children and "llama.cpp" not in (
        tree.root.children["plain"].children["tiny"].children
    )
    holder = short.children["llama.cpp"]
    assert isinstance(holder, DirNode) and not holder.loaded and made == []
    monkeypatch.setattr(fsd_compat_dirs, "may_need_view", real_peek)
    # Made ahead of first use (the mount does this in a thread once it is ready) ...
    assert tree.make_views() == 1 and len(made) == 1
    assert tree.make_views() == 0
    view = holder.children["model.gguf"]  # ... so the first use only places the nodes
    assert len(made) == 1 and isinstance(view, CompatNode)
    assert view.size == first_view.size and view.inode != 0
    fd = os.open(view.path, os.O_RDONLY)
    try:
        assert view.read(fd, 0, view.size) == first_view.read(fd, 0, first_view.size)
    finally:
        os.close(fd)

    # A damaged file is decided again, and rewritten with only the blobs still met.
    monkeypatch.undo()
    path = tiny.layout.state / "compat-decisions.json"
    good = path.read_bytes()
    assert Decisions(tiny.layout).get("model", view.digest) == "model+mmproj"
    path.write_bytes(good.replace(b'"rules": "', b'"rules": "other modelfs '))
    assert Decisions(tiny.layout).get("model", view.digest) is None  # other rules decided
    path.write_bytes(b"{broken")
    assert Decisions(tiny.layout).get("model", view.digest) is None
    tiny.layout.legacy_manifest(parse_name("plain:tiny")).unlink()
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    assert "llama.cpp" in tree.root.children["gemma3"].children["tiny"].children
    tree.save_decisions()
    assert json.loads(path.read_bytes())["decisions"] == {
        f"model:{view.digest.hex}": "model+mmproj"
    }
