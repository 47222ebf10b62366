"""Real mounts in a subprocess, always unmounted in teardown (pyfuse3's test pattern)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.processes import stop

MODELFS = str(Path(sys.executable).with_name("modelfs"))


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


# Every test that mounts carries this marker, so that `pytest -m "not fuse"` leaves them out;
# where FUSE is missing, tests/conftest.py skips them.
fuse = pytest.mark.fuse


def wait_for_mount(proc: subprocess.Popen[bytes], mnt: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"mount exited with {proc.returncode}: {out}")
        if os.path.ismount(mnt):
            return
        time.sleep(0.05)
    raise AssertionError(f"{mnt} not mounted after {timeout} s")


def force_unmount(mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


@contextmanager
def mounted(
    store: Path, mnt: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Mount `store` on `mnt` with `modelfs mount`; unmount and reap it however the test ends."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [MODELFS, "mount", "--store", str(store), str(mnt), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_for_mount(proc, mnt)
        yield proc
    finally:
        stop(proc)
        if os.path.ismount(mnt):
            force_unmount(mnt)
        # Late log lines belong to this test's output.
        if proc.stdout is not None:
            sys.stdout.write(proc.stdout.read().decode(errors="replace"))
