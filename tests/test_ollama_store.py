"""A store shared with a stock Ollama (ollama/ollama fb30760, emulated in tests/ollama_local.py).

Stores are filled by the real `modelfs pull` from a real `modelfs serve` on loopback (the
demo store as the source), then Ollama's hands are put on them: its startup prune, `ollama
rm`, a re-pull of the tag, and `GET /api/tags`, each compared with what modelfs says.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from modelfs.demo import GEMMA, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from tests import ollama_local as ollama
from tests.builders import TinyStore, gguf_bytes
from tests.mounting import fuse, mounted
from tests.test_pull_hosts import modelfs, modelfs_serve, pull

GEMMA_NAME = ("registry.ollama.ai", "library", "gemma4", "26b")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


def pulled(demo: DemoStore, store: Path, *args: str) -> None:
    with modelfs_serve(demo.root) as url:
        r = pull(store, *demo.names, *args, "--from", url)
        assert r.returncode == 0, r.stderr


def age_everything(store: Path, seconds: float = 2 * ollama.HOUR) -> None:
    """An hour and more later, when Ollama's startup prune takes what nothing names."""
    t = time.time() - seconds
    for d in ("blobs", "manifests"):
        for dirpath, _, files in os.walk(store / d):
            for f in files:
                os.utime(Path(dirpath) / f, (t, t), follow_symlinks=False)


def blobs_of(manifest_raw: bytes) -> set[str]:
    obj = json.loads(manifest_raw)
    return {x["digest"] for x in [*obj["layers"], obj["config"]]}


def present(store: Path, digests: set[str]) -> set[str]:
    return {d for d in digests if (store / "blobs" / d.replace(":", "-")).is_file()}


def ls_json(store: Path) -> list[dict[str, Any]]:
    r = modelfs("ls", "--json", "--store", str(store))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["models"]


# -- nothing modelfs fetched is lost to Ollama ----------------------------------------------
def test_ollamas_prune_rm_and_repull_keep_every_variant_modelfs_pulled(
    demo: DemoStore, tmp_path: Path
) -> None:
    store = tmp_path / "b"
    pulled(demo, store, "--all-variants")
    mlx = demo.manifests[f"{GEMMA}@mlx"]
    gguf_child = demo.manifests[f"{GEMMA}@llamacpp"]
    mlx_blobs, gguf_blobs = blobs_of(mlx.raw), blobs_of(gguf_child.raw)
    # The extra legacy file for the child the anchor is not: its own bytes.
    extra = store / "manifests/registry.ollama.ai/library/gemma4/26b-mlx"
    assert extra.read_bytes() == mlx.raw

    age_everything(store)
    assert ollama.startup_prune(store) == set()
    assert present(store, mlx_blobs | gguf_blobs) == mlx_blobs | gguf_blobs
    tags = {m["name"]: m for m in ollama.api_tags(store)}
    assert tags["gemma4:26b-mlx"]["digest"] == mlx.digest.hex  # what `ollama list` shows

    # Ollama pulls the tag again from its registry (which gives it the llamacpp child, its
    # Accept names no list type): the old anchor's list and manifest blobs go, the mlx
    # variant's blobs stay.
    removed = ollama.repull(store, GEMMA_NAME, gguf_child.raw)
    assert removed & mlx_blobs == set()
    assert str(demo.lists[GEMMA].digest) in removed
    age_everything(store)
    assert ollama.startup_prune(store) == set()
    assert present(store, mlx_blobs) == mlx_blobs

    # `ollama rm gemma4:26b`: the gguf child's own blobs go, the mlx variant's stay, named by
    # `gemma4:26b-mlx` until that is removed too.
    removed = ollama.rm(store, GEMMA_NAME)
    assert removed and removed & mlx_blobs == set()
    assert present(store, mlx_blobs) == mlx_blobs
    ollama.rm(store, (*GEMMA_NAME[:3], "26b-mlx"))
    assert present(store, mlx_blobs) == set()


def test_a_name_taken_by_another_model_is_left_alone(demo: DemoStore, tmp_path: Path) -> None:
    store = tmp_path / "b"
    other = TinyStore(store)
    raw = other.gguf_model("gemma4:26b-mlx", payload=b"someone else's model")
    pulled(demo, store, "--all-variants")
    assert (store / "manifests/registry.ollama.ai/library/gemma4/26b-mlx").read_bytes() == raw


# -- a dangling manifests-v2 link is a removed tag ------------------------------------------
def test_after_ollama_rm_the_dangling_v2_link_is_a_removed_tag(
    demo: DemoStore, tmp_path: Path
) -> None:
    store = tmp_path / "b"
    pulled(demo, store, "--all-variants")
    ollama.rm(store, GEMMA_NAME)
    link = store / "manifests-v2/ollama.com/library/gemma4/26b"
    assert link.is_symlink() and not link.exists()

    names = [m["name"] for m in ls_json(store)]
    assert "gemma4:26b" not in names and "gemma4:26b-mlx" in names

    r = modelfs("verify", "--store", str(store))
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(
        x for x in r.stdout.splitlines() if "manifests-v2/ollama.com/library/gemma4/26b" in x
    )
    assert "removed tag" in line, r.stdout

    for _ in range(2):
        r = modelfs("gc", "--store", str(store), "--grace", "0", "--grace-below-floor", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["refused"] == []

    # Ollama pulls it again: the legacy file is the tag once more, whatever the link says.
    ollama_raw = demo.manifests[f"{GEMMA}@llamacpp"].raw
    for d in blobs_of(ollama_raw):
        blob = d.replace(":", "-")
        shutil.copyfile(demo.root / "blobs" / blob, store / "blobs" / blob)
    (store / "manifests/registry.ollama.ai/library/gemma4/26b").write_bytes(ollama_raw)
    gemma = next(m for m in ls_json(store) if m["name"] == "gemma4:26b")
    assert gemma["digest"] == Digest.of_bytes(ollama_raw).hex


def test_a_dangling_link_to_a_trashed_blob_is_not_a_removed_tag(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "s")
    raw = tiny.manifest([tiny.layer("model", b"w")])
    tiny.v2("gone:1", raw)
    blob = tiny.layout.blob(Digest.of_bytes(raw))
    trash = tiny.layout.trash / "20260101T000000Z"
    trash.mkdir(parents=True)
    blob.rename(trash / blob.name)
    r = modelfs("gc", "--store", str(tiny.root), "--grace", "0", "--grace-below-floor", "--json")
    # Not a removed tag: GC puts the manifest blob back (and keeps what it names).
    assert r.returncode == 0, r.stdout + r.stderr
    assert blob.is_file() and not (trash / blob.name).exists()
    assert tiny.layout.blob(Digest.of_bytes(b"w")).is_file()
    assert [m["name"] for m in ls_json(tiny.root)] == ["gone:1"]


@fuse
def test_the_mount_shows_a_removed_tag_as_gone(demo: DemoStore, tmp_path: Path) -> None:
    store = tmp_path / "b"
    pulled(demo, store, "--all-variants")
    ollama.rm(store, GEMMA_NAME)
    with mounted(store, tmp_path / "mnt"):
        assert not (tmp_path / "mnt/gemma4/26b").exists()
        assert (tmp_path / "mnt/gemma4/26b-mlx/tensors").is_dir()


# -- `modelfs ls --json` is Ollama's /api/tags ----------------------------------------------
def same_as_api_tags(store: Path) -> list[dict[str, Any]]:
    ours = ls_json(store)
    theirs = ollama.api_tags(store)
    seconds = [int(ollama.mtime_of(m["modified_at"])) for m in ours]
    assert seconds == sorted(seconds, reverse=True)  # newest first, by whole seconds
    by_name = {m["name"]: m for m in theirs}
    assert sorted(m["name"] for m in ours) == sorted(by_name)
    for m in ours:
        want = dict(by_name[m["name"]])
        assert abs(ollama.mtime_of(m["modified_at"]) - want.pop("modified_at")) < 1e-6
        got = {k: v for k, v in m.items() if k != "modified_at"}
        assert got == want, m["name"]
    return ours


def test_ls_json_is_api_tags_on_the_demo_store_and_pulled_stores(
    demo: DemoStore, tmp_path: Path
) -> None:
    listed = {m["name"]: m for m in same_as_api_tags(demo.root)}
    # A list tag: the legacy anchor, which Ollama at HEAD reads.
    assert listed["gemma4:26b"]["digest"] == demo.anchors[GEMMA].digest.hex
    assert listed["gemma4:26b"]["details"]["context_length"] > 0
    assert "completion" in listed["gemma4:26b"]["capabilities"]
    assert listed["llama3.2:3b"]["details"]["embedding_length"] > 0
    for args in ((), ("--all-variants",), ("--prefer", "mlx")):
        store = tmp_path / "-".join(("b", *args))
        pulled(demo, store, *args)
        same_as_api_tags(store)


def test_ls_json_is_api_tags_on_odd_stores(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "s")
    t0 = 1_767_225_600
    # A real GGUF whose config gives no quantization: Ollama reads the GGUF's file type.
    weights = gguf_bytes([("token_embd.weight", (4, 32), "F32")], file_type=15, workdir=tmp_path)
    real = tiny.manifest(
        [tiny.layer("model", weights), tiny.layer("template", b"{{ .Prompt }}{{ .Tools }}")],
        {"model_format": "gguf", "model_family": "llama"},
    )
    tiny.legacy("real:1", real, mtime=t0 + 50)
    tiny.legacy("Foo:1", tiny.manifest([tiny.layer("model", b"F")]), mtime=t0 + 40)
    tiny.legacy("foo:1", tiny.manifest([tiny.layer("model", b"f")]), mtime=t0 + 40)
    # A legacy manifest that is a symlink to another one.
    alias = tiny.layout.manifests / "registry.ollama.ai/library/alias/1"
    alias.parent.mkdir(parents=True)
    alias.symlink_to("../real/1")
    # Left out by Ollama: the config blob is gone; the template blob is gone.
    no_cfg = tiny.manifest([tiny.layer("model", b"nc")], {"model_format": "gguf", "n": "c"})
    tiny.legacy("nocfg:1", no_cfg, mtime=t0 + 30)
    tiny.layout.blob(Digest.parse(json.loads(no_cfg)["config"]["digest"])).unlink()
    tmpl = tiny.layer("template", b"{{ .Prompt }} lost")
    tiny.legacy("notmpl:1", tiny.manifest([tiny.layer("model", b"nt"), tmpl]), mtime=t0 + 20)
    tiny.layout.blob(Digest.parse(tmpl["digest"])).unlink()

    listed = {m["name"]: m for m in same_as_api_tags(tiny.root)}
    assert {"Foo:1", "foo:1", "alias:1", "real:1"} <= set(listed)
    assert not {"nocfg:1", "notmpl:1"} & set(listed)
    assert listed["real:1"]["details"]["quantization_level"] == "Q4_K_M"
    assert listed["real:1"]["details"]["context_length"] == 4096
    assert listed["real:1"]["capabilities"] == ["completion", "tools"]
    assert listed["alias:1"]["digest"] == listed["real:1"]["digest"]
    r = modelfs("verify", "--store", str(tiny.root))
    assert "alias/1" not in r.stdout, r.stdout


# -- hosts ------------------------------------------------------------------------------------
def test_ollama_com_is_its_own_host_in_manifests_and_the_default_in_manifests_v2(
    tmp_path: Path,
) -> None:
    tiny = TinyStore(tmp_path / "s")
    a = tiny.gguf_model("qwen3:0.6b", payload=b"registry")
    b = tiny.manifest([tiny.layer("model", b"ollama.com")])
    tiny.legacy("ollama.com/library/qwen3:0.6b", b)
    assert (tiny.layout.manifests / "ollama.com/library/qwen3/0.6b").read_bytes() == b
    v2 = tiny.manifest([tiny.layer("model", b"v2")])
    link = tiny.v2("gemma4:e2b", v2)
    assert link == tiny.layout.manifests_v2 / "ollama.com/library/gemma4/e2b"

    listed = {m["name"]: m["digest"] for m in ls_json(tiny.root)}
    assert listed["qwen3:0.6b"] == Digest.of_bytes(a).hex
    assert listed["ollama.com/library/qwen3:0.6b"] == Digest.of_bytes(b).hex
    assert listed["gemma4:e2b"] == Digest.of_bytes(v2).hex
    tags = {m["name"]: m["digest"] for m in ollama.api_tags(tiny.root)}
    assert {k: v for k, v in listed.items() if k != "gemma4:e2b"} == tags  # HEAD: no v2
    r = modelfs("verify", "--store", str(tiny.root))
    assert r.returncode == 0 and "duplicate" not in r.stdout, r.stdout


def test_a_v2_link_resolves_where_it_is_made_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that follows links (sshfs `-o follow_symlinks`) sees a link that resolves
    nowhere as no file: one made in `.modelfs/tmp/` with the target it will have in
    manifests-v2/ was a dangling link there, which that client could neither rename into place
    nor remove, so every such write left one behind. The link is made as deep as its tag's
    folder, so it resolves in both places; and whatever fails, the temp link goes."""
    tiny = TinyStore(tmp_path / "models")
    raw = tiny.manifest([tiny.layer("model", b"weights")])
    real_replace = os.replace
    resolved: list[bool] = []

    def replace(src: Any, dst: Any) -> None:
        resolved.append(os.path.exists(src))  # follows the link, as sshfs would
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    tag = tiny.v2("m:1", raw)
    assert resolved and all(resolved)
    assert tag.is_symlink() and tag.read_bytes() == raw
    assert list(tiny.layout.links.iterdir()) == []

    # A symlink(2) that made the link and still failed (sshfs with follow_symlinks answers
    # its lookup of a dangling link with ENOENT): a copy is written, no link is left.
    real_symlink = os.symlink

    def symlink_made_but_failed(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_symlink(src, dst, *args, **kwargs)
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "symlink", symlink_made_but_failed)

    def no_hardlinks(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hardlinks)
    tag = tiny.v2("m:2", raw)
    assert not tag.is_symlink() and tag.read_bytes() == raw
    assert list(tiny.layout.links.iterdir()) == []

    # The rename itself fails: the link still goes.
    monkeypatch.setattr(os, "symlink", real_symlink)

    def replace_fails(src: Any, dst: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(PermissionError):
        tiny.v2("m:3", raw)
    assert list(tiny.layout.links.iterdir()) == []
