"""An index under `.modelfs/` whose checksum is right but whose contents are not the shape we
write (store.index.scancache, store.index.reachcache) breaks no command, and not twice: one
line naming the file, the answer a run without the index gives, and the next run finds a good
index again. Each case writes a real file with indexfile.write_index, as a hand or a bug would
leave it, and runs the real command in a subprocess."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from modelfs.store.collect.gc import GcPolicy, plan_gc
from modelfs.store.index import indexfile, reachcache, scancache
from modelfs.store.index.scancache import ScanCache
from modelfs.store.scan import scan_store
from tests.builders import TinyStore, gguf_bytes
from tests.mounting import fuse, mounted

REPO = Path(__file__).resolve().parent.parent
Obj = list[Any]


def modelfs(root: Path, *argv: str) -> tuple[str, list[str]]:
    """`python -m modelfs ARGV --store ROOT` of this checkout; (stdout, stderr lines)."""
    r = subprocess.run(
        [sys.executable, "-m", "modelfs", *argv, "--store", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr.splitlines()


def ls(root: Path) -> tuple[Any, list[str]]:
    out, err = modelfs(root, "ls", "--json")
    return json.loads(out), err


def gc_dry_run(root: Path) -> tuple[Any, list[str]]:
    out, err = modelfs(root, "gc", "--dry-run", "--json")
    report = json.loads(out)
    del report["seconds"]  # how long it took
    return report, err


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyStore]:
    """Legacy tags (one a real GGUF, so `ls` keeps a header's facts), a `manifests-v2/` list
    with two children, one absent, and a stray blob name; aged past the index's racy margin,
    so that every command keeps all it reads."""
    tmp = tmp_path_factory.mktemp("damage")
    tiny = TinyStore(tmp / "models")
    tiny.gguf_model("a:1")
    work = tmp / "work"
    work.mkdir()
    weights = gguf_bytes([("token_embd.weight", (4, 32), "F32")], workdir=work)
    raw = tiny.manifest(
        [tiny.layer("model", weights), tiny.layer("template", b"{{ .Suffix }}")],
        {"model_format": "gguf", "model_family": "llama", "file_type": "Q4_K_M"},
    )
    tiny.legacy("someone/b:2", raw)
    gguf = tiny.manifest([tiny.layer("model", b"list child")], {"model_format": "gguf"})
    mlx = tiny.manifest([tiny.layer("model", b"mlx child")], {"model_format": "safetensors"})
    absent = tiny.manifest([tiny.layer("model", b"absent child")], {"model_format": "gguf"})
    lst = tiny.manifest_list(
        [(gguf, "llamacpp", "gguf"), (mlx, "mlx", "safetensors"), (absent, "vllm", "gguf")]
    )
    tiny.v2("l:latest", lst)
    tiny.layout.blob(tiny.blob(absent)).unlink()
    (tiny.layout.blobs / "partial-download").write_bytes(b"")
    time.sleep(indexfile.RACY_NS / 1e9 + 0.2)
    yield tiny


class Fresh(NamedTuple):
    """What `ls --json` and `gc --dry-run` say with no index, and their lines on stderr (the
    store's root, a count of its strays)."""

    listed: Any
    ls_err: list[str]
    planned: Any
    gc_err: list[str]


@pytest.fixture(scope="module")
def fresh(store: TinyStore) -> Fresh:
    listed, ls_err = ls(store.root)
    (store.layout.state / scancache.FILE_NAME).unlink()
    planned, gc_err = gc_dry_run(store.root)
    assert not (store.layout.state / reachcache.FILE_NAME).exists()
    return Fresh(listed, ls_err, planned, gc_err)


def good_indexes(tiny: TinyStore) -> None:
    """Both index files as the commands leave them: every tag, the listing, `ls`'s facts."""
    for name in (scancache.FILE_NAME, reachcache.FILE_NAME):
        (tiny.layout.state / name).unlink(missing_ok=True)
    ls(tiny.root)
    plan_gc(tiny.layout, GcPolicy())  # a plan, nothing done: it leaves the reach index
    cache = ScanCache.open(tiny.layout)
    assert cache.facts and cache.entries and cache.dirs and cache.listing
    assert len(cache.manifests) == 2 and len(cache.blob_manifests) == 3 and cache.links


def rewrite(tiny: TinyStore, name: str, damage: Callable[[Obj], None]) -> None:
    """The index `name` with `damage` done to its object, under a right checksum."""
    magic, version = {
        scancache.FILE_NAME: (scancache.MAGIC, scancache.FORMAT_VERSION),
        reachcache.FILE_NAME: (reachcache.MAGIC, reachcache.FORMAT_VERSION),
    }[name]
    path = tiny.layout.state / name
    obj, why = indexfile.read_index(path, magic, version, tiny.root)
    assert why is None and obj is not None
    mutable = list(obj)
    damage(mutable)
    indexfile.write_index(path, magic, version, tuple(mutable), tiny.root)


# -- the damages: one per hole ----------------------------------------------------------------
def _manifests(obj: Obj, legacy: bool = True) -> dict[str, Any]:
    return obj[3] if legacy else obj[5]


def _retuple(obj: Obj, change: Callable[[list[Any]], Any], *, legacy: bool = True) -> None:
    """Each manifest's tuple (of the tag files, or of the blobs) changed by `change`."""
    table = _manifests(obj, legacy)
    for key, (st, kind, data) in list(table.items()):
        t = list(marshal.loads(data))
        got = change(t)
        table[key] = (st, kind, marshal.dumps(tuple(t) if got is None else got))


def short_manifest(obj: Obj) -> None:
    _retuple(obj, lambda t: tuple(t[:-1]))


def media_type_int(obj: Obj) -> None:
    _retuple(obj, lambda t: t.__setitem__(3, 7))


def layer_index_str(obj: Obj) -> None:
    _retuple(obj, lambda t: t.__setitem__(5, ("x", *t[5][1:])))


def digest_index_out_of_range(obj: Obj) -> None:
    _retuple(obj, lambda t: t.__setitem__(2, 10**6))


def digest_index_negative(obj: Obj) -> None:
    _retuple(obj, lambda t: t.__setitem__(2, -1))


def config_index_below(obj: Obj) -> None:
    _retuple(obj, lambda t: t.__setitem__(4, -3))


def runner_int(obj: Obj) -> None:
    """In the list's children's manifests (blobs), which the scan recalls by their recipe."""
    _retuple(obj, lambda t: t.__setitem__(6, 3) if t[0] == 0 else None, legacy=False)


def list_child_short(obj: Obj) -> None:
    def change(t: list[Any]) -> None:
        if t[0] == 1:
            t[4] = tuple(c[:3] for c in t[4])

    _retuple(obj, change, legacy=False)


def digest_table_line(obj: Obj) -> None:
    obj[1] = "\n".join(h[:-1] for h in obj[1].split("\n"))


def digest_table_not_hex(obj: Obj) -> None:
    obj[1] = "\n".join("z" * 64 for _ in obj[1].split("\n"))


def layer_row_size_str(obj: Obj) -> None:
    rows = marshal.loads(obj[2])
    obj[2] = marshal.dumps(tuple((m, d, str(s), n, f) for m, d, s, n, f in rows))


def layer_rows_not_tuples(obj: Obj) -> None:
    obj[2] = marshal.dumps(tuple(0 for _ in marshal.loads(obj[2])))


def dirs_kinds_short(obj: Obj) -> None:
    obj[10] = {p: (key, names, kinds[:-1]) for p, (key, names, kinds) in obj[10].items()}


def dirs_names_not_str(obj: Obj) -> None:
    obj[10] = {p: (key, tuple(range(len(n))), k) for p, (key, n, k) in obj[10].items()}


def dirs_kind_unknown(obj: Obj) -> None:
    obj[10] = {p: (key, names, "x" * len(kinds)) for p, (key, names, kinds) in obj[10].items()}


def links_not_pairs(obj: Obj) -> None:
    obj[4] = {p: 5 for p in obj[4]}


def listing_names_not_str(obj: Obj) -> None:
    key, names, problems, sizes = obj[7]
    obj[7] = (key, tuple(range(len(names))), problems, sizes)


def listing_sizes_str(obj: Obj) -> None:
    """With no recipes, so that the scan checks each tag's blobs by these sizes."""
    key, names, problems, sizes = obj[7]
    obj[7] = (key, names, problems, {h: str(s) for h, s in sizes.items()})
    obj[9] = {}


def listing_problems_short(obj: Obj) -> None:
    key, names, problems, sizes = obj[7]
    assert problems
    obj[7] = (key, names, tuple(p[:2] for p in problems), sizes)


def facts_wrong_shape(obj: Obj) -> None:
    assert any(k.startswith("gguf:") for k in obj[8])
    obj[8] = {k: (v[:2] if k.startswith("gguf:") else v) for k, v in obj[8].items()}


def kind_flipped(obj: Obj) -> None:
    """Each tag file's manifest marked a list, each blob's the other kind from its own."""
    obj[3] = {p: (st, 1, data) for p, (st, _, data) in obj[3].items()}
    obj[5] = {n: (st, 1 - kind, data) for n, (st, kind, data) in obj[5].items()}


def recipe_runner_int(obj: Obj) -> None:
    obj[9] = {p: (tuple((b, 7, f) for b, _, f in r[0]), *r[1:]) for p, r in obj[9].items()}


def recipe_absent_out_of_range(obj: Obj) -> None:
    obj[9] = {p: (r[0], tuple(i + 10 for i in r[1]), *r[2:]) for p, r in obj[9].items()}


def recipe_missing_not_str(obj: Obj) -> None:
    obj[9] = {p: (*r[:3], (5,)) for p, r in obj[9].items()}


def config_family_int(obj: Obj) -> None:
    obj[6] = {h: (c[0], 5, *c[2:]) for h, c in obj[6].items()}


def config_capabilities_str(obj: Obj) -> None:
    obj[6] = {h: (*c[:6], "vision", *c[7:]) for h, c in obj[6].items()}


SCAN_DAMAGES = [
    short_manifest,
    media_type_int,
    layer_index_str,
    digest_index_out_of_range,
    digest_index_negative,
    config_index_below,
    runner_int,
    list_child_short,
    digest_table_line,
    digest_table_not_hex,
    layer_row_size_str,
    layer_rows_not_tuples,
    dirs_kinds_short,
    dirs_names_not_str,
    dirs_kind_unknown,
    links_not_pairs,
    listing_names_not_str,
    listing_sizes_str,
    listing_problems_short,
    facts_wrong_shape,
    kind_flipped,
    recipe_runner_int,
    recipe_absent_out_of_range,
    recipe_missing_not_str,
    config_family_int,
    config_capabilities_str,
]


def reach_names_not_str(obj: Obj) -> None:
    obj[1] = [(p, k, tuple(range(len(n)))) for p, k, n in obj[1]]


def reach_listing_names_not_str(obj: Obj) -> None:
    key, names = obj[2]
    obj[2] = (key, (*names, 5))


REACH_DAMAGES = [reach_names_not_str, reach_listing_names_not_str]


def first_run(
    store: TinyStore,
    name: str,
    damage: Callable[[Obj], None],
    run: Callable[[Path], tuple[Any, list[str]]],
    answer: Any,
    usual: list[str],
) -> None:
    """`run` over the index `name` damaged by `damage` answers `answer`, and says what it
    `usual`ly says and one line more, naming the file."""
    good_indexes(store)
    rewrite(store, name, damage)
    got, err = run(store.root)
    assert got == answer
    more = [line for line in err if line not in usual]
    assert len(more) == 1 and len(err) == len(usual) + 1, err
    assert str(store.layout.state / name) in more[0], err


@pytest.mark.parametrize("damage", SCAN_DAMAGES, ids=lambda f: f.__name__)
def test_a_scan_index_of_the_wrong_shape(
    store: TinyStore, fresh: Fresh, damage: Callable[[Obj], None]
) -> None:
    first_run(store, scancache.FILE_NAME, damage, ls, fresh.listed, fresh.ls_err)
    assert gc_dry_run(store.root) == (fresh.planned, fresh.gc_err)
    # Rebuilt: the next run finds a good index, says nothing more, and answers the same.
    assert ls(store.root) == (fresh.listed, fresh.ls_err)
    cache = ScanCache.open(store.layout)
    assert len(cache.manifests) == 2 and cache.dirs and cache.entries
    assert scan_store(store.root, cache).entries == scan_store(store.root).entries
    assert cache.damage is None  # every manifest built from its data


@pytest.mark.parametrize("damage", REACH_DAMAGES, ids=lambda f: f.__name__)
def test_a_reach_index_of_the_wrong_shape(
    store: TinyStore, fresh: Fresh, damage: Callable[[Obj], None]
) -> None:
    first_run(store, reachcache.FILE_NAME, damage, gc_dry_run, fresh.planned, fresh.gc_err)
    assert ls(store.root) == (fresh.listed, fresh.ls_err)
    # A dry run writes no index (docs/architecture.md, GC's invariant 7); a plan that may act
    # leaves a good one, which the next dry run uses without a word.
    plan_gc(store.layout, GcPolicy())
    assert gc_dry_run(store.root) == (fresh.planned, fresh.gc_err)


def mount_tree(
    store: TinyStore, mnt: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[list[tuple[str, int]], list[str]]:
    """Every file the mount shows, with its size, and the mount's lines about the index."""
    capsys.readouterr()
    with mounted(store.root, mnt, env={**os.environ, "PYTHONPATH": str(REPO)}):
        files = sorted(
            (os.path.relpath(os.path.join(d, n), mnt), os.stat(os.path.join(d, n)).st_size)
            for d, _, names in os.walk(mnt)
            for n in names
        )
    said = capsys.readouterr().out.splitlines()  # the mount's log, as `mounted` passes it on
    return files, [line for line in said if "scan index" in line]


@fuse
@pytest.mark.parametrize(
    "damage",
    [short_manifest, layer_row_size_str, kind_flipped, dirs_kinds_short, recipe_runner_int],
    ids=lambda f: f.__name__,
)
def test_the_mount_shows_the_store_over_a_scan_index_of_the_wrong_shape(
    store: TinyStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Obj], None],
) -> None:
    """The mount builds each model's directory when it is first looked up, long after its
    scan: a manifest of the wrong shape met then is read afresh, not an error to the reader."""
    (store.layout.state / scancache.FILE_NAME).unlink(missing_ok=True)
    fresh, said = mount_tree(store, tmp_path / "fresh", capsys)
    assert fresh and said == []
    good_indexes(store)
    rewrite(store, scancache.FILE_NAME, damage)
    got, said = mount_tree(store, tmp_path / "mnt", capsys)
    assert got == fresh
    assert len(said) == 1 and str(store.layout.state / scancache.FILE_NAME) in said[0], said
