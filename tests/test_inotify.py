"""runtime/inotify: a store's changes wake the watcher; a store where inotify cannot see
changes (a network or FUSE filesystem) is polled, and the mount still follows it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import trio

from modelfs.runtime.inotify import StoreWatch, WatchError, filesystem_kind
from modelfs.store.names import parse_name
from tests.builders import TinyStore
from tests.mounting import force_unmount, fuse, mounted


def wakes(watch: StoreWatch, change: object = None, timeout: float = 2.0) -> bool:
    """True if `watch.changed()` returns within `timeout` after calling `change()`."""

    async def main() -> bool:
        if callable(change):
            change()
        with trio.move_on_after(timeout):
            await watch.changed()
            return True
        return False

    return trio.run(main)


def test_each_kind_of_change_wakes_it_and_quiet_does_not(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1")
    with StoreWatch(tiny.layout) as watch:
        assert watch.remote is None
        assert not wakes(watch, timeout=0.3)
        # A pull into new host/namespace/model dirs: the new dirs are watched from then on.
        assert wakes(watch, lambda: tiny.gguf_model("other.example/ns/new:1"))
        assert not wakes(watch, timeout=0.3)
        assert wakes(watch, lambda: tiny.gguf_model("other.example/ns/new:2", payload=b"2"))
        # A re-tag that rewrites the manifest file in place.
        path = tiny.layout.legacy_manifest(parse_name("m:1"))
        assert wakes(watch, lambda: path.write_bytes(path.read_bytes()))
        # `ollama rm`, and a blob collected.
        assert wakes(watch, path.unlink)
        blob = next(tiny.layout.blobs.iterdir())
        assert wakes(watch, blob.unlink)
        # A manifests-v2 tree made after the watch began.
        assert wakes(watch, lambda: tiny.layout.manifests_v2.mkdir())
        model = tiny.layout.manifests_v2 / "h" / "ns" / "model"
        assert wakes(watch, lambda: model.mkdir(parents=True))
        assert wakes(watch, lambda: (model / "tag").write_bytes(b"{}"))


def test_a_burst_is_one_wake_up(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    with StoreWatch(tiny.layout) as watch:

        def burst() -> None:
            for i in range(20):
                tiny.gguf_model(f"m{i}:1", payload=str(i).encode())

        assert wakes(watch, burst)
        assert not wakes(watch, timeout=0.3)


def test_the_store_dir_moved_ends_the_watch(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    with StoreWatch(tiny.layout) as watch, pytest.raises(WatchError, match="moved or deleted"):
        wakes(watch, lambda: tiny.root.rename(tmp_path / "elsewhere"))


def test_too_many_dirs_is_a_one_line_error(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    for i in range(5):
        tiny.gguf_model(f"m{i}:1", payload=str(i).encode())
    with pytest.raises(WatchError, match="more than 4 dirs"):
        StoreWatch(tiny.layout, max_watches=4)


@fuse
def test_a_store_on_fuse_is_polled_and_still_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Changes made below a FUSE (or NFS) filesystem reach no inotify watch on it: the mount
    must notice them by polling. bindfs stands in for the network filesystem."""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1")
    seen = tmp_path / "seen"
    seen.mkdir()
    subprocess.run(["bindfs", "-r", str(tiny.root), str(seen)], check=True)
    try:
        assert filesystem_kind(seen) == "fuse"
        assert filesystem_kind(tmp_path) is None
        mnt = tmp_path / "mnt"
        with mounted(seen, mnt, "-v"):
            assert (mnt / "m" / "1" / "model.gguf").exists()
            tiny.gguf_model("new:1", payload=b"behind its back")  # below bindfs, unseen
            deadline = time.monotonic() + 5
            while not (mnt / "new" / "1").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (mnt / "new" / "1" / "model.gguf").read_bytes() == b"behind its back"
            assert "new" in os.listdir(mnt)
        out = capsys.readouterr().out
        assert "store on fuse: changes from other hosts are looked for every 1 s" in out
    finally:
        force_unmount(seen)


def test_a_missing_store_is_not_an_empty_watch(tmp_path: Path) -> None:
    from modelfs.store.layout import Layout

    with pytest.raises(WatchError, match="is missing"):
        StoreWatch(Layout(tmp_path / "nowhere"))


def test_linked_trees_and_a_late_blobs_dir_are_watched(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1")
    # manifests/ on another disk, linked in (the scan follows the link, so must the watch).
    real = tmp_path / "elsewhere"
    tiny.layout.manifests.rename(real)
    tiny.layout.manifests.symlink_to(real)
    blobs_away = tmp_path / "blobs-away"
    tiny.layout.blobs.rename(blobs_away)
    with StoreWatch(tiny.layout) as watch:
        assert wakes(watch, lambda: tiny.legacy("n:1", b"{}"))
        assert not wakes(watch, timeout=0.3)
        assert wakes(watch, lambda: blobs_away.rename(tiny.layout.blobs))
        assert wakes(watch, lambda: (tiny.layout.blobs / ("sha256-" + "0" * 64)).write_bytes(b""))


def test_a_steady_stream_of_events_still_wakes_it(tmp_path: Path) -> None:
    """A download touching its part file every few ms must not hold a wake-up back."""
    tiny = TinyStore(tmp_path / "models")
    part = tiny.layout.blobs / ("sha256-" + "1" * 64 + "-partial-0")
    with StoreWatch(tiny.layout) as watch:

        async def main() -> float:
            async def touch() -> None:
                while True:
                    part.write_bytes(b"{}")  # IN_CLOSE_WRITE every 10 ms
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(touch)
                t0 = trio.current_time()
                with trio.fail_after(3):
                    await watch.changed()
                nursery.cancel_scope.cancel()
            return trio.current_time() - t0

        assert trio.run(main) < 1.5
