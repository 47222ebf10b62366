"""`sync.pull` in-process against tests/fakepeer.py on loopback (the client side).

Each test builds a source store, serves it with `FakePeer` in a thread (a real HTTP server on
127.0.0.1) and pulls into an empty store with `sync.pull.pull` under trio. Faults are the
peer's: flipped bytes, truncated bodies, lying lengths, stalls, 5xx, 401, 404. After every
failure the target store is checked: no blob in `blobs/` that does not hash to its name, no
manifest, and in `.modelfs/tmp/` nothing but a resumable `.partial` + `.json` pair.

Blobs take one of two paths by size, and most fault tests run on both: SMALL (whole body
through httpx) and LARGE (ranged GETs on raw sockets in threads, several at once, a sidecar).
LARGE shrinks the thresholds so a 3 MiB blob goes in 256 KiB ranges over three connections.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from modelfs.demo import GEMMA, build_demo_store
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.layout import Layout
from modelfs.store.listtag import anchor_bytes
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST, ManifestList, parse_manifest
from modelfs.store.names import parse_name
from modelfs.store.scan import rank_children, scan_store
from modelfs.sync.client.credentials import Credentials, CredentialsError, read_credentials
from modelfs.sync.client.partial import PartialBlob, RangeSet, split
from modelfs.sync.errors import (
    LocalWriteError,
    PeerAuthError,
    PeerError,
    PeerLiedError,
    PeerNotFoundError,
    PeerUnreachableError,
)
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.puller import pull
from tests.builders import TinyStore
from tests.fakepeer import FakePeer, Fault

KiB, MiB = 1 << 10, 1 << 20

SMALL = PullOptions(read_timeout=1.0)
LARGE = PullOptions(
    read_timeout=1.0,
    small_max=64 * KiB,
    parallel_min=1 * MiB,
    workers=3,
    chunk=256 * KiB,
    checkpoint_every=0.05,
)
PATHS = pytest.mark.parametrize("opts", [SMALL, LARGE], ids=["small", "large"])


# -- helpers ----------------------------------------------------------------------------------
def weights(n: int, seed: int = 0) -> bytes:
    """Deterministic incompressible bytes."""
    out = bytearray()
    block = hashlib.sha256(f"{seed}".encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def source_store(root: Path, size: int = 3 * MiB) -> tuple[TinyStore, bytes, Digest]:
    """`llama3.2:3b`: a `size`-byte model blob plus template, license and config."""
    tiny = TinyStore(root)
    payload = weights(size)
    raw = tiny.gguf_model("llama3.2:3b", payload)
    return tiny, raw, Digest.of_bytes(payload)


def tree(root: Path) -> dict[str, Any]:
    """Every file and link under a store root but `.modelfs/`: bytes, or `-> target`."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir.parts[:1] == (".modelfs",):
            continue
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            path = Path(dirpath) / name
            rel = str(rel_dir / name)
            if rel.startswith(".modelfs"):
                continue
            out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes()
    return out


def assert_store_sound(root: Path, *, resumable_ok: bool = True, killed: bool = False) -> list[str]:
    """No wrong blob, nothing ours but resumable pairs in tmp (and, after a kill -9, the dead
    process's lock); returns tmp's file names."""
    layout = Layout(root)
    if layout.blobs.is_dir():
        for entry in layout.blobs.iterdir():
            assert is_blob_name(entry.name), entry
            assert not entry.is_symlink()
            assert hashlib.sha256(entry.read_bytes()).hexdigest() == entry.name[7:], entry
    # tmp/links/v2/ is where manifests-v2 links are made: it stays, and holds nothing.
    if layout.links.is_dir():
        assert list(layout.links.iterdir()) == []
    scratch = layout.links.parent
    left = []
    if layout.tmp.is_dir():
        left = sorted(p.name for p in layout.tmp.iterdir() if p != scratch)
    stems = {n.rsplit(".", 1)[0] for n in left}
    for stem in stems:
        assert stem.startswith("pull-sha256-"), left
        assert resumable_ok, left
        ours = sorted(n for n in left if n.startswith(stem + "."))
        expected = [f"{stem}.json", f"{stem}.lock", f"{stem}.partial"]
        if not killed:
            expected.remove(f"{stem}.lock")
        assert ours == expected, left
    return left


def assert_no_manifest(root: Path) -> None:
    for sub in ("manifests", "manifests-v2"):
        d = root / sub
        if d.exists():
            files = [p for p in d.rglob("*") if not p.is_dir() or p.is_symlink()]
            assert files == [], files


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def src(tmp_path: Path) -> tuple[TinyStore, bytes, Digest]:
    return source_store(tmp_path / "a")


@pytest.fixture
def peer(src: tuple[TinyStore, bytes, Digest]) -> Iterator[FakePeer]:
    with FakePeer(src[0].root) as p:
        yield p


# -- pure parts -------------------------------------------------------------------------------
def test_rangeset_merges_and_reports_gaps() -> None:
    r = RangeSet()
    r.add(10, 20)
    r.add(0, 5)
    r.add(5, 10)
    r.add(30, 40)
    assert r.as_list() == [[0, 20], [30, 40]]
    assert r.prefix() == 20
    assert r.total() == 30
    assert r.missing(50) == [(20, 30), (40, 50)]
    r.add(15, 35)
    assert r.as_list() == [[0, 40]]
    assert RangeSet().missing(7) == [(0, 7)]
    assert RangeSet([(3, 5)]).prefix() == 0
    assert split([(0, 10), (20, 25)], 4) == [(0, 4), (4, 8), (8, 10), (20, 24), (24, 25)]


def test_rank_children_by_prefer(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "demo")
    lst = parse_manifest(demo.lists[GEMMA].raw, "list")
    assert isinstance(lst, ManifestList)
    assert rank_children(lst, ("llamacpp", "ggml", "mlx"))[0] == 0
    assert rank_children(lst, ("mlx", "llamacpp"))[0] == 1
    assert rank_children(lst, ("cuda",))[0] == 0  # none preferred: list order
    assert rank_children(lst, ("mlx",)) == [1, 0]  # all, best first


def test_anchor_is_the_demo_stores(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "demo")
    child = demo.manifests[f"{GEMMA}@llamacpp"]
    refs = [
        (
            MEDIA_MANIFEST,
            demo.manifests[f"{GEMMA}@{r}"].digest,
            len(demo.manifests[f"{GEMMA}@{r}"].raw),
        )
        for r in ("llamacpp", "mlx")
    ]
    assert anchor_bytes(child.raw, demo.lists[GEMMA].raw, refs) == demo.anchors[GEMMA].raw


# -- whole pulls ------------------------------------------------------------------------------
@PATHS
async def test_plain_manifest_byte_identical(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest], peer: FakePeer, opts: PullOptions
) -> None:
    tiny, raw, big = src
    t0 = time.time()
    report = await pull(Layout(tmp_path / "b"), ["llama3.2:3b"], [peer.url], options=opts)
    b = tmp_path / "b"
    assert tree(b) == tree(tiny.root)
    legacy = b / "manifests/registry.ollama.ai/library/llama3.2/3b"
    assert legacy.read_bytes() == raw
    assert oct(legacy.stat().st_mode & 0o777) == "0o644"
    # Fresh mtimes: Ollama's startup prune spares blobs younger than an hour.
    assert Layout(b).blob(big).stat().st_mtime >= t0 - 1
    assert assert_store_sound(b) == []
    [model] = report.models
    assert model.name == "llama3.2:3b" and model.digest == Digest.of_bytes(raw)
    assert model.fetched == 4 and model.present == 0 and model.avoided == {}
    assert model.written == ["manifests/registry.ollama.ai/library/llama3.2/3b"]
    if opts is LARGE:
        # On loopback one connection outruns the hash: one GET, no company.
        ranges = [r["range"] for r in peer.blob_requests(big.hex)]
        assert ranges == [f"bytes=0-{3 * MiB - 1}"]


async def test_list_pull_takes_preferred_child_and_writes_anchor(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "a")
    with FakePeer(demo.root) as peer:
        await pull(Layout(tmp_path / "b"), [GEMMA], [peer.url], options=SMALL)
    b = Layout(tmp_path / "b")
    the_list = demo.lists[GEMMA]
    gguf, mlx = demo.manifests[f"{GEMMA}@llamacpp"], demo.manifests[f"{GEMMA}@mlx"]
    link = b.v2_manifest(parse_name(GEMMA))
    assert os.readlink(link) == f"../../../../blobs/{the_list.digest.blob_name}"
    assert link.read_bytes() == the_list.raw
    assert b.blob(gguf.digest).read_bytes() == gguf.raw
    assert not b.blob(mlx.digest).exists()
    for layer in gguf.layers:
        assert b.blob(layer.digest).exists()
    assert not any(b.blob(layer.digest).exists() for layer in mlx.layers if layer.name)
    anchor = b.legacy_manifest(parse_name(GEMMA)).read_bytes()
    assert anchor == anchor_bytes(
        gguf.raw, the_list.raw, [(MEDIA_MANIFEST, gguf.digest, len(gguf.raw))]
    )
    refs = json.loads(anchor)["layers"][-2:]
    assert [r["mediaType"] for r in refs] == [MEDIA_LIST, MEDIA_MANIFEST]
    index = scan_store(b)
    entry = index.lookup(GEMMA)
    assert entry.source == "v2" and [v.runner for v in entry.variants] == ["llamacpp"]
    assert [p for p in index.problems if p.kind != "stray"] == []


async def test_all_variants_of_everything_is_the_source_byte_for_byte(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "a")
    with FakePeer(demo.root) as peer:
        await pull(
            Layout(tmp_path / "b"),
            list(demo.names),
            [peer.url],
            options=PullOptions(all_variants=True),
        )
    # The demo store holds both children and `gemma4:26b-mlx`, as such a pull writes them.
    assert tree(tmp_path / "b") == tree(demo.root)


async def test_prefer_mlx_pulls_only_mlx(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "a")
    with FakePeer(demo.root) as peer:
        await pull(
            Layout(tmp_path / "b"), [GEMMA], [peer.url], options=PullOptions(prefer=("mlx",))
        )
    b = Layout(tmp_path / "b")
    entry = scan_store(b).lookup(GEMMA)
    assert [v.runner for v in entry.variants] == ["mlx"]
    anchor = json.loads(b.legacy_manifest(parse_name(GEMMA)).read_bytes())
    assert anchor["runner"] == "mlx"


@PATHS
async def test_present_blobs_are_not_fetched_and_wrong_sizes_are_replaced(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest], peer: FakePeer, opts: PullOptions
) -> None:
    tiny, _raw, big = src
    b = Layout(tmp_path / "b")
    await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    inodes = {p.name: p.stat().st_ino for p in b.blobs.iterdir()}
    peer.requests.clear()
    report = await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    assert peer.blob_requests() == []
    assert report.models[0].present == 4 and report.models[0].fetched == 0
    assert {p.name: p.stat().st_ino for p in b.blobs.iterdir()} == inodes
    # A blob of the wrong length (a truncated copy) counts as missing and is renamed over.
    path = b.blob(big)
    path.write_bytes(path.read_bytes()[:1000])
    await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    assert path.stat().st_ino != inodes[path.name]
    assert tree(b.root) == tree(tiny.root)
    assert [r["digest"] for r in peer.blob_requests()] == [big.hex] * len(peer.blob_requests())


async def test_case_insensitive_name_keeps_the_store_spelling(
    tmp_path: Path, peer: FakePeer
) -> None:
    b = Layout(tmp_path / "b")
    await pull(b, ["llama3.2:3b"], [peer.url])
    report = await pull(b, ["LLAMA3.2:3B"], [peer.url])
    assert report.models[0].written == ["manifests/registry.ollama.ai/library/llama3.2/3b"]
    assert len(list((b.manifests / "registry.ollama.ai/library").iterdir())) == 1


# -- manifest failures ------------------------------------------------------------------------
async def test_manifest_errors_name_the_peer(tmp_path: Path, peer: FakePeer) -> None:
    b = Layout(tmp_path / "b")
    with pytest.raises(PeerNotFoundError, match=r"404.*nosuch:1 not found") as e:
        await pull(b, ["nosuch:1"], [peer.url])
    assert peer.url in str(e.value)
    dead = closed_port_url()
    with pytest.raises(PeerUnreachableError, match="cannot connect") as e:
        await pull(b, ["llama3.2:3b"], [dead])
    assert dead in str(e.value)
    peer.faults.append(Fault.parse("status=401@manifest"))
    with pytest.raises(PeerAuthError, match="401") as e:
        await pull(b, ["llama3.2:3b"], [peer.url])
    assert peer.url in str(e.value)
    peer.faults[:] = [Fault.parse("bad-digest@manifest")]
    with pytest.raises(PeerLiedError, match="Docker-Content-Digest") as e:
        await pull(b, ["llama3.2:3b"], [peer.url])
    assert peer.url in str(e.value)
    assert_no_manifest(b.root)
    assert assert_store_sound(b.root) == []


async def test_manifest_fails_over_and_error_names_every_peer(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest], peer: FakePeer
) -> None:
    b = Layout(tmp_path / "b")
    dead = closed_port_url()
    report = await pull(b, ["llama3.2:3b"], [dead, peer.url])
    assert report.models[0].fetched == 4
    with pytest.raises(PeerNotFoundError) as e:
        await pull(b, ["nosuch:1"], [peer.url, dead])
    assert peer.url in str(e.value) and dead in str(e.value)
    assert "\n" not in str(e.value)


# -- blob faults ------------------------------------------------------------------------------
LYING = ["flip", "truncate", "short-length", "long-length"]


@PATHS
@pytest.mark.parametrize("fault", LYING)
async def test_a_lying_peer_is_named_and_nothing_bad_lands(
    tmp_path: Path,
    src: tuple[TinyStore, bytes, Digest],
    peer: FakePeer,
    opts: PullOptions,
    fault: str,
) -> None:
    _tiny, _raw, big = src
    peer.faults.append(Fault.parse(f"{fault}@{big.hex[:12]}"))
    b = Layout(tmp_path / "b")
    with pytest.raises(PeerLiedError) as e:
        await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    message = str(e.value)
    assert peer.url in message and str(big) in message and "\n" not in message
    assert_no_manifest(b.root)
    assert not b.blob(big).exists()
    left = assert_store_sound(b.root)
    if fault == "flip":
        assert left == []  # every byte is suspect: deleted
    # Not used again for that blob: one try only (a transient error gets two).
    gets = [r for r in peer.blob_requests(big.hex) if r["method"] == "GET"]
    if opts is SMALL:
        assert len(gets) == 1


@PATHS
@pytest.mark.parametrize("fault", [*LYING, "status=500", "drop", "stall", "status=404"])
async def test_failover_to_a_good_peer(
    tmp_path: Path,
    src: tuple[TinyStore, bytes, Digest],
    opts: PullOptions,
    fault: str,
) -> None:
    tiny, _raw, big = src
    with (
        FakePeer(tiny.root, [f"{fault}@{big.hex[:12]}"]) as bad,
        FakePeer(tiny.root) as good,
    ):
        b = Layout(tmp_path / "b")
        report = await pull(b, ["llama3.2:3b"], [bad.url, good.url], options=opts)
        assert tree(b.root) == tree(tiny.root)
        assert assert_store_sound(b.root) == []
        avoided = report.models[0].avoided
        if fault in LYING:
            assert list(avoided) == [bad.url] and str(big) in avoided[bad.url]
        else:
            assert avoided == {}
        assert good.blob_requests(big.hex)


@PATHS
@pytest.mark.parametrize("fault", ["status=500", "status=401", "status=404", "drop", "stall"])
async def test_transport_faults_fail_with_one_line_and_stay_resumable(
    tmp_path: Path,
    src: tuple[TinyStore, bytes, Digest],
    peer: FakePeer,
    opts: PullOptions,
    fault: str,
) -> None:
    tiny, _raw, big = src
    peer.faults.append(Fault.parse(f"{fault}@{big.hex[:12]}"))
    b = Layout(tmp_path / "b")
    expected = {
        "status=500": PeerError,
        "status=401": PeerAuthError,
        "status=404": PeerNotFoundError,
        "drop": PeerError,
        "stall": PeerUnreachableError,
    }[fault]
    t0 = time.monotonic()
    with pytest.raises(expected) as e:
        await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    assert time.monotonic() - t0 < 15
    assert peer.url in str(e.value) and "\n" not in str(e.value)
    assert_no_manifest(b.root)
    left = assert_store_sound(b.root)
    if fault == "stall" and opts is LARGE:
        assert left  # half a range arrived before the stall: kept for a resume
    # With the fault gone, the same pull finishes, fetching only what is missing.
    peer.faults.clear()
    peer.requests.clear()
    await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []
    if fault == "stall" and opts is LARGE:
        # Bytes that came before the stalls (half, then half the rest on the second try)
        # are not asked for again.
        assert [r["range"] for r in peer.blob_requests(big.hex)] == [
            f"bytes={3 * MiB * 3 // 4}-{3 * MiB - 1}"
        ]


async def test_chunked_answers_go_through_httpx(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest]
) -> None:
    tiny, _raw, big = src
    with FakePeer(tiny.root, [f"chunked@{big.hex[:12]}"]) as peer:
        await pull(Layout(tmp_path / "b"), ["llama3.2:3b"], [peer.url], options=LARGE)
    assert tree(tmp_path / "b") == tree(tiny.root)


async def test_token_is_sent_and_a_missing_one_is_a_clear_error(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest]
) -> None:
    tiny, _raw, _big = src
    with FakePeer(tiny.root, token="s3cret") as peer:
        with pytest.raises(PeerAuthError, match="401") as e:
            await pull(Layout(tmp_path / "b"), ["llama3.2:3b"], [peer.url])
        assert peer.url in str(e.value)
        await pull(
            Layout(tmp_path / "b"),
            ["llama3.2:3b"],
            [peer.url],
            options=LARGE,
            credentials=Credentials("s3cret"),
        )
    assert tree(tmp_path / "b") == tree(tiny.root)


# -- interruption and resume ------------------------------------------------------------------
async def test_cancelled_pull_resumes_from_the_sidecar(tmp_path: Path) -> None:
    tiny, _raw, big = source_store(tmp_path / "a", size=4 * MiB)
    b = Layout(tmp_path / "b")
    opts = PullOptions(
        small_max=64 * KiB,
        parallel_min=64 * MiB,
        chunk=4 * MiB,
        checkpoint_every=0.05,
    )
    with FakePeer(tiny.root, [f"throttle=4M@{big.hex[:12]}"]) as peer:
        with trio.move_on_after(0.6):
            await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
        left = assert_store_sound(b.root)
        assert left == [f"pull-{big.blob_name}.json", f"pull-{big.blob_name}.partial"]
        done = json.loads((b.tmp / left[0]).read_bytes())["done"]
        assert done and done[0][0] == 0 and 0 < done[0][1] < 4 * MiB
        assert_no_manifest(b.root)
        # A peer that refuses the resume (401, a token changed) leaves the partial alone.
        peer.faults[:] = [Fault.parse(f"status=401@{big.hex[:12]}")]
        with pytest.raises(PeerAuthError, match="401"):
            await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
        assert sorted(os.listdir(b.tmp)) == left
        assert json.loads((b.tmp / left[0]).read_bytes())["done"] == done
        peer.faults.clear()
        peer.requests.clear()
        await pull(b, ["llama3.2:3b"], [peer.url], options=opts)
    [get] = peer.blob_requests(big.hex)
    assert get["range"] == f"bytes={done[0][1]}-{4 * MiB - 1}"
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []


async def test_a_resumed_prefix_that_was_wrong_is_fetched_again(tmp_path: Path) -> None:
    tiny, _raw, big = source_store(tmp_path / "a")
    b = Layout(tmp_path / "b")
    # An earlier run left 1 MiB of garbage that its sidecar claims is done.
    p = PartialBlob.open(b, big, 3 * MiB)
    os.pwrite(p.fd, b"\0" * MiB, 0)
    p.checkpoint(RangeSet([(0, MiB)]))
    p.close()
    p.lock_path.unlink()
    with FakePeer(tiny.root) as peer:
        report = await pull(b, ["llama3.2:3b"], [peer.url], options=LARGE)
    assert report.models[0].avoided == {}
    assert tree(b.root) == tree(tiny.root)
    ranges = [r["range"] for r in peer.blob_requests(big.hex)]
    assert ranges == [f"bytes={MiB}-{3 * MiB - 1}", f"bytes=0-{3 * MiB - 1}"]


async def test_a_live_lock_is_waited_for_and_a_dead_one_taken_over(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest], peer: FakePeer
) -> None:
    tiny, _raw, big = src
    b = Layout(tmp_path / "b")
    b.tmp.mkdir(parents=True)
    lock = b.tmp / f"pull-{big.blob_name}.lock"
    holder = subprocess.Popen(["sleep", "1.5"])  # noqa: ASYNC220
    try:
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        t0 = time.monotonic()
        await pull(b, ["llama3.2:3b"], [peer.url], options=LARGE)
        # The holder died without removing its lock: stale, taken over.
        assert time.monotonic() - t0 > 1.0
    finally:
        holder.kill()
        holder.wait()
    assert tree(b.root) == tree(tiny.root)
    assert not lock.exists()


# -- a full disk ------------------------------------------------------------------------------
@PATHS
async def test_full_disk_fails_cleanly(tmp_path: Path, tiny_fs: Path, opts: PullOptions) -> None:
    # Three 2 MiB blobs into 4 MiB: the small path fails on a write, the large path when it
    # reserves the space; either way nothing is promoted and nothing half-made is kept.
    tiny = TinyStore(tmp_path / "a")
    layers = [tiny.layer("model", weights(2 * MiB, i)) for i in range(3)]
    tiny.legacy("big:1", tiny.manifest(layers))
    store = tiny_fs / "models"
    store.mkdir()
    with (
        FakePeer(tiny.root) as peer,
        pytest.raises(LocalWriteError, match="no space left on device") as e,
    ):
        await pull(Layout(store), ["big:1"], [peer.url], options=opts)
    assert str(store) in str(e.value)
    assert_no_manifest(store)
    assert_store_sound(store)  # a blob cut off mid-way may stay resumable


async def test_a_slow_connection_gets_company(tmp_path: Path) -> None:
    """Behind a per-connection limit, more connections join, each taking chunk-sized ranges
    cut from the far end of the first one's; the hash still runs in order."""
    tiny, _raw, big = source_store(tmp_path / "a", size=24 * MiB)
    opts = PullOptions(
        small_max=64 * KiB,
        parallel_min=MiB,
        parallel_below=1e12,
        workers=4,
        chunk=MiB,
        checkpoint_every=0.1,
    )
    with FakePeer(tiny.root, [f"throttle=4M@{big.hex[:12]}"]) as peer:
        t0 = time.monotonic()
        await pull(Layout(tmp_path / "b"), ["llama3.2:3b"], [peer.url], options=opts)
        elapsed = time.monotonic() - t0
    ranges = [r["range"] for r in peer.blob_requests(big.hex)]
    assert ranges[0] == f"bytes=0-{24 * MiB - 1}"  # first, one GET for all of it
    assert len(ranges) > 4  # then chunk-sized ranges on more connections
    assert elapsed < 24 * MiB / 4e6 * 0.8  # faster than one throttled connection
    assert tree(tmp_path / "b") == tree(tiny.root)
    assert assert_store_sound(tmp_path / "b") == []


async def test_a_plain_manifest_over_a_v2_entry_moves_the_v2_link(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest], peer: FakePeer
) -> None:
    """v2 hides legacy: a pulled plain manifest must not be hidden by an older v2 entry."""
    _tiny, raw, _big = src
    b = TinyStore(tmp_path / "b")
    old = b.manifest([b.layer("model", b"old weights")])
    b.v2("llama3.2:3b", old)
    report = await pull(b.layout, ["llama3.2:3b"], [peer.url])
    name = parse_name("llama3.2:3b")
    assert b.layout.legacy_manifest(name).read_bytes() == raw
    assert b.layout.v2_manifest(name).read_bytes() == raw
    assert os.readlink(b.layout.v2_manifest(name)).endswith(Digest.of_bytes(raw).blob_name)
    assert report.models[0].written == [
        "manifests/registry.ollama.ai/library/llama3.2/3b",
        "manifests-v2/ollama.com/library/llama3.2/3b",
    ]
    assert scan_store(b.layout).lookup("llama3.2:3b").digest == Digest.of_bytes(raw)


def test_progress_renderers() -> None:
    import io
    import logging

    from modelfs.cli.progress import BarProgress, JsonProgress, LineProgress

    d = Digest("ab" * 32)
    out = io.StringIO()
    p = JsonProgress(out, interval=60)
    p.status("m:1", "pulling manifest")
    p.blob("m:1", d, 100, 0)
    p.blob("m:1", d, 100, 50)  # within the interval: not sent
    p.blob("m:1", d, 100, 100)  # complete: always sent
    p.status("m:1", "verifying sha256 digest")
    p.done("m:1")
    p.error("boom")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {"status": "pulling manifest"},
        {"status": "pulling abababababab", "digest": str(d), "total": 100, "completed": 0},
        {"status": "pulling abababababab", "digest": str(d), "total": 100, "completed": 100},
        {"status": "verifying sha256 digest"},
        {"status": "success"},
        {"error": "boom"},
    ]

    tty = io.StringIO()
    bar = BarProgress(tty, interval=0)
    bar.status("m:1", "pulling manifest")
    bar.blob("m:1", d, 2_000_000, 1_000_000)
    bar.done("m:1")
    text = tty.getvalue()
    assert "m:1" in text and "50%" in text and "█" in text and text.endswith("\n")
    assert "\r\x1b[2K" in text

    records: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test-progress")
    logger.addHandler(Catch())
    logger.setLevel(logging.INFO)
    lp = LineProgress(logger, interval=0)
    lp.status("m:1", "pulling manifest")
    lp.blob("m:1", d, 100, 40)
    lp.done("m:1")
    assert records[0] == "m:1: pulling manifest"
    assert any("40%" in r for r in records)
    assert records[-1].startswith("m:1: success")


async def test_children_the_peer_lacks_are_skipped(tmp_path: Path) -> None:
    """B pulled only gemma4's llamacpp child; C asks B for all variants, or for mlx first."""
    demo = build_demo_store(tmp_path / "a")
    b, c, d = (Layout(tmp_path / x) for x in "bcd")
    with FakePeer(demo.root) as peer_a:
        await pull(b, [GEMMA], [peer_a.url])
    with FakePeer(b.root) as peer_b:
        await pull(c, [GEMMA], [peer_b.url], options=PullOptions(all_variants=True))
        await pull(d, [GEMMA], [peer_b.url], options=PullOptions(prefer=("mlx", "llamacpp")))
    assert tree(c.root) == tree(b.root) == tree(d.root)


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (b"  t0ken-abc\n", "Bearer t0ken-abc"),
        (b"me:pa ss\n", "Basic " + base64.b64encode(b"me:pa ss").decode()),
        (b"", "is empty"),
        (b"one\ntwo\n", "expected one line"),
        (b"two words", "printable ASCII"),
        (b":nouser", "expected user:password"),
        (b"\xff\xfe", "not UTF-8"),
        (b"x" * 2000, "larger than 1024 bytes"),
    ],
)
def test_one_reader_for_every_token_file(tmp_path: Path, content: bytes, expect: str) -> None:
    """serve, pull, push, verify --repair-from, status and the daemon read token files here."""
    path = tmp_path / "token"
    path.write_bytes(content)
    if expect.startswith(("Bearer ", "Basic ")):
        credentials = read_credentials(path)
        assert credentials.authorization == expect
        assert credentials.secret not in repr(credentials)
    else:
        with pytest.raises(CredentialsError) as e:
            read_credentials(path)
        assert expect in str(e.value) and str(path) in str(e.value)
    with pytest.raises(CredentialsError, match="cannot read token file"):
        read_credentials(tmp_path / "missing")
