"""Every kind of store modelfs writes survives a stock Ollama's startup prune.

A stock Ollama (ollama/ollama fb30760) that starts on a store deletes every blob an hour old
or more that no file in `manifests/*/*/*/*` names (server/routes.go:1963-1981, then
server/images.go:874-929; transcribed in tests/ollama_local.py `startup_prune`). modelfs also
writes `manifests-v2/` entries that Ollama at that commit never reads, so each store below is
aged past the prune's grace, pruned, and must lose nothing: no blob deleted, and every tag and
variant the store's scan (what `modelfs ls` and the mount show) had before is still there
with every blob it names.

The stores: `modelfs demo-store`; `modelfs pull` of the demo store's names from a `modelfs
serve` on loopback (the preferred child of the list only, `--all-variants`, `--prefer mlx`);
a `modelfs serve --mirror` that kept the list its clients pulled through it (one child, then
the other); a `modelfs sync` daemon that replicated `gemma4:*` from a peer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, GEMMA_MLX, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_LIST, ManifestList, parse_manifest
from modelfs.store.names import parse_name
from modelfs.store.scan import DEFAULT_PREFER, scan_store
from modelfs.sync.pull.manifests import ManifestWriter
from tests import ollama_local as ollama
from tests.builders import TinyStore
from tests.test_daemon import complete, daemon, wait_until
from tests.test_mirror import NO_PROXY, mirror
from tests.test_mirror import pull as pull_through
from tests.test_pull_hosts import modelfs, modelfs_serve, pull

Shown = dict[tuple[str, str | None], frozenset[str]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


def shown(store: Path) -> Shown:
    """(tag, runner) -> the blobs that variant names, for every variant the scan shows."""
    out: Shown = {}
    for entry in scan_store(store):
        for v in entry.variants:
            m = v.manifest
            blobs = {layer.digest.blob_name for layer in m.layers}
            if m.config is not None:
                blobs.add(m.config.digest.blob_name)
            out[(entry.name.shortest, v.runner)] = frozenset(blobs)
    return out


def listed(store: Path) -> set[str]:
    r = modelfs("ls", "--json", "--store", str(store))
    assert r.returncode == 0, r.stderr
    return {m["name"] for m in json.loads(r.stdout)["models"]}


def age(store: Path, seconds: float = 2 * ollama.HOUR) -> None:
    """Every file of the store's blobs/ and manifests*/ as if written `seconds` ago."""
    t = time.time() - seconds
    for d in ("blobs", "manifests", "manifests-v2"):
        for dirpath, _, files in os.walk(store / d):
            for f in files:
                os.utime(Path(dirpath) / f, (t, t), follow_symlinks=False)


def survives_startup_prune(store: Path, *, must_show: set[tuple[str, str | None]]) -> None:
    """`must_show`: (tag, runner) pairs the scan must show first; runner None: any variant."""
    before, names = shown(store), listed(store)
    have = set(before) | {(tag, None) for tag, _ in before}
    assert must_show <= have, sorted(before)
    age(store)
    assert ollama.startup_prune(store) == set()
    after = shown(store)
    assert after == before
    blobs = store / "blobs"
    gone = {(k, b) for k, bs in after.items() for b in bs if not (blobs / b).is_file()}
    assert gone == set()
    assert listed(store) == names


def test_demo_store(tmp_path: Path) -> None:
    """`modelfs demo-store`: its list's mlx child is named by `gemma4:26b-mlx`, so its 38
    blobs stay (on the old code, which wrote only the anchor and the v2 link, the prune
    deleted the whole mlx variant while `modelfs ls` and the mount still showed it)."""
    store = tmp_path / "demo"
    r = modelfs("demo-store", str(store))
    assert r.returncode == 0, r.stderr
    survives_startup_prune(store, must_show={(GEMMA, "llamacpp"), (GEMMA, "mlx")})
    assert (GEMMA_MLX, "mlx") in shown(store)


@pytest.mark.parametrize(
    ("args", "runners"),
    [
        ((), {"llamacpp"}),
        (("--all-variants",), {"llamacpp", "mlx"}),
        (("--prefer", "mlx"), {"mlx"}),
    ],
    ids=["preferred", "all-variants", "prefer-mlx"],
)
def test_pull(demo: DemoStore, tmp_path: Path, args: tuple[str, ...], runners: set[str]) -> None:
    """`modelfs pull` of every demo name from `modelfs serve`: with one child of the list
    (the anchor names its layers and the list and child manifest blobs; the other child is
    not here and needs nothing) or both (the other child named by `<tag>-<runner>`)."""
    store = tmp_path / "b"
    with modelfs_serve(demo.root) as url:
        r = pull(store, *demo.names, *args, "--from", url)
        assert r.returncode == 0, r.stderr
    survives_startup_prune(store, must_show={(GEMMA, runner) for runner in runners})


def test_pull_one_child_then_another(demo: DemoStore, tmp_path: Path) -> None:
    """`modelfs pull gemma4:26b`, later `modelfs pull gemma4:26b --prefer mlx` into the same
    store: the second pull fetches the mlx child only, and the llamacpp child it found here
    must stay named by a legacy file (the anchor), not be dropped from it."""
    store = tmp_path / "b"
    with modelfs_serve(demo.root) as url:
        for args in ((), ("--prefer", "mlx")):
            r = pull(store, GEMMA, *args, "--from", url)
            assert r.returncode == 0, r.stderr
    survives_startup_prune(store, must_show={(GEMMA, "llamacpp"), (GEMMA, "mlx")})


def test_mirror(demo: DemoStore, tmp_path: Path) -> None:
    """A mirror keeps the list from the child one client took, then adds the child another
    client took: after each, its store survives the prune."""
    kept = tmp_path / "m"
    name = parse_name(GEMMA)
    # The file each step writes last: the legacy anchor, then the mlx child's legacy file.
    last = {
        "llamacpp": Layout(kept).legacy_manifest(name),
        "mlx": Layout(kept).legacy_manifest(name.with_tag("26b-mlx")),
    }
    with modelfs_serve(demo.root) as up, mirror(kept, up) as (url, _):
        for i, prefer in enumerate(last):
            r = pull_through(tmp_path / f"c{i}", url, GEMMA, "--prefer", prefer, env=NO_PROXY)
            assert r.returncode == 0, r.stderr
            wait_until(last[prefer].exists, 20, f"the mirror to keep gemma4:26b's {prefer} child")
            survives_startup_prune(kept, must_show={(GEMMA, prefer)})


@pytest.mark.parametrize("prefer", ["llamacpp", "mlx"])
def test_sync_daemon(demo: DemoStore, tmp_path: Path, prefer: str) -> None:
    """`modelfs sync` replicating `gemma4:*` from a peer (the demo store behind `modelfs
    serve`): the list with this host's preferred child, and `gemma4:26b-mlx`, a tag of the
    peer's."""
    store = tmp_path / "h"
    with modelfs_serve(demo.root) as peer:
        keys = {"store": str(store), "peers": [peer], "replicate": ["gemma4:*"]}
        with daemon(tmp_path, "h", interval="1s", prefer=[prefer], **keys):

            def done() -> bool:
                return complete(store, GEMMA) and complete(store, GEMMA_MLX)

            wait_until(done, 60, "gemma4:26b and gemma4:26b-mlx replicated")
    survives_startup_prune(store, must_show={(GEMMA, prefer), (GEMMA_MLX, None)})


def test_a_list_of_inline_children(tmp_path: Path) -> None:
    """A list whose children are inline (no manifest blob of their own), both here, written
    as a pull writes it: the child the anchor is not still gets its legacy file (its
    re-marshalled bytes, whose hash is its digest), so the prune keeps its layers too."""
    s = TinyStore(tmp_path / "s")
    gguf = json.loads(s.manifest([s.layer("model", b"gguf weights")], runner="llamacpp"))
    mlx = json.loads(
        s.manifest(
            [s.layer("tensor", b"\x01" * 64, name="w")],
            {"model_format": "safetensors", "model_family": "gemma4"},
            runner="mlx",
            format="safetensors",
        )
    )
    raw = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_LIST, "manifests": [gguf, mlx]})
    lst = parse_manifest(raw.encode(), "inline")
    assert isinstance(lst, ManifestList) and all(c.inline for c in lst.children)
    name = parse_name("inline:1")
    children = [(i, None, c.inline) for i, c in enumerate(lst.children) if c.inline]
    ManifestWriter(s.layout, DEFAULT_PREFER).write_list(name, raw.encode(), lst, children)
    variant = s.layout.legacy_manifest(name.with_tag("1-mlx"))
    assert Digest.of_bytes(variant.read_bytes()) == lst.children[1].digest
    survives_startup_prune(s.root, must_show={("inline:1", "llamacpp"), ("inline:1", "mlx")})
