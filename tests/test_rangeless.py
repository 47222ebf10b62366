"""Pulls from a peer that ignores `Range`: a plain web server (`python -m http.server`, or
tests/rangeless_peer.py, its handler sending slowly) in front of a store, as a separate
process on loopback. It answers every GET 200 with the whole blob: a resume, and a large blob
split into parts, go on in one stream, dropping the bytes already on disk, and the whole blob
is hashed as always."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.sync.client.partial import PartialBlob, RangeSet
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.puller import pull
from tests.builders import TinyStore
from tests.rangeless_peer import lay_out
from tests.test_pull import assert_no_manifest, assert_store_sound, tree, weights
from tests.test_pull_hosts import kill_mid_blob, server
from tests.test_pull_hosts import pull as cli_pull

MiB = 1 << 20
SIZE = PullOptions().small_max  # the smallest blob that takes the large-blob path
NAME = "big:1"


def source(root: Path, size: int) -> tuple[TinyStore, bytes, Digest, Path]:
    tiny = TinyStore(root / "a")
    payload = weights(size, 11)
    tiny.gguf_model(NAME, payload)
    return tiny, payload, Digest.of_bytes(payload), lay_out(tiny.root, root / "www", NAME)


@pytest.fixture
def src(tmp_path: Path) -> tuple[TinyStore, bytes, Digest, Path]:
    return source(tmp_path, SIZE)


@contextmanager
def http_server(directory: Path) -> Iterator[str]:
    """Python's own `python -m http.server` (which ignores Range) on a free loopback port."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        found = re.search(r"\((http://[^)]+?)/?\)", line)
        assert found, f"http.server did not start: {line!r} (exit {proc.poll()})"
        yield found.group(1)
    finally:
        proc.kill()
        proc.wait()


def slow_peer(directory: Path, rate: str) -> Iterator[str]:
    return server(
        [
            sys.executable,
            "-m",
            "tests.rangeless_peer",
            "--directory",
            str(directory),
            "--rate",
            rate,
        ]
    )


def plant_partial(b: Layout, payload: bytes, digest: Digest) -> None:
    """What an interrupted parallel pull leaves: finished ranges with a hole between them,
    written and listed the way sync.partial does, by a process that is gone."""
    p = PartialBlob.open(b, digest, len(payload))
    done = [(0, 2 * MiB), (5 * MiB, 6 * MiB)]
    for start, end in done:
        os.pwrite(p.fd, payload[start:end], start)
    p.checkpoint(RangeSet(done))
    p.close()
    p.lock_path.unlink()


def test_a_partial_with_holes_is_finished_from_python_http_server(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest, Path]
) -> None:
    tiny, payload, big, www = src
    b = Layout(tmp_path / "b")
    plant_partial(b, payload, big)
    with http_server(www) as url:
        r = cli_pull(b.root, NAME, "--from", url)
    assert r.returncode == 0, r.stderr
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []


def test_a_partial_is_finished_from_a_chunked_peer_that_ignores_range(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest, Path]
) -> None:
    """Chunked answers go through httpx (sync.fastpath `_receive_httpx_range`), which drops the
    prefix of each whole-blob answer."""
    tiny, payload, big, www = src
    b = Layout(tmp_path / "b")
    plant_partial(b, payload, big)
    argv = [sys.executable, "-m", "tests.rangeless_peer", "--directory", str(www), "--chunked"]
    with server(argv) as url:
        r = cli_pull(b.root, NAME, "--from", url)
    assert r.returncode == 0, r.stderr
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []


def test_a_pull_killed_mid_blob_resumes_from_a_peer_that_ignores_range(tmp_path: Path) -> None:
    # Bytes reach the disk a receive buffer (16 MiB) at a time: a blob of more than one.
    size = 24 * MiB
    tiny, _payload, big, www = source(tmp_path, size)
    b = Layout(tmp_path / "b")
    with slow_peer(www, str(8 * MiB)) as url:
        got = kill_mid_blob(b, big, [NAME, "--from", url], 1)
        assert got < size
        assert not b.blob(big).exists()
        assert_no_manifest(b.root)
        assert f"pull-{big.blob_name}.partial" in assert_store_sound(b.root, killed=True)

        r = cli_pull(b.root, NAME, "--from", url)
    assert r.returncode == 0, r.stderr
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []
    assert not (b.tmp / f"pull-{big.blob_name}.lock").exists()


async def test_a_fresh_large_pull_split_in_parts_stays_one_stream(
    tmp_path: Path, src: tuple[TinyStore, bytes, Digest, Path]
) -> None:
    """A blob at the size from which it is split among connections (`parallel_min`), from a
    slow peer, so that the pull wants more connections: each would ask for a range, which
    this peer answers with the whole blob. The one stream carries it all."""
    tiny, _payload, _big, www = src
    opts = PullOptions(
        parallel_min=SIZE,
        parallel_below=1e12,
        workers=4,
        chunk=MiB,
        checkpoint_every=0.1,
        read_timeout=5.0,
    )
    b = Layout(tmp_path / "b")
    with slow_peer(www, str(4 * MiB)) as url:
        t0 = time.monotonic()
        await pull(b, [NAME], [url], options=opts)
        elapsed = time.monotonic() - t0
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []
    assert elapsed < SIZE / (4 * MiB) * 1.5 + 2  # one pass over the wire, not several
