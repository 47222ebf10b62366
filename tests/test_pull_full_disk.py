"""`modelfs pull A B` onto a disk that fills up: a real 8 MiB tmpfs as the store and a real
`modelfs serve` peer on loopback. The model that does not fit is named with its blob, the
others are still tried, and nothing half-written stays in the store."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from tests.builders import TinyStore
from tests.conftest import tmpfs
from tests.mounting import MODELFS
from tests.test_serve_process import served

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "8M") as mnt:
        yield mnt


def weights(size: int, seed: int) -> bytes:
    return bytes([seed]) * size


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_a_full_disk_costs_only_the_model_that_does_not_fit(
    tmp_path: Path, small_disk: Path
) -> None:
    source = TinyStore(tmp_path / "source")
    big_blob = weights(12 * MiB, 1)  # more than the disk holds: its space cannot be reserved
    source.legacy(
        "big:latest",
        source.manifest([source.layer("model", big_blob), source.layer("license", b"MIT")]),
    )
    source.legacy("small:latest", source.manifest([source.layer("model", weights(MiB, 2))]))
    big_digest = str(Digest.of_bytes(big_blob))

    store = small_disk / "models"
    with served(source.root) as (url, _):
        done = subprocess.run(
            [MODELFS, "pull", "big", "small", "--from", url, "--store", str(store)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        # Again with --json: the small one is here now; the failure is an NDJSON error line.
        again = subprocess.run(
            [MODELFS, "pull", "big", "small", "--from", url, "--store", str(store), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert again.returncode == 1, again.stderr
    events = [json.loads(line) for line in again.stdout.splitlines()]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0].startswith("big: no space left on device"), events
    assert big_digest in errors[0]
    assert {"status": "success"} in events  # small, already whole

    err = done.stderr
    assert done.returncode == 1, err
    assert "Traceback" not in err
    # The failure names the model and the blob, when it happens and in the summary.
    failure = [line for line in err.splitlines() if "no space left on device" in line]
    assert failure and all("big" in line and big_digest in line for line in failure), err
    assert "pulled:     small" in err
    assert "NOT pulled: big" in err
    last = err.strip().splitlines()[-1]
    assert last == "modelfs: error: 1 of 2 models not pulled: big", err

    layout = Layout(store)
    # The small model is whole; the big one left no manifest and no blob of its weights.
    manifests = files_under(layout.manifests)
    assert manifests == {"registry.ollama.ai/library/small/latest"}
    assert not (layout.blobs / f"sha256-{big_digest.removeprefix('sha256:')}").exists()
    # No temp file that is not resumable (a partial is kept only with its sidecar).
    tmp = files_under(layout.tmp) if layout.tmp.exists() else set()
    partials = {p for p in tmp if p.endswith(".partial")}
    assert all(p.removesuffix(".partial") + ".json" in tmp for p in partials), tmp
    assert not any(p.endswith(".lock") for p in tmp), tmp
    assert not [p for p in layout.blobs.iterdir() if not p.name.startswith("sha256-")]

    verify = subprocess.run(
        [MODELFS, "verify", "--store", str(store), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The small model is there to use.
    ls = subprocess.run(
        [MODELFS, "ls", "--store", str(store)], capture_output=True, text=True, timeout=60
    )
    assert "small:latest" in ls.stdout
    assert os.statvfs(store).f_bavail > 0
