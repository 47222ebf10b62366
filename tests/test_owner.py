"""Run as root on a store owned by another user (Ollama's service user), every file and
directory modelfs creates belongs to that user, so the service can go on writing."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.builders import TinyStore
from tests.mounting import MODELFS, fuse, mounted
from tests.test_daemon import wait_until
from tests.test_pull_hosts import _env, fakepeer

OLLAMA_UID = OLLAMA_GID = 4321

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")


def foreign_owned(root: Path) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            st = os.lstat(p)
            if (st.st_uid, st.st_gid) != (OLLAMA_UID, OLLAMA_GID):
                bad.append(f"{p.relative_to(root)} ({st.st_uid}:{st.st_gid})")
    return bad


def run(*argv: str) -> None:
    r = subprocess.run([MODELFS, *argv], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr


@fuse
def test_what_root_creates_in_a_users_store_is_that_users(tmp_path: Path) -> None:
    origin = TinyStore(tmp_path / "origin")
    origin.gguf_model("someuser/m:1", b"weights")
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, OLLAMA_UID, OLLAMA_GID)
    with fakepeer(origin.root) as url:
        run("pull", "--store", str(store), "--from", url, "someuser/m:1")
    run("gc", "--store", str(store), "--grace", "0", "--grace-below-floor")
    (store / "blobs" / f"sha256-{'ab' * 32}").write_bytes(b"orphan")
    os.chown(store / "blobs" / f"sha256-{'ab' * 32}", OLLAMA_UID, OLLAMA_GID)
    os.utime(store / "blobs" / f"sha256-{'ab' * 32}", (time.time() - 7200,) * 2)
    run("gc", "--store", str(store), "--grace", "0", "--grace-below-floor")
    run("gc", "--store", str(store), "--grace", "0", "--grace-below-floor")  # into the trash
    run("verify", "--store", str(store))
    with (
        mounted(store, tmp_path / "mnt"),
        open(tmp_path / "mnt" / "someuser" / "m" / "1" / "model.gguf", "rb") as f,
    ):
        f.read()
        wait_until(lambda: list((store / ".modelfs" / "leases").glob("*.json")), 10)
        assert foreign_owned(store) == [], foreign_owned(store)
    assert list((store / ".modelfs" / "trash").glob("*/*"))
    assert foreign_owned(store) == []


def test_write_atomic_keeps_the_old_bytes_and_no_temp_on_a_full_disk(tiny_fs: Path) -> None:
    from modelfs.store.disk.owner import write_atomic

    target = tiny_fs / "state" / "state.json"
    write_atomic(target, b"old", tiny_fs)
    with pytest.raises(OSError):
        write_atomic(target, b"x" * (8 << 20), tiny_fs)  # more than the 4 MiB disk
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]
