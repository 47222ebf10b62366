"""The README's first command, as a user on a machine without Ollama would run it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.mounting import force_unmount, fuse

REPO = Path(__file__).resolve().parents[1]


@fuse
def test_scripts_run_mounts_a_demo_store(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "MODELFS_STORE")}
    env["HOME"] = str(tmp_path / "home")
    try:
        done = subprocess.run(
            [str(REPO / "scripts" / "run"), str(mnt)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        force_unmount(mnt)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "building a demo store" in done.stderr
    assert "gemma4:26b" in done.stdout and "someuser/tiny:q8" in done.stdout
    assert f"$ ls {mnt}" in done.stdout and "model.gguf" in done.stdout
    assert not os.path.ismount(mnt)
