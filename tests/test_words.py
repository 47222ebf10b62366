"""One word for one thing, and a way on from every dead end: what `ls`, `show`, `verify`,
`mount`, `demo-store` and `--version` say, as real processes."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from modelfs.store.layout import SYSTEM_STORE
from modelfs.store.units import human_bytes
from tests.builders import TinyStore
from tests.mounting import MODELFS, force_unmount, fuse, mounted, wait_for_mount
from tests.test_cli import modelfs

REPO = Path(__file__).resolve().parents[1]
STRAY_LINE = "1 stray file in the store; `modelfs verify` names it"


def test_a_stray_file_has_one_name_and_one_hint_in_ls_show_and_verify(tmp_path: Path) -> None:
    """A `.DS_Store` among the tags is a stray to `ls` and `show` as to `verify` and `gc`, and
    the hint names the command that names it."""
    s = TinyStore(tmp_path / "s")
    s.gguf_model("qwen3:0.6b", b"qwen weights")
    stray = s.root / "manifests/registry.ollama.ai/library/qwen3/.DS_Store"
    stray.write_bytes(b"\0\0\0\1Bud1")
    for argv in (["ls"], ["show", "qwen3:0.6b"]):
        r = modelfs(*argv, "--store", str(s.root))
        assert r.returncode == 0, r.stderr
        assert STRAY_LINE in r.stderr, r.stderr
        assert "problem" not in r.stderr, r.stderr
    v = modelfs("verify", "--store", str(s.root))
    assert v.returncode == 0, v.stderr
    assert "STRAY" in v.stdout and "manifests/registry.ollama.ai/library/qwen3/.DS_Store" in (
        v.stdout
    ), v.stdout
    g = modelfs("gc", "--dry-run", "--store", str(s.root))
    assert "stray files" in g.stdout + g.stderr


def test_ls_without_a_store_names_every_default_and_the_ways_on(tmp_path: Path) -> None:
    if SYSTEM_STORE.is_dir():
        pytest.skip(f"{SYSTEM_STORE} exists here")
    home = tmp_path / "home"
    home.mkdir()
    r = modelfs("ls", home=home)
    assert r.returncode == 1
    [line] = r.stderr.splitlines()
    assert line.startswith("modelfs: error: no model store at "), line
    for said in (
        str(home / ".ollama" / "models"),
        str(SYSTEM_STORE),
        "--store",
        "$OLLAMA_MODELS",
        "modelfs demo-store",
    ):
        assert said in line, line


def test_mount_on_a_missing_path_says_it_does_not_exist(tmp_path: Path) -> None:
    s = TinyStore(tmp_path / "s")
    s.gguf_model("qwen3:0.6b")
    where = tmp_path / "nowhere"
    r = modelfs("mount", "--store", str(s.root), str(where))
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == (
        f"modelfs: error: mount point {where} does not exist; make it first (mkdir -p {where})"
    ), r.stderr


def test_demo_store_prints_each_tag_as_ls_lists_it(tmp_path: Path) -> None:
    """Its lines give each tag's name, its ID and its size as `ls` does (decimal units, the
    list's ID for the manifest list), never a child's ID or binary units."""
    root = tmp_path / "d"
    r = modelfs("demo-store", str(root))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"demo store: {root}"
    printed = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    ls = modelfs("ls", "--store", str(root))
    listed = {
        row.split()[0]: (row.split()[1], re.split(r"\s{2,}", row)[2])
        for row in ls.stdout.splitlines()[1:]
    }
    assert set(printed) == set(listed)
    for name, (id_, size) in listed.items():
        assert printed[name] == [id_, *size.split()], (name, printed[name], listed[name])
    assert not re.search(r"[KMG]iB", r.stdout), r.stdout
    size = Path(lines[-1].split("model blob: ")[1].split(" (")[0]).stat().st_size
    assert lines[-1].endswith(f"({human_bytes(size)})"), lines[-1]


@fuse
def test_a_mount_listing_has_dot_and_dot_dot_with_their_inodes(
    tmp_path: Path,
) -> None:
    s = TinyStore(tmp_path / "s")
    s.gguf_model("qwen3:0.6b")
    mnt = tmp_path / "mnt"
    with mounted(s.root, mnt):
        model = mnt / "qwen3" / "0.6b"
        for d, parent in ((mnt, None), (mnt / "qwen3", mnt), (model, mnt / "qwen3")):
            out = subprocess.run(
                ["ls", "-ai1", str(d)], capture_output=True, text=True, check=True
            ).stdout
            inodes = {line.split()[1]: int(line.split()[0]) for line in out.splitlines()}
            assert inodes["."] == os.stat(d).st_ino, out
            if parent is not None:
                assert inodes[".."] == os.stat(parent).st_ino, out
            # Python's scandir (and so os.walk, find's kin) leaves them out, as everywhere.
            assert {e.name for e in os.scandir(d)} == set(inodes) - {".", ".."}
        found = subprocess.run(
            ["find", str(mnt / "qwen3")], capture_output=True, text=True, check=True
        )
        assert f"{model}/model.gguf" in found.stdout.splitlines(), found.stdout
        assert found.stderr == ""
        walked = [p for _, _, files in os.walk(model) for p in files]
        assert "model.gguf" in walked and "." not in walked


@fuse
def test_the_mount_log_counts_1_model_in_words(tmp_path: Path) -> None:
    s = TinyStore(tmp_path / "s")
    s.gguf_model("qwen3:0.6b")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen(
        [MODELFS, "mount", "--store", str(s.root), str(mnt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_mount(proc, mnt)  # type: ignore[arg-type]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        force_unmount(mnt)
    assert f"on {mnt} (1 model)" in out, out


def test_version_names_the_commit_of_a_checkout(tmp_path: Path) -> None:
    """Run from this checkout, `--version` adds the commit `git describe` gives; run from a
    copy of the package outside any checkout, only the version."""
    from importlib.metadata import version

    r = modelfs("--version", env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    described = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert r.stdout.strip() == f"modelfs {version('modelfs')} (git {described})"
    copy = tmp_path / "site"
    copy.mkdir()
    subprocess.run(["cp", "-r", str(REPO / "modelfs"), str(copy)], check=True)
    r = modelfs("--version", env={"PYTHONPATH": str(copy)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"modelfs {version('modelfs')}"
