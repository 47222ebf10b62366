"""llama.cpp itself (llama-cpp-python) loading a GGUF through the mount, by a plain path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, VOCAB_ONLY_MODEL, build_demo_store
from modelfs.fsd.builder import short_path
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


# Run in a child process: a GGUF llama.cpp cannot run may crash it (SIGSEGV in llama_decode),
# which must fail the test, not end pytest. Each line of stdout: path, then 8 token ids.
#
# Weights are not repacked into llama.cpp's "extra" CPU buffer types: on a CPU with AMX
# (Sapphire Rapids and later), the AMX matmul of the llama.cpp that llama-cpp-python 0.3.36
# bundles (ggml_backend_amx_mul_mat) crashes with SIGSEGV on the first decode of every demo
# GGUF (K-quants), blob or mount alike; without the repack the same weights decode. The bytes
# under test are the same either way.
_GENERATE = """
import json, sys, llama_cpp
import llama_cpp.llama
_defaults = llama_cpp.llama_model_default_params
def _no_repack():
    params = _defaults()
    params.use_extra_bufts = False
    return params
llama_cpp.llama.llama_cpp.llama_model_default_params = _no_repack
for path in sys.argv[1:]:
    print("decoding", path, file=sys.stderr, flush=True)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, seed=0, verbose=False)
    prompt = llm.tokenize(b"hello world", add_bos=True)
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(token))
        if len(out) == 8:
            break
    print(json.dumps([path, llm.n_vocab(), out]), flush=True)
"""


def generate(paths: list[Path]) -> dict[Path, list[int]]:
    """8 token ids llama.cpp generates greedily (temperature 0) from each GGUF after the
    prompt `hello world`."""
    done = subprocess.run(
        [sys.executable, "-c", _GENERATE, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = {}
    for line in done.stdout.splitlines():
        path, n_vocab, tokens = json.loads(line)
        assert len(tokens) == 8 and all(0 <= t < n_vocab for t in tokens), (path, tokens)
        out[Path(path)] = tokens
    assert list(out) == paths
    return out


def test_llama_cpp_generates_the_same_tokens_from_the_mount_and_the_blob(tmp_path: Path) -> None:
    """Every GGUF model of the demo store (each model.gguf, and gemma4's draft.gguf) holds
    weights llama.cpp runs: 8 tokens generated greedily from `MOUNT/<model>/<tag>/model.gguf`
    are the tokens generated from the blob itself."""
    root = tmp_path / "models"
    demo = build_demo_store(root)
    mnt = tmp_path / "mnt"
    wanted: list[tuple[str, str]] = [(GEMMA, "model.gguf"), (GEMMA, "draft.gguf")]
    wanted += [(n, "model.gguf") for n in demo.names if n != GEMMA]
    with mounted(root, mnt):
        mounted_paths = [mnt.joinpath(*short_path(parse_name(n)), f) for n, f in wanted]
        blob_paths = [
            Layout(root).blob(Digest.parse(os.getxattr(p, "user.modelfs.digest").decode()))
            for p in mounted_paths
        ]
        through_mount = generate(mounted_paths)
    from_blob = generate(blob_paths)
    for (name, file), m, b in zip(wanted, mounted_paths, blob_paths, strict=True):
        assert through_mount[m] == from_blob[b], (name, file)
