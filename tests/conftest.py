"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.mounting import fuse_available


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (`4m`, `8M`) at `where`: a real disk that fills up; skips the test
    where none can be mounted (not root)."""
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a disk that fills up."""
    with tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `fuse` on a machine without /dev/fuse or fusermount3."""
    if fuse_available():
        return
    skip = pytest.mark.skip(reason="needs /dev/fuse and fusermount3")
    for item in items:
        if item.get_closest_marker("fuse") is not None:
            item.add_marker(skip)
