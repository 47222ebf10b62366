"""llama.cpp itself (llama-cpp-python) loading a GGUF through the mount, by a plain path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelfs.demo import VOCAB_ONLY_MODEL, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.names import parse_name
from tests.mounting import fuse, mounted

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python not installed (scripts/setup installs it)"
)

pytestmark = [fuse, pytest.mark.slow]


def test_llama_cpp_loads_a_mounted_gguf(tmp_path: Path) -> None:
    root = tmp_path / "models"
    build_demo_store(root)
    name = parse_name(VOCAB_ONLY_MODEL)
    mnt = tmp_path / "mnt"
    with mounted(root, mnt):
        path = mnt / name.model / name.tag / "model.gguf"
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        text = b"hello world"
        tokens = llm.tokenize(text, add_bos=False)
        assert tokens and all(isinstance(t, int) for t in tokens)
        assert llm.detokenize(tokens) == text
        assert llm.n_vocab() > 100
        # llama.cpp reads the same vocabulary from the mounted path as from the blob itself.
        digest = Digest.parse(os.getxattr(path, "user.modelfs.digest").decode())
        native = llama_cpp.Llama(
            model_path=str(Layout(root).blob(digest)), vocab_only=True, verbose=False
        )
        assert native.tokenize(text, add_bos=False) == tokens
        assert native.n_vocab() == llm.n_vocab()


def test_llama_cpp_loads_a_gguf_by_its_lmstudio_path(tmp_path: Path) -> None:
    """What LM Studio pointed at `MOUNT/.lmstudio/` loads: the same tokens as from the model
    directory's `model.gguf`."""
    root = tmp_path / "models"
    build_demo_store(root)
    name = parse_name(VOCAB_ONLY_MODEL)
    mnt = tmp_path / "mnt"
    with mounted(root, mnt):
        model = mnt / name.model / name.tag / "model.gguf"
        digest = os.getxattr(model, "user.modelfs.digest")
        [path] = [
            p
            for p in (mnt / ".lmstudio").rglob("*.gguf")
            if os.getxattr(p, "user.modelfs.digest") == digest
        ]
        assert path.relative_to(mnt / ".lmstudio").parts[0] == "ollama"
        text = b"hello world"
        lms = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        direct = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
        assert lms.tokenize(text, add_bos=False) == direct.tokenize(text, add_bos=False)
        assert lms.n_vocab() == direct.n_vocab() > 100
