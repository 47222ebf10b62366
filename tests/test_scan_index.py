"""The persistent scan index (store.index.scancache) answers as a fresh scan does, whatever is
done to the store between scans: a seeded random loop of edits (hypothesis is not installed in
the project's environment), each round compared with a scan that has no index at all."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from modelfs.cli.ls import tags_json
from modelfs.fsd import counts
from modelfs.fsd.builder import NameTree, TreeBuilder
from modelfs.fsd.nodes import BlobNode, DirNode, InodeTable, Node
from modelfs.store.collect.reach import Reach, reachable
from modelfs.store.digest import Digest
from modelfs.store.index import indexfile, scancache
from modelfs.store.index.reachcache import ReachCache
from modelfs.store.names import parse_name
from modelfs.store.scan import ScanCache, StoreIndex, scan_store
from tests.builders import TinyStore

# An edit within RACY_NS of a scan is read again by the next one; the loop waits out a short
# margin instead of the 2 s one, so that what it checks is the stamps, not the margin.
RACY_NS = 20_000_000
SETTLE = 0.03


def answer(index: StoreIndex) -> dict[str, Any]:
    """Everything a scan tells its callers, in comparable form."""

    def entry(e: Any) -> tuple[Any, ...]:
        return (
            e.name.key,
            e.source,
            e.file,
            e.top.digest,
            e.top.raw,
            e.mtime_ns,
            e.anchor_mtime_ns,
            tuple((v.manifest.digest, v.runner, v.format, v.from_list) for v in e.variants),
            tuple(c.digest for c in e.absent_children),
        )

    return {
        "entries": sorted(entry(e) for e in index),
        "hidden": sorted(entry(e) for e in index.hidden),
        "problems": sorted((p.kind, p.path, p.message) for p in index.problems),
        "blobs": sorted(index.blob_names),
        "configs": sorted(
            (str(e.name), repr(index.config(v.manifest))) for e in index for v in e.variants
        ),
    }


def reach_answer(reach: Reach) -> tuple[Any, ...]:
    return (
        sorted(reach.blob_names),
        reach.manifests,
        sorted(str(p) for p in reach.unreadable),
        sorted(str(p) for p in reach.strays),
        sorted(str(p) for p in reach.removed),
    )


def link_counts(tree: NameTree) -> dict[str, tuple[Any, ...]]:
    """Every path of the whole tree: its kind and link count (a blob's media type and .gguf
    mark too), as listings show them."""
    out: dict[str, tuple[Any, ...]] = {}

    def visit(node: Node, path: str) -> None:
        if isinstance(node, DirNode):
            out[path] = ("dir", node.nlink)
            for name, child in node.children.items():
                visit(child, f"{path}/{name}")
        elif isinstance(node, BlobNode):
            out[path] = ("blob", node.count_links(), node.media_type, node.gguf)
        else:
            out[path] = (type(node).__name__, node.links)

    visit(tree.root, "")
    return out


def mounted(index: StoreIndex) -> tuple[dict[str, tuple[Any, ...]], bool]:
    """What a mount's build of `index` shows, and whether it took its counts from the last
    build of the same store (fsd.counts)."""
    tree = TreeBuilder(InodeTable()).build(index)
    assert tree._build is not None
    return link_counts(tree), tree._build.known is not None


class Editor:
    def __init__(self, tiny: TinyStore, rng: random.Random) -> None:
        self.tiny, self.rng = tiny, rng
        self.n = 0
        self.removed: list[tuple[Path, bytes]] = []

    def plain(self) -> bytes:
        self.n += 1
        return self.tiny.manifest(
            [
                self.tiny.layer("model", b"weights %d" % self.n),
                self.tiny.layer("template", b"{{ .Prompt }}"),
            ],
            {"model_format": "gguf", "model_family": "llama", "file_type": f"Q{self.n % 9}"},
        )

    def tags(self, tree: Path) -> list[Path]:
        return sorted(p for p in tree.rglob("*") if p.is_file() or p.is_symlink())

    def edit(self) -> str:
        tiny, rng = self.tiny, self.rng
        legacy, v2 = self.tags(tiny.layout.manifests), self.tags(tiny.layout.manifests_v2)
        what = rng.choice(
            ["add", "add", "v2", "list", "rewrite", "rewrite", "remove", "rm-blob", "corrupt"] * 2
            + ["swap-template", "restore-blob", "restore-blob"]
        )
        if what == "add" or (what in ("rewrite", "remove") and not legacy):
            tiny.legacy(f"m{rng.randrange(30)}:t{rng.randrange(3)}", self.plain())
        elif what == "v2":
            tiny.v2(f"v{rng.randrange(10)}:latest", self.plain())
        elif what == "list":
            gguf, mlx = self.plain(), self.plain()
            lst = tiny.manifest_list([(gguf, "llamacpp", "gguf"), (mlx, "mlx", "safetensors")])
            tiny.v2(f"l{rng.randrange(10)}:latest", lst)
        elif what == "rewrite":
            # In place, same size, mtime put back: only the ctime tells.
            path = rng.choice(legacy)
            st = path.stat()
            raw = path.read_bytes()
            new = raw.replace(b"llama", b"lLama") if b"llama" in raw else raw[:-1] + b" "
            with open(path, "r+b") as f:
                f.write(new[: len(raw)])
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        elif what == "remove":
            rng.choice(legacy + v2).unlink()
        elif what == "swap-template":
            # Other bytes of the same size renamed over the template blob (never done, but
            # what `ls` read from it must not outlive it): its fields say `insert` now.
            template = tiny.layout.blob(Digest.of_bytes(b"{{ .Prompt }}"))
            if template.exists():
                body = rng.choice([b"{{ .Suffix }}", b"{{ .Prompt }}"])
                tmp = template.with_name("swap.tmp")
                tmp.write_bytes(body)
                tmp.rename(template)
        elif what == "rm-blob":
            blobs = sorted(tiny.layout.blobs.iterdir())
            if blobs:
                gone = rng.choice(blobs)
                self.removed.append((gone, gone.read_bytes()))
                gone.unlink()
        elif what == "restore-blob" and self.removed:
            # The same bytes back under their name: the tags naming them show them again.
            path, body = self.removed.pop(rng.randrange(len(self.removed)))
            tmp = path.with_name("restore.tmp")
            tmp.write_bytes(body)
            tmp.rename(path)
        elif what == "corrupt":
            index = tiny.layout.state / rng.choice(
                [scancache.FILE_NAME, "reach-index", counts.FILE_NAME]
            )
            if index.exists():
                data = bytearray(index.read_bytes())
                data[rng.randrange(len(data))] ^= 0xFF
                index.write_bytes(bytes(data[: rng.randrange(len(data) + 1)]))
        return what


def test_the_index_answers_as_a_fresh_scan_over_random_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    editor = Editor(tiny, random.Random(20261206))
    long_lived = ScanCache.open(tiny.layout)  # a mount's: in memory across scans, and saved
    done: list[str] = []
    taken = 0
    for _ in range(60):
        for _ in range(editor.rng.randrange(1, 4)):
            done.append(editor.edit())
        time.sleep(SETTLE)
        blobs = tiny.layout.blobs
        fresh_index = scan_store(tiny.root)
        fresh, listed = answer(fresh_index), tags_json(fresh_index)
        assert answer(scan_store(tiny.root, long_lived)) == fresh, done[-4:]
        # What a command does: open the saved index, scan, save; `ls` saves what it read.
        command = scan_store(tiny.root, ScanCache.open(tiny.layout))
        assert answer(command) == fresh, done[-4:]
        assert tags_json(command) == listed, done[-4:]
        assert command.cache is not None
        command.cache.save()
        # A mount's link counts, worked out or taken from the last build's: as a build of a
        # scan with no index at all works them out.
        shown, _ = mounted(fresh_index)
        for _ in range(2):  # the first saves them when the store is settled, the second takes
            again = scan_store(tiny.root, ScanCache.open(tiny.layout))
            got, known = mounted(again)
            assert got == shown, done[-4:]
        taken += known
        # And GC's plan: its reach index against a reach that reads everything.
        reach_cache = ReachCache.open(tiny.layout)
        cached = reachable(tiny.layout, cache=reach_cache)
        assert reach_answer(cached) == reach_answer(reachable(tiny.layout)), done[-4:]
        assert sorted(reach_cache.listdir(tiny.layout.blobs)) == sorted(os.listdir(blobs))
        reach_cache.save()
    assert {"rewrite", "remove", "rm-blob", "corrupt", "list", "swap-template"} <= set(done)
    assert "restore-blob" in done
    assert taken > 30  # the saved counts were used, not only worked out


def test_edits_by_another_process_reach_a_long_lived_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host's writes, made by a second process between a mount's rescans, and that
    process's own saves of the index, which the mount then overwrites."""
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    for i in range(5):
        tiny.gguf_model(f"a{i}:1", payload=b"weights %d" % i)
    time.sleep(SETTLE)
    cache = ScanCache.open(tiny.layout)
    scan_store(tiny.root, cache)
    script = (
        "import json, os, sys, time\n"
        "from modelfs.store.index import indexfile\n"
        f"indexfile.RACY_NS = {RACY_NS}\n"
        "from modelfs.store.scan import ScanCache, scan_store\n"
        "from modelfs.store.layout import Layout\n"
        "from tests.builders import TinyStore\n"
        "t = TinyStore(sys.argv[1]); i = int(sys.argv[2])\n"
        "p = t.layout.legacy_manifest(__import__('modelfs.store.names').store.names"
        ".parse_name(f'a{i % 5}:1'))\n"
        "st = p.stat(); raw = p.read_bytes()\n"
        "new = t.manifest([t.layer('model', b'other %d' % i)], {'model_format': 'gguf'})\n"
        "new = (new + b' ' * len(raw))[: len(raw)] if len(new) < len(raw) else new\n"
        "open(p, 'r+b').write(new); os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))\n"
        "t.gguf_model(f'b{i}:1', payload=b'b %d' % i)\n"
        "time.sleep(0.03)\n"
        "scan_store(t.root, ScanCache.open(t.layout))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for i in range(6):
        subprocess.run(
            [sys.executable, "-c", script, str(tiny.root), str(i)],
            check=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        time.sleep(SETTLE)
        fresh = answer(scan_store(tiny.root))
        assert answer(scan_store(tiny.root, cache)) == fresh
        assert answer(scan_store(tiny.root, ScanCache.open(tiny.layout))) == fresh


def test_a_file_not_ours_alone_is_ignored_and_a_read_only_store_still_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    time.sleep(SETTLE)
    scan_store(tiny.root, ScanCache.open(tiny.layout))
    index = tiny.layout.state / scancache.FILE_NAME
    assert index.exists()
    assert ScanCache.open(tiny.layout).manifests  # ours: used
    index.chmod(0o666)
    caplog.set_level("INFO")
    assert not ScanCache.open(tiny.layout).manifests
    assert "not trusted" in caplog.text
    # Another version, and junk: one line each, a full scan, and the file written again.
    for data in (b"modelfs scan index\n" + b"\x09" + bytes(20), b"\x80\x04junk"):
        index.write_bytes(data)
        index.chmod(0o644)
        caplog.clear()
        cache = ScanCache.open(tiny.layout)
        assert len(caplog.records) == 1 and "rebuilds it" in caplog.text
        assert caplog.records[0].exc_info is None
        assert [e.name.shortest for e in scan_store(tiny.root, cache)] == ["a:1"]
        assert ScanCache.open(tiny.layout).manifests
    # A store we may not write to: scanned, nothing saved, no error.
    index.unlink()
    monkeypatch.setattr(scancache, "_save", _refuse)
    cache = ScanCache.open(tiny.layout)
    assert [e.name.shortest for e in scan_store(tiny.root, cache)] == ["a:1"]
    assert not index.exists()


def _refuse(cache: ScanCache, path: Path) -> None:
    raise PermissionError(13, "Permission denied")


def test_a_change_within_the_racy_margin_is_not_kept(tmp_path: Path) -> None:
    """Written just now, a tag file could be rewritten again within its clock's tick with the
    same stamp: the index does not keep it, so the next scan reads it."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    cache = ScanCache.open(tiny.layout)
    scan_store(tiny.root, cache)
    assert cache.manifests == {}
    saved = json.dumps(sorted(ScanCache.open(tiny.layout).manifests))
    assert saved == "[]"


def test_a_dry_run_reads_the_reach_index_and_writes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC's invariant 7 (docs/architecture.md): a dry run changes nothing, its index neither;
    a plan that may act leaves it for the next."""
    import trio

    from modelfs.store.collect.gc import GcPolicy
    from modelfs.sync.daemon.gc import run_gc

    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    time.sleep(SETTLE)
    index = tiny.layout.state / "reach-index"
    report = trio.run(lambda: run_gc(tiny.layout, GcPolicy(), dry_run=True))
    assert report.dry_run and not report.refused
    assert not index.exists()
    trio.run(lambda: run_gc(tiny.layout, GcPolicy()))
    assert set(ReachCache.open(tiny.layout).files) == {
        str(tiny.layout.legacy_manifest(parse_name("a:1")))
    }


def test_what_ls_read_from_a_blob_goes_when_blobs_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ls` keeps a template's fields in the index; bytes renamed over the blob (whatever
    wrote them) are read again, since the rename changes blobs/."""
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    time.sleep(SETTLE)

    def capabilities() -> list[str]:
        index = scan_store(tiny.root, ScanCache.open(tiny.layout))
        listed = json.loads(tags_json(index))["models"][0].get("capabilities", [])
        assert index.cache is not None
        index.cache.save()
        return list(listed)

    assert capabilities() == []
    assert ScanCache.open(tiny.layout).facts  # kept
    template = tiny.layout.blob(Digest.of_bytes(b"{{ .Prompt }}"))
    tmp = template.with_name("swap.tmp")
    tmp.write_bytes(b"{{ .Suffix }}")
    tmp.rename(template)
    time.sleep(SETTLE)
    assert capabilities() == ["insert"]


def test_manifests_from_the_index_answer_as_parsed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm scan leaves the index's manifests unbuilt (store.index.lazy); each answers as
    the one a fresh scan parses: fields, equality either way round, hash, pickle, repr."""
    import pickle

    from modelfs.store.index.lazy import LazyManifest, LazyManifestList
    from modelfs.store.manifest import Manifest, ManifestList

    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    editor = Editor(tiny, random.Random(1))
    tiny.legacy("a:1", editor.plain())
    lst = tiny.manifest_list([(editor.plain(), "llamacpp", "gguf"), (editor.plain(), "mlx", "")])
    tiny.v2("l:latest", lst)
    time.sleep(SETTLE)
    scan_store(tiny.root, ScanCache.open(tiny.layout))
    warm, fresh = scan_store(tiny.root, ScanCache.open(tiny.layout)), scan_store(tiny.root)
    pairs = [(warm.lookup(n).top, fresh.lookup(n).top) for n in ("a:1", "l:latest")] + [
        (v.manifest, f.manifest)
        for v, f in zip(warm.lookup("l").variants, fresh.lookup("l").variants, strict=True)
    ]
    assert {type(lazy) for lazy, _ in pairs} == {LazyManifest, LazyManifestList}
    for i, (lazy, plain) in enumerate(pairs):
        if i % 2:
            assert plain == lazy and hash(lazy) == hash(plain)
        else:
            assert lazy.raw == plain.raw and lazy.digest == plain.digest
        assert type(lazy) in (Manifest, ManifestList)  # built whole once read
        assert lazy == plain and repr(lazy) == repr(plain)
        assert pickle.loads(pickle.dumps(lazy)) == plain
    assert answer(warm) == answer(fresh)


def test_a_kept_listing_is_not_used_for_another_directory_behind_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk follows links to directories, as Ollama's Glob does; a directory swapped in
    behind one (the link and its folder untouched) is listed, not taken for the one before."""
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    library = tiny.layout.manifests / "registry.ollama.ai" / "library"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    library.rename(elsewhere / "current")
    library.symlink_to(elsewhere / "current")
    tiny.gguf_model("b:1")  # through the link
    (elsewhere / "current" / "b").rename(elsewhere / "b")
    time.sleep(SETTLE)
    cache = ScanCache.open(tiny.layout)
    assert [e.name.shortest for e in scan_store(tiny.root, cache)] == ["a:1"]
    cache.save()
    (elsewhere / "other").mkdir()
    (elsewhere / "b").rename(elsewhere / "other" / "b")
    (elsewhere / "current").rename(elsewhere / "old")
    (elsewhere / "other").rename(elsewhere / "current")
    time.sleep(SETTLE)
    for cached in (cache, ScanCache.open(tiny.layout)):
        assert answer(scan_store(tiny.root, cached)) == answer(scan_store(tiny.root))
        assert [e.name.shortest for e in scan_store(tiny.root, cached)] == ["b:1"]


def test_the_index_is_not_rewritten_while_the_store_is_too_new_to_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved only when something changed: while blobs/ is within the racy margin, its listing
    is not kept, nor what depends on it, and a scan that keeps nothing new writes nothing."""
    monkeypatch.setattr(indexfile, "RACY_NS", RACY_NS)
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("a:1")
    time.sleep(SETTLE)
    scan_store(tiny.root, ScanCache.open(tiny.layout))
    (tiny.layout.blobs / "partial").write_bytes(b"")  # blobs/ changed, as a pull changes it
    monkeypatch.setattr(indexfile, "RACY_NS", 3600 * 10**9)  # and too new to keep from now on
    scan_store(tiny.root, ScanCache.open(tiny.layout))  # the listing kept goes: saved
    index = tiny.layout.state / scancache.FILE_NAME
    saved = index.stat()  # each save renames a new file over it
    for _ in range(2):
        time.sleep(SETTLE)
        scan_store(tiny.root, ScanCache.open(tiny.layout))
    now = index.stat()
    assert (now.st_ino, now.st_mtime_ns) == (saved.st_ino, saved.st_mtime_ns)
