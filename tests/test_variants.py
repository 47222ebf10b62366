"""One ranking of a manifest list's children (store.scan.rank_children): the child a pull
fetches is the one the mount shows at the plain tag, and a pull without fallback writes
nothing when no peer has that child."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST, Manifest, parse_manifest
from modelfs.store.scan import rank_children, scan_store
from modelfs.sync.daemon.config import ConfigError, load_config
from modelfs.sync.errors import PeerNotFoundError
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.puller import pull
from tests.builders import TinyStore, compact
from tests.fakepeer import FakePeer
from tests.test_pull import tree

NAME = "gemma4:26b"
PREFERS = [("llamacpp", "ggml", "mlx"), ("mlx",), ("mlx", "llamacpp"), ("ggml",), ("cuda",)]


def two_children(root: Path, *, labelled: bool) -> tuple[TinyStore, bytes, bytes]:
    """gemma4:26b as a list of a GGUF and a safetensors child, both here; `labelled` lists
    give runner and format, others neither (the runner is then the child manifest's)."""
    s = TinyStore(root)
    gguf = s.manifest([s.layer("model", b"gguf weights")])
    mlx = s.manifest(
        [s.layer("tensor", b"\x01" * 64, name="w")],
        {"model_format": "safetensors", "model_family": "gemma4", "file_type": "int4"},
    )
    refs = []
    for raw, runner, fmt in ((gguf, "llamacpp", "gguf"), (mlx, "mlx", "safetensors")):
        ref = {"mediaType": MEDIA_MANIFEST, "digest": str(s.blob(raw))}
        if labelled:
            ref |= {"runner": runner, "format": fmt}
        refs.append(ref)
    s.v2(NAME, compact({"schemaVersion": 2, "mediaType": MEDIA_LIST, "manifests": refs}))
    return s, gguf, mlx


@pytest.mark.parametrize("labelled", [True, False])
def test_the_mount_shows_the_child_a_pull_ranks_first(tmp_path: Path, labelled: bool) -> None:
    s, _, _ = two_children(tmp_path, labelled=labelled)
    entry = scan_store(s.root).lookup(NAME)
    lst = entry.top
    known = {v.manifest.digest: v.manifest for v in entry.variants}
    for prefer in PREFERS:
        first = lst.children[rank_children(lst, prefer, known)[0]]  # type: ignore[union-attr]
        shown = entry.preferred(prefer)
        assert shown is not None and shown.manifest.digest == first.digest, prefer
        assert entry.wanted_child(prefer) == first
        assert scan_store(s.root).lacks_wanted(entry, prefer) is None


async def test_a_pull_ranks_children_without_runner_by_their_manifest(tmp_path: Path) -> None:
    """A list naming no runner: prefer = mlx fetches the safetensors child, the one the
    mount with that prefer shows (the pull used to take list order, the GGUF)."""
    src, _, mlx = two_children(tmp_path / "a", labelled=False)
    dest = Layout(tmp_path / "b")
    with FakePeer(src.root) as peer:
        await pull(dest, [NAME], [peer.url], options=PullOptions(prefer=("mlx",)))
    entry = scan_store(dest).lookup(NAME)
    assert [v.manifest.digest for v in entry.variants] == [Digest.of_bytes(mlx)]
    assert scan_store(dest).lacks_wanted(entry, ("mlx",)) is None


async def test_without_fallback_nothing_is_written_when_no_peer_has_the_preferred_child(
    tmp_path: Path,
) -> None:
    """The peer pulled only the mlx child; a host preferring llamacpp keeps what it has."""
    src, gguf, _ = two_children(tmp_path / "a", labelled=True)
    gguf_manifest = parse_manifest(gguf, "gguf child")
    assert isinstance(gguf_manifest, Manifest)
    src.layout.blob(Digest.of_bytes(gguf)).unlink()
    for layer in gguf_manifest.layers:
        src.layout.blob(layer.digest).unlink()
    dest = TinyStore(tmp_path / "b")
    dest.gguf_model(NAME, b"the old version")
    before = tree(dest.root)
    with FakePeer(src.root) as peer:
        with pytest.raises(PeerNotFoundError, match="no peer has the llamacpp variant of"):
            await pull(dest.layout, [NAME], [peer.url], options=PullOptions(fallback=False))
        assert tree(dest.root) == before
        await pull(dest.layout, [NAME], [peer.url])  # by hand: the next child some peer has
    assert [v.runner for v in scan_store(dest.root).lookup(NAME).variants] == ["mlx"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("max_transfers = 0\n", "max_transfers: expected 1 to 64, got 0"),
        ('max_transfers = "2"\n', "max_transfers: expected an integer, got a string"),
        ("max_transfers = true\n", "max_transfers: expected an integer"),
    ],
)
def test_max_transfers_is_checked(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=needle):
        load_config(path)
    path.write_text("max_transfers = 5\n")
    assert load_config(path).max_transfers == 5
