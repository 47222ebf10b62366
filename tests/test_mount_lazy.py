"""Laziness must not cost correctness: what a mount defers to a first lookup or a first open
(a big safetensors header, model directories) behaves as if it had been done at the start,
also when the store changes meanwhile, two readers arrive at once, or the deferred work fails.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

import modelfs.fsd.builder as fsd_builder
from modelfs.fsd.builder import TreeBuilder
from modelfs.fsd.nodes import DirNode, InodeTable, MergedNode, Node
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests.builders import TinyStore, count_header_reads, many_tensor_safetensors
from tests.mounting import fuse, mounted

SAFETENSORS_CONFIG = {"model_format": "safetensors", "model_family": "llama", "file_type": "F16"}
# Over the mount's EAGER_HEADER_BYTES (4 MiB), so a mount in a child process defers it too.
BIG = 60_000


def _big_store(root: Path, blob: bytes) -> TinyStore:
    tiny = TinyStore(root)
    tiny.gguf_model("small:latest", payload=b"small weights")
    tiny.legacy("big:latest", tiny.manifest([tiny.layer("tensor", blob)], SAFETENSORS_CONFIG))
    return tiny


def _corrupt_big_header() -> bytes:
    """A header past EAGER_HEADER_BYTES whose last tensor repeats the first one's name."""
    good = many_tensor_safetensors(BIG)
    n = int.from_bytes(good[:8], "little")
    text = good[8 : 8 + n].rstrip(b" ")
    dup = b',"mlp.0000000.weight":{"dtype":"U8","shape":[0],"data_offsets":[%d,%d]}}' % (
        4 * BIG,
        4 * BIG,
    )
    text = text[:-1] + dup
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + good[8 + n :]


def _walk(node: Node) -> int:
    count = 1
    if isinstance(node, DirNode):
        for child in node.children.values():
            count += _walk(child)
    return count


def test_a_single_big_tensor_blob_is_read_only_when_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the tree and filling every directory reads no big header; the file shows at
    the blob's size; the first open reads it once, and later ones not again."""
    monkeypatch.setattr(fsd_builder, "EAGER_HEADER_BYTES", 1000)
    blob = many_tensor_safetensors(200)
    tiny = _big_store(tmp_path / "models", blob)
    calls = count_header_reads(monkeypatch)
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    _walk(tree.root)  # every lazy directory filled, as `ls -R` would
    assert calls == []
    big = tree.root.children["big"].children["latest"]
    assert isinstance(big, DirNode)
    big.prepare()  # what a lookup runs first, in a worker thread: the header's length only
    assert calls == [] and not big.needs_prepare
    node = big.children["model.safetensors"]
    assert isinstance(node, MergedNode) and node.size == len(blob)
    assert node.check is not None
    node.check()
    node.check()
    assert len(calls) == 1


def test_a_corrupt_big_header_fails_at_open_not_at_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsd_builder, "EAGER_HEADER_BYTES", 1000)
    tiny = _big_store(tmp_path / "models", _corrupt_big_header())
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    node = tree.root.children["big"].children["latest"].children["model.safetensors"]  # type: ignore[attr-defined]
    assert isinstance(node, MergedNode) and node.check is not None
    for _ in range(2):  # the second open gets the same answer without reading again
        with pytest.raises(OSError, match=r"duplicate key 'mlp\.0000000\.weight'") as caught:
            node.check()
        assert caught.value.errno == errno.EIO
    # The next build knows: the model's status says why there is no model.safetensors.
    builder = TreeBuilder(InodeTable())
    builder.merged = tree._build.builder.merged  # type: ignore[union-attr]
    again = builder.build(scan_store(tiny.root)).root.children["big"].children["latest"]
    assert isinstance(again, DirNode) and "model.safetensors" not in again.children
    status = again.children[".ollama"].children["status"]  # type: ignore[attr-defined]
    assert b"duplicate key" in status.data


@fuse
def test_a_corrupt_big_header_is_eio_and_the_mount_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = _big_store(tmp_path / "models", _corrupt_big_header())
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        model = mnt / "big" / "latest"
        assert "model.safetensors" in os.listdir(model)
        with pytest.raises(OSError) as caught:
            (model / "model.safetensors").open("rb").close()
        assert caught.value.errno == errno.EIO
        # The mount goes on answering, for this model and the others.
        assert (mnt / "small" / "latest" / "model.gguf").read_bytes() == b"small weights"
        assert "Modelfile" in os.listdir(model)
    # One clear line in the mount's log says why (the mount's output is written out on exit).
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "not served" in ln]
    assert lines and "duplicate key 'mlp.0000000.weight'" in lines[0], lines


@fuse
def test_two_readers_open_the_big_model_at_once(tmp_path: Path) -> None:
    tiny = _big_store(tmp_path / "models", many_tensor_safetensors(BIG))
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        path = mnt / "big" / "latest" / "model.safetensors"
        got: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def read(who: int) -> None:
            try:
                with safe_open(path, "numpy") as f:
                    got[who] = [
                        int.from_bytes(f.get_tensor(f"mlp.{i:07d}.weight").tobytes(), "little")
                        for i in (0, 7, BIG - 1)
                    ]
            except BaseException as exc:  # reported below
                errors.append(exc)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=120)
        assert not errors, errors
        assert got == {0: [0, 7, BIG - 1], 1: [0, 7, BIG - 1]}


@fuse
def test_a_model_changed_before_its_first_lookup(tmp_path: Path) -> None:
    """A tag moved and another removed between the start and the first look into them: the
    mount never serves a mix, and shows the store as it is once it has seen the change."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("moved:latest", payload=b"old weights")
    tiny.gguf_model("gone:latest", payload=b"gone weights")
    tiny.gguf_model("kept:latest", payload=b"kept weights")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        assert os.path.ismount(mnt)
        # Nothing under the models looked at yet; now the store changes under the mount.
        tiny.gguf_model("moved:latest", payload=b"new weights")
        gone = tiny.layout.legacy_manifest(parse_name("gone:latest"))
        gone.unlink()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                data = (mnt / "moved" / "latest" / "model.gguf").read_bytes()
            except OSError:
                data = b""
            assert data in (b"old weights", b"new weights", b"")
            if data == b"new weights" and not (mnt / "gone").exists():
                break
            time.sleep(0.1)
        else:
            pytest.fail("the mount did not follow the store")
        assert (mnt / "kept" / "latest" / "model.gguf").read_bytes() == b"kept weights"
        assert (mnt / ".by-name").is_dir()


def test_gguf_blobs_without_a_view_are_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store of GGUF files llama.cpp cannot read logged a warning per blob at each mount
    start (2,999 lines for scripts/bench/scan's store). A build reads no GGUF; looking into
    every model warns once, the other blobs at debug level (`-v`)."""
    tiny = TinyStore(tmp_path / "models")
    for i in range(3):
        version = (4000 + i).to_bytes(4, "little")
        tiny.gguf_model(f"m{i}:latest", payload=b"GGUF" + version + bytes(60))
    caplog.set_level(logging.DEBUG, logger="modelfs")
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    assert not [r for r in caplog.records if "llama.cpp" in r.getMessage()]
    _walk(tree.root)
    told = [r for r in caplog.records if "unsupported GGUF version 400" in r.getMessage()]
    assert len(told) == 3
    assert [r.levelno for r in told] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert told[0].getMessage().endswith("(any others: -v)")


def test_the_hub_index_of_big_shards_is_made_when_looked_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of two tensor blobs, one with a big header: `.huggingface/hub/` shows them as
    shards with model.safetensors.index.json, whose tensor names the build read from every
    header (a 100 MB one took seconds and kept 500 MB). Now no header is read until the
    snapshot directory is looked into; then the index is what it was."""
    import modelfs.store.tools.toolviews as toolviews

    monkeypatch.setattr(fsd_builder, "EAGER_HEADER_BYTES", 1000)
    tiny = TinyStore(tmp_path / "models")
    big = many_tensor_safetensors(300)
    text = b'{"x.weight":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'
    text += b" " * (-len(text) % 8)
    small = len(text).to_bytes(8, "little") + text + b"abc"
    layers = [tiny.layer("tensor", big, name="mlp"), tiny.layer("tensor", small, name="x")]
    tiny.legacy("hf.co/org/two:latest", tiny.manifest(layers, SAFETENSORS_CONFIG))
    calls = count_header_reads(monkeypatch)
    real = toolviews.read_safetensors_header_path
    monkeypatch.setattr(
        toolviews, "read_safetensors_header_path", lambda p: calls.append(str(p)) or real(p)
    )
    tree = TreeBuilder(InodeTable()).build(scan_store(tiny.root))
    assert calls == []
    repo = tree.root.children[".huggingface"].children["hub"].children["models--org--two"]  # type: ignore[attr-defined]
    (snapshot,) = repo.children["snapshots"].children.values()
    assert isinstance(snapshot, DirNode) and snapshot.needs_prepare and calls == []
    nlink = snapshot.nlink
    snapshot.prepare()  # the mount runs this in a worker thread before the first lookup
    assert len(calls) == 2
    index = snapshot.children["model.safetensors.index.json"]
    weight_map = json.loads(index.data)["weight_map"]  # type: ignore[attr-defined]
    assert len(weight_map) == 301
    assert weight_map["x.weight"] == "model-00002-of-00002.safetensors"
    assert weight_map["mlp.0000299.weight"] == "model-00001-of-00002.safetensors"
    assert snapshot.nlink == nlink
    assert sorted(snapshot.children) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    # The next build of the same mount reads nothing again.
    again = TreeBuilder(InodeTable())
    again.indexes = tree._build.builder.indexes  # type: ignore[union-attr]
    again.build(scan_store(tiny.root))
    assert len(calls) == 2
