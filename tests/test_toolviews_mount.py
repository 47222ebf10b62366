"""The mount's `.lmstudio/` and `.huggingface/hub/`: the layouts of store.toolviews, live,
read-only, each file the same node (inode, xattrs, lease, passthrough) as `model.gguf`."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from modelfs.store.digest import Digest
from modelfs.store.leases import read_leases
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.mounting import fuse, mounted
from tests.test_mount import wait_until
from tests.test_toolviews import HF, _safetensors_model, _store
from tests.toolcheck import check_lmstudio_folder, hf_resolve

pytestmark = fuse

SMOL = "bartowski/SmolLM2-135M-Instruct-GGUF"


def test_huggingface_hub_resolves_the_mounted_cache_offline(tmp_path: Path) -> None:
    store = _store(tmp_path)
    mnt = tmp_path / "mnt"
    with mounted(store.root, mnt):
        cache = mnt / ".huggingface" / "hub"
        got = hf_resolve(cache, SMOL, ["SmolLM2-135M-Instruct-Q4_K_M.gguf"], "Q4_K_M")
        path = Path(got["files"]["SmolLM2-135M-Instruct-Q4_K_M.gguf"])
        assert path.read_bytes() == b"smol q4 weights"
        digest = scan_store(store.root).lookup(f"{HF}:Q4_K_M").digest
        assert Path(got["snapshot"]).name == digest.hex[:40]
        # With no revision: refs/main, which names one of the tags' snapshots.
        main = (cache / f"models--{SMOL.replace('/', '--')}" / "refs" / "main").read_text()
        got = hf_resolve(cache, SMOL, [])
        assert Path(got["snapshot"]).name == main

        # A safetensors model, as transformers-style loaders read it.
        names = ["config.json", "tokenizer.json", "model.safetensors.index.json"]
        snap = Path(hf_resolve(cache, "ollama/qwen3", names)["snapshot"])
        index = json.loads((snap / "model.safetensors.index.json").read_text())
        want = _safetensors_model(TinyStore(tmp_path / "scratch"), "x:y")
        for tensor, shard in index["weight_map"].items():
            with safe_open(str(snap / shard), framework="numpy") as f:
                assert np.array_equal(f.get_tensor(tensor), want[tensor])
        assert set(index["weight_map"]) == set(want)

        # Read-only.
        with pytest.raises(OSError) as exc:
            open(path, "r+b")  # noqa: SIM115
        assert exc.value.errno == errno.EROFS


def test_lmstudio_view_is_the_model_gguf_node(tmp_path: Path) -> None:
    store = _store(tmp_path)
    mnt = tmp_path / "mnt"
    with mounted(store.root, mnt):
        lms = mnt / ".lmstudio"
        folders = check_lmstudio_folder(lms)
        assert folders["ollama/gemma3"] == ["gemma3-4b-Q4_K_M.gguf", "mmproj-gemma3.gguf"]
        for view, model in (
            (lms / "ollama/gemma3/gemma3-4b-Q4_K_M.gguf", mnt / "gemma3/4b/model.gguf"),
            (lms / "ollama/gemma3/mmproj-gemma3.gguf", mnt / "gemma3/4b/mmproj.gguf"),
        ):
            a, b = os.stat(view), os.stat(model)
            assert (a.st_ino, a.st_size, a.st_nlink) == (b.st_ino, b.st_size, b.st_nlink)
            assert os.listxattr(view) == os.listxattr(model)
            assert os.getxattr(view, "user.modelfs.digest") == os.getxattr(
                model, "user.modelfs.digest"
            )
        view = lms / "ollama/gemma3/gemma3-4b-Q4_K_M.gguf"
        digest = Digest.parse(os.getxattr(view, "user.modelfs.digest").decode())

        def held() -> frozenset[Digest]:
            [lease] = [x for x in read_leases(store.layout).live if x.purpose == "mount"]
            return lease.digests

        assert wait_until(lambda: digest not in held())
        with open(view, "rb") as f:
            assert digest in held()  # on disk before open() returned
            assert f.read() == b"gemma weights"
        assert wait_until(lambda: digest not in held())


def test_a_pull_or_rm_shows_in_both_views_within_2s(tmp_path: Path) -> None:
    store = _store(tmp_path)
    mnt = tmp_path / "mnt"
    with mounted(store.root, mnt):
        lms = mnt / ".lmstudio" / "ollama" / "llama3.2" / "llama3.2-3b-Q4_K_M.gguf"
        hub = mnt / ".huggingface" / "hub" / "models--bartowski--SmolLM2-135M-Instruct-GGUF"
        assert not lms.exists()
        store.gguf_model("llama3.2:3b", b"llama weights", file_type="Q4_K_M")
        assert wait_until(lambda: lms.read_bytes() == b"llama weights", timeout=2.0)
        store.layout.legacy_manifest(parse_name(f"{HF}:Q8_0")).unlink()
        assert wait_until(lambda: not (hub / "refs" / "Q8_0").exists(), timeout=2.0)
        assert (hub / "refs" / "Q4_K_M").read_text() == (hub / "refs" / "main").read_text()
        store.layout.legacy_manifest(parse_name("llama3.2:3b")).unlink()
        assert wait_until(lambda: not lms.parent.exists(), timeout=2.0)
