"""GC against other hosts' work on one shared store: separate processes with distinct host
ids (MODELFS_HOST_ID), as on an NFS export shared by a cluster."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from modelfs.store.digest import Digest
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.mounting import MODELFS, fuse, mounted
from tests.test_daemon import big_model, complete, wait_until
from tests.test_pull_hosts import _env, fakepeer

MiB = 1 << 20


def gc_as(host: str, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MODELFS, "gc", "--store", str(store), "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "MODELFS_HOST_ID": host},
    )


def test_gc_in_a_tight_loop_on_one_host_never_takes_what_another_is_pulling(
    tmp_path: Path,
) -> None:
    origin = TinyStore(tmp_path / "origin")
    raw = big_model(origin, "big:1", 24 * MiB)
    shared = TinyStore(tmp_path / "shared")
    # Blobs of the model already here, old and named by no manifest yet: the pull needs them,
    # and only its lease says so.
    manifest = json.loads(raw)
    for layer in manifest["layers"][1:]:
        data = origin.layout.blob(Digest.parse(layer["digest"])).read_bytes()
        d = shared.blob(data)
        old = time.time() - 7200
        os.utime(shared.layout.blob(d), (old, old))
    junk = shared.blob(b"an orphan GC may take")
    os.utime(shared.layout.blob(junk), (time.time() - 7200,) * 2)

    with fakepeer(origin.root, "throttle=6M") as url:
        puller = subprocess.Popen(
            [MODELFS, "pull", "--store", str(shared.root), "--from", url, "big:1", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**_env(), "MODELFS_HOST_ID": "host-a"},
        )
        # Until the pull's lease is on disk nothing says these blobs are wanted, and GC at
        # --grace 0 may take them (the pull then fetches them again). The claim is about the
        # pull under way: from its lease on, GC takes none of them.
        lease = shared.layout.leases / f"host-a.{puller.pid}.pull.json"
        first = manifest["layers"][1]["digest"]

        def leased() -> bool:
            try:
                return first in lease.read_text()
            except FileNotFoundError:
                return False

        wait_until(lambda: leased() or puller.poll() is not None, 30)
        runs, trashed = 0, []
        while puller.poll() is None:
            r = gc_as(
                "host-b",
                shared.root,
                "--grace",
                "0",
                "--grace-below-floor",
                "--trash-retention",
                "0",
            )
            assert r.returncode == 0, r.stderr
            report = json.loads(r.stdout)
            trashed += [i["digest"] for i in report["trashed"]]
            runs += 1
        _, err = puller.communicate()
    assert puller.returncode == 0, err
    assert runs >= 3, "the pull ended before GC had a chance to run twice"
    assert str(junk) in trashed  # GC did collect meanwhile
    needed = {layer["digest"] for layer in manifest["layers"]} | {manifest["config"]["digest"]}
    assert not needed & set(trashed)
    assert complete(shared.root, "big:1")


@fuse
def test_a_reader_on_one_host_keeps_its_blob_while_another_host_collects(
    tmp_path: Path,
) -> None:
    store = TinyStore(tmp_path / "store")
    payload = hashlib.sha256(b"w").digest() * (4 * MiB // 32)
    raw = store.gguf_model("reader:1", payload)
    digest = Digest.parse(json.loads(raw)["layers"][0]["digest"])
    for name in os.listdir(store.layout.blobs):
        os.utime(store.layout.blobs / name, (time.time() - 7200,) * 2)
    mnt = tmp_path / "mnt"
    env = {**os.environ, "MODELFS_HOST_ID": "reader-host"}
    with mounted(store.root, mnt, env=env):
        path = mnt / "reader" / "1" / "model.gguf"
        with open(path, "rb") as f:
            head = f.read(len(payload) // 2)
            # The tag goes (`ollama rm` on some host); GC runs on another host, twice.
            os.unlink(store.layout.legacy_manifest(scan_store(store.root).lookup("reader:1").name))
            for _ in range(2):
                r = gc_as(
                    "gc-host",
                    store.root,
                    "--grace",
                    "0",
                    "--grace-below-floor",
                    "--trash-retention",
                    "0",
                )
                assert r.returncode == 0, r.stderr
                report = json.loads(r.stdout)
                assert str(digest) in [i["digest"] for i in report["leased"]]
            assert store.layout.blob(digest).exists()
            rest = f.read()
        assert head + rest == payload
        # Closed: the lease lets go, and two more passes collect it.
        wait_until(
            lambda: all(
                str(digest) not in p.read_text() for p in store.layout.leases.glob("*.json")
            ),
            10,
            "the lease to drop the blob",
        )
        for _ in range(2):
            assert (
                gc_as("gc-host", store.root, "--grace", "0", "--grace-below-floor").returncode == 0
            )
        assert not store.layout.blob(digest).exists()
