"""LM Studio and Hugging Face hub layouts of the store (store.toolviews) and `modelfs link`,
which writes them as symlinks; huggingface_hub itself resolves models from what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from modelfs.store.digest import Digest
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.store.tools.toolviews import (
    blob_tensor_names,
    hf_revision,
    layout_files,
    tool_models,
)
from tests.builders import TinyStore
from tests.mounting import MODELFS
from tests.toolcheck import check_lmstudio_folder, hf_resolve

HF = "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF"


def _vision(store: TinyStore, name: str, weights: bytes, projector: bytes) -> None:
    store.legacy(
        name,
        store.manifest(
            [store.layer("model", weights), store.layer("projector", projector)],
            {"model_format": "gguf", "file_type": "Q4_K_M"},
        ),
    )


def _safetensors_model(store: TinyStore, name: str) -> dict[str, np.ndarray]:
    """A safetensors model as Ollama's x/create stores it: a tensor layer per tensor, JSON
    layers named by their file names."""
    tensors = {
        "model.embed_tokens.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.norm.weight": np.ones(4, dtype=np.float16),
    }
    layers = [store.layer("tensor", save({k: v}), name=k) for k, v in tensors.items()]
    layers += [
        store.layer("json", b'{"model_type": "llama"}', name="config.json"),
        store.layer("json", b'{"version": "1.0"}', name="tokenizer.json"),
    ]
    store.legacy(name, store.manifest(layers, {"model_format": "safetensors"}))
    return tensors


def _store(tmp_path: Path) -> TinyStore:
    store = TinyStore(tmp_path / "models")
    store.gguf_model(f"{HF}:Q4_K_M", b"smol q4 weights", file_type="Q4_K_M")
    store.gguf_model(f"{HF}:Q8_0", b"smol q8 weights", file_type="Q8_0")
    _vision(store, "gemma3:4b", b"gemma weights", b"gemma projector")
    store.gguf_model("someuser/tiny:q8", b"tiny", file_type="Q8_0")
    _safetensors_model(store, "qwen3:0.6b-st")
    return store


def _files(store: TinyStore, layout: str) -> dict[str, str]:
    index = scan_store(store.root)
    out = {}
    for f in layout_files(layout, tool_models(index), blob_tensor_names(index)):
        out[f.path] = f.source.layer.digest.hex if f.source else f.data.decode()
    return out


def test_lmstudio_layout_follows_lm_studios_folder_rules(tmp_path: Path) -> None:
    store = _store(tmp_path)
    files = _files(store, "lmstudio")
    assert sorted(files) == [
        "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf",
        "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf",
        "ollama/gemma3/gemma3-4b-Q4_K_M.gguf",
        "ollama/gemma3/mmproj-gemma3.gguf",
        "someuser/tiny/tiny-q8-Q8_0.gguf",
    ]
    dest = tmp_path / "lms"
    subprocess.run(
        [MODELFS, "link", "--store", str(store.root), "--layout", "lmstudio", str(dest)],
        check=True,
        timeout=60,
    )
    folders = check_lmstudio_folder(dest)
    assert folders["ollama/gemma3"] == ["gemma3-4b-Q4_K_M.gguf", "mmproj-gemma3.gguf"]
    assert (dest / "ollama/gemma3/mmproj-gemma3.gguf").read_bytes() == b"gemma projector"


def test_lmstudio_collisions_get_suffixes(tmp_path: Path) -> None:
    """A library model and an hf.co repo of the same names share no folder; two tags of one
    model with different projectors get folders of their own, as LM Studio pairs every
    projector of a folder with its models. Suffixes go in the order of full names
    (`hf.co/…` before `registry.ollama.ai/…`)."""
    store = TinyStore(tmp_path / "models")
    store.gguf_model("gemma3:1b", b"library gemma")
    store.gguf_model("hf.co/ollama/gemma3:latest", b"hf gemma")
    _vision(store, "llava:7b", b"llava 7b", b"projector a")
    _vision(store, "llava:13b", b"llava 13b", b"projector b")
    _vision(store, "llava:7b-again", b"llava 7b", b"projector a")
    files = _files(store, "lmstudio")
    assert sorted(files) == [
        "ollama/gemma3-2/gemma3-1b-Q4_K_M.gguf",
        "ollama/gemma3/gemma3-Q4_K_M.gguf",
        "ollama/llava-7b/llava-7b-Q4_K_M.gguf",
        "ollama/llava-7b/mmproj-llava.gguf",
        "ollama/llava/llava-13b-Q4_K_M.gguf",
        "ollama/llava/mmproj-llava.gguf",
    ]
    # `llava:7b-again` is `llava:7b`'s blob: shown once.
    assert files["ollama/llava-7b/llava-7b-Q4_K_M.gguf"] == Digest.of_bytes(b"llava 7b").hex


def test_hf_layout_revisions_follow_the_manifest(tmp_path: Path) -> None:
    store = _store(tmp_path)
    index = scan_store(store.root)
    q4 = index.lookup(f"{HF}:Q4_K_M")
    files = _files(store, "hf")
    repo = "models--bartowski--SmolLM2-135M-Instruct-GGUF"
    assert files[f"{repo}/refs/Q4_K_M"] == hf_revision(q4.digest) == q4.digest.hex[:40]
    assert files[f"{repo}/refs/main"] in {files[f"{repo}/refs/Q4_K_M"], files[f"{repo}/refs/Q8_0"]}
    assert not any(p.startswith("models--ollama--gemma3") for p in files)  # GGUF, not from hf.co
    st = f"models--ollama--qwen3/snapshots/{index.lookup('qwen3:0.6b-st').digest.hex[:40]}"
    assert {p for p in files if p.startswith(st)} == {
        f"{st}/{n}"
        for n in (
            "config.json",
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        )
    }
    # A re-pull that changes the manifest is a new revision; the old one is gone.
    store.gguf_model(f"{HF}:Q4_K_M", b"smol q4 weights, fixed", file_type="Q4_K_M")
    again = _files(store, "hf")
    assert again[f"{repo}/refs/Q4_K_M"] != files[f"{repo}/refs/Q4_K_M"]
    assert not any(files[f"{repo}/refs/Q4_K_M"] in p for p in again)


def _link(store: TinyStore, layout: str, dest: Path) -> str:
    proc = subprocess.run(
        [MODELFS, "link", "--store", str(store.root), "--layout", layout, str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_huggingface_hub_resolves_a_linked_cache_offline(tmp_path: Path) -> None:
    store = _store(tmp_path)
    cache = tmp_path / "hub"
    _link(store, "hf", cache)
    repo = "bartowski/SmolLM2-135M-Instruct-GGUF"
    got = hf_resolve(cache, repo, ["SmolLM2-135M-Instruct-Q8_0.gguf"], "Q8_0")
    assert Path(got["files"]["SmolLM2-135M-Instruct-Q8_0.gguf"]).read_bytes() == b"smol q8 weights"
    got = hf_resolve(cache, repo, ["SmolLM2-135M-Instruct-Q4_K_M.gguf"], "Q4_K_M")
    assert (
        Path(got["snapshot"]).name == scan_store(store.root).lookup(f"{HF}:Q4_K_M").digest.hex[:40]
    )

    # A safetensors model: the config, tokenizer and every tensor, as a loader reads them.
    names = ["config.json", "tokenizer.json", "model.safetensors.index.json"]
    got = hf_resolve(cache, "ollama/qwen3", names)
    snap = Path(got["snapshot"])
    assert json.loads((snap / "config.json").read_text()) == {"model_type": "llama"}
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    loaded = {}
    for tensor, shard in index["weight_map"].items():
        with safe_open(str(snap / shard), framework="numpy") as f:
            loaded[tensor] = f.get_tensor(tensor)
    want = _safetensors_model(TinyStore(tmp_path / "scratch"), "x:y")
    assert loaded.keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(loaded[k], v) and loaded[k].dtype == v.dtype


def test_link_twice_over_a_changing_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    dest = tmp_path / "lms"
    _link(store, "lmstudio", dest)
    before = {p.relative_to(dest).as_posix() for p in dest.rglob("*.gguf")}
    # The user's own files, and a model LM Studio itself downloaded, are not ours.
    (dest / "notes.txt").write_text("mine")
    own = dest / "lmstudio-community/Qwen3-GGUF/Qwen3-Q4_K_M.gguf"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"downloaded by LM Studio")
    # One tag goes, one comes, one changes weights.
    store.layout.legacy_manifest(parse_name("someuser/tiny:q8")).unlink()
    store.gguf_model("llama3.2:3b", b"llama weights", file_type="Q4_K_M")
    store.gguf_model(f"{HF}:Q8_0", b"smol q8 weights, fixed", file_type="Q8_0")
    log = _link(store, "lmstudio", dest)
    assert "1 added, 1 updated, 1 removed, 3 unchanged" in log
    after = {p.relative_to(dest).as_posix() for p in dest.rglob("*.gguf")}
    assert after == (before - {"someuser/tiny/tiny-q8-Q8_0.gguf"}) | {
        "ollama/llama3.2/llama3.2-3b-Q4_K_M.gguf",
        "lmstudio-community/Qwen3-GGUF/Qwen3-Q4_K_M.gguf",
    }
    assert not (dest / "someuser").exists()  # the folders it emptied
    assert (dest / "notes.txt").read_text() == "mine"
    assert own.read_bytes() == b"downloaded by LM Studio"
    q8 = dest / "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf"
    assert q8.read_bytes() == b"smol q8 weights, fixed"
    assert os.readlink(q8).startswith(str(store.layout.blobs.resolve()))
    (dest / "notes.txt").unlink()  # not a model file: the check below would refuse it
    check_lmstudio_folder(dest)
    assert "0 added, 0 updated, 0 removed, 5 unchanged" in _link(store, "lmstudio", dest)


def test_link_leaves_alone_a_path_it_did_not_write(tmp_path: Path) -> None:
    store = _store(tmp_path)
    cache = tmp_path / "hub"
    repo = cache / "models--bartowski--SmolLM2-135M-Instruct-GGUF"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text("0" * 40)  # a real download's branch
    log = _link(store, "hf", cache)
    assert "left alone" in log
    assert (repo / "refs/main").read_text() == "0" * 40
    proc = subprocess.run(
        [MODELFS, "link", "--store", str(store.root), "--layout", "lmstudio", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("modelfs: error: "), proc.stderr
    assert "'hf' layout" in errors[0] and "Traceback" not in proc.stderr


def test_hf_repos_are_what_huggingface_hub_names_them(tmp_path: Path) -> None:
    """Every repo folder is huggingface_hub's own `repo_folder_name` of an id its
    `validate_repo_id` accepts; a model name it would refuse is left out, not mangled."""
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    store = _store(tmp_path)
    store.gguf_model("hf.co/someone/odd--name:latest", b"odd")
    store.gguf_model("hf.co/someone/trailing.:latest", b"trailing dot")
    folders = {p.split("/")[0] for p in _files(store, "hf")}
    ids = {"bartowski/SmolLM2-135M-Instruct-GGUF", "ollama/qwen3"}
    for repo_id in ids:
        validate_repo_id(repo_id)
    assert folders == {repo_folder_name(repo_id=i, repo_type="model") for i in ids}


def test_link_into_a_file_or_fifo_is_one_line(tmp_path: Path) -> None:
    """A DIR that is a file or a FIFO is refused by name, before anything is written."""
    store = _store(tmp_path)
    plain = tmp_path / "plain"
    plain.write_text("x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (plain, fifo):
        r = subprocess.run(
            [MODELFS, "link", "--store", str(store.root), "--layout", "hf", str(target)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 1
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert errors == [f"modelfs: error: {target}: not a directory; give modelfs link a "
                          "directory of its own"], r.stderr  # fmt: skip
    assert plain.read_text() == "x"
