"""One ID per tag: `ls`, `show`, `diff`, `status` and the daemon's log lines spell it alike.

A plain tag's ID is its manifest's digest (what `ollama list` prints too); a manifest list's
is the list's own digest, the one peers compare, with the child this host uses labelled
beside it where that matters (`show`, `diff`, `status`, the log). One modified time per tag
too: for a list, its legacy anchor's, the file Ollama's /api/tags lists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelfs.cli.human import human_time, rfc3339_nano
from modelfs.store.digest import Digest
from tests.builders import TinyStore
from tests.mounting import fuse, mounted
from tests.test_daemon import complete, daemon, wait_until
from tests.test_daemon_variants import list_store
from tests.test_pull_hosts import _env

MODELFS = str(Path(sys.executable).with_name("modelfs"))
GEMMA = "gemma4:26b"
QWEN = "qwen3:0.6b"


def short(raw: bytes) -> str:
    return Digest.of_bytes(raw).short


def store_with_a_list(root: Path) -> dict[str, str]:
    """gemma4:26b as a manifest list (llamacpp GGUF + mlx safetensors) with a legacy anchor
    of other bytes than either child, as Ollama writes one; qwen3:0.6b a plain tag. The IDs
    each should have."""
    lst, gguf = list_store(root, b"gemma gguf weights")
    children = {c["runner"]: c["digest"] for c in json.loads(lst)["manifests"]}
    anchor = json.dumps(json.loads(gguf), indent=1).encode()
    s = TinyStore(root)
    s.legacy(GEMMA, anchor)
    plain = s.gguf_model(QWEN, b"qwen weights")
    return {
        "list": short(lst),
        "llamacpp": short(gguf),
        "mlx": Digest.parse(children["mlx"]).short,
        "anchor": Digest.of_bytes(anchor).hex,
        "plain": short(plain),
    }


def run(*args: str) -> str:
    r = subprocess.run([MODELFS, *args], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    return r.stdout


def ls_ids(root: Path, *extra: str) -> dict[str, str]:
    rows = [line.split() for line in run("ls", "--store", str(root), *extra).splitlines()[1:]]
    return {row[0]: row[1] for row in rows}


def show_id(root: Path, name: str, *extra: str) -> str:
    line = run("show", "--store", str(root), name, *extra).splitlines()[1]
    m = re.fullmatch(r"ID {7}(.*)  \(.*\)", line)
    assert m, line
    return m.group(1)


def test_ls_show_and_diff_give_one_id_for_a_plain_tag_and_a_manifest_list(
    tmp_path: Path,
) -> None:
    built = store_with_a_list(tmp_path / "s")
    root = tmp_path / "s"
    lst, plain = built["list"], built["plain"]
    for prefer in ("llamacpp", "mlx"):
        labelled = f"{lst} (list; {prefer} child {built[prefer]})"
        assert ls_ids(root, "--prefer", prefer) == {GEMMA: lst, QWEN: plain}
        assert show_id(root, GEMMA, "--prefer", prefer) == labelled
        assert show_id(root, QWEN, "--prefer", prefer) == plain
        diff = run("diff", "--store", str(root), "--prefer", prefer, GEMMA, QWEN).splitlines()
        assert diff[0].startswith(f"A  {GEMMA}  {labelled}  ("), diff[0]
        assert diff[1].startswith(f"B  {QWEN}  {plain}  ("), diff[1]
    # `ls --json` stays Ollama's /api/tags: for the list tag, the anchor Ollama reads.
    records = json.loads(run("ls", "--json", "--store", str(root)))["models"]
    by_name = {r["name"]: r["digest"] for r in records}
    assert by_name[GEMMA] == built["anchor"]
    assert by_name[QWEN].startswith(plain)


@pytest.mark.slow
def test_the_daemon_log_and_status_show_the_id_ls_and_show_give(tmp_path: Path) -> None:
    """Host b replicates both tags from host a (two real `modelfs sync` processes); its log
    line, `modelfs status` and `ls`/`show` of its store name each tag by one ID, and status
    names the peer by its host id."""
    built = store_with_a_list(tmp_path / "a")
    b = tmp_path / "b"
    lst, plain = built["list"], built["plain"]
    labelled = f"{lst} (list; llamacpp child {built['llamacpp']})"
    with (
        daemon(tmp_path, "a", store=str(tmp_path / "a"), interval="1s") as a,
        daemon(tmp_path, "b", store=str(b), peers=[a.url], replicate=["*"], interval="1s") as d,
    ):
        wait_until(lambda: complete(b, GEMMA) and complete(b, QWEN), what="both on b")
        wait_until(lambda: d.text().count("replicated ") >= 2, what="two log lines")
        log = d.text()
        assert f"replicated {GEMMA} {labelled} from {a.url}" in log, log
        assert f"replicated {QWEN} {plain} from {a.url}" in log, log
        # Values in the JSON, the sentence in the table.
        values = {"id": lst, "list": True, "child": "llamacpp", "child_id": built["llamacpp"]}
        wait_until(lambda: d.status()["daemon"]["ids"].get(GEMMA) == values, what="status ids")
        wait_until(lambda: d.status()["peers"][0]["host_id"] == "a", what="the peer's host id")
        out = d.status_cli()
        lines = out.splitlines()
        # Peers by host id, with their URL; the models table has a column per host.
        assert any(line.split()[:3] == ["a", f"({a.url})", "ok"] for line in lines), out
        assert any(line.split() == ["NAME", "HERE", "a"] for line in lines), out
        rows = {
            line.split()[0]: line
            for line in lines
            if line.startswith("  ") and line.split()[0] in (GEMMA, QWEN)
        }
        assert rows[GEMMA].split()[1:6] == labelled.split(), rows
        assert rows[QWEN].split()[1] == plain, rows
    assert ls_ids(b)[GEMMA] == lst and ls_ids(b)[QWEN] == plain
    assert show_id(b, GEMMA) == labelled


DAY_NS = 86_400 * 1_000_000_000


@fuse
def test_ls_ls_json_show_and_the_mount_agree_on_id_child_and_modified_time(
    tmp_path: Path,
) -> None:
    """The list tag's anchor is 330 days old and its list blob new (as a pull long ago, the
    list blob touched since); the plain tag is 150 days old. `ls` (ID, MODIFIED, order),
    `ls --json` (modified_at, order), `show` and `show --json` (`id`, `child`, `child_id`,
    `modified_at`) and the mount (a model directory's mtime, its `user.modelfs.tag_digest`
    and `manifest_digest`, `.ollama/digest`) give each tag one ID, one child, one time."""
    root = tmp_path / "s"
    built = store_with_a_list(root)
    now_ns = time.time_ns()
    anchor_ns, plain_ns = now_ns - 330 * DAY_NS + 123, now_ns - 150 * DAY_NS + 456
    os.utime(root / "manifests/registry.ollama.ai/library/gemma4/26b", ns=(anchor_ns, anchor_ns))
    os.utime(root / "manifests/registry.ollama.ai/library/qwen3/0.6b", ns=(plain_ns, plain_ns))
    llamacpp = next(
        json.loads(p.read_bytes())["manifests"][0]["digest"]
        for p in (root / "blobs").iterdir()
        if Digest.parse(p.name.replace("-", ":")).short == built["list"]
    )
    want = {
        GEMMA: (built["list"], "llamacpp", built["llamacpp"], anchor_ns),
        QWEN: (built["plain"], None, None, plain_ns),
    }
    lines = run("ls", "--store", str(root)).splitlines()[1:]
    assert [line.split()[0] for line in lines] == [QWEN, GEMMA]  # newest first
    for line in lines:
        name, id_, *_ = line.split()
        assert id_ == want[name][0]
        assert human_time(want[name][3] / 1e9) in line, line
    records = json.loads(run("ls", "--json", "--store", str(root)))["models"]
    assert [r["name"] for r in records] == [QWEN, GEMMA]
    for r in records:
        assert r["modified_at"] == rfc3339_nano(want[r["name"]][3])
    for name, (id_, child, child_id, ns) in want.items():
        shown = json.loads(run("show", "--json", "--store", str(root), name))
        assert (shown["id"], shown["child"], shown["child_id"]) == (id_, child, child_id)
        assert shown["modified_at"] == rfc3339_nano(ns)
        text = run("show", "--store", str(root), name).splitlines()
        assert text[2] == f"Modified {rfc3339_nano(ns)}"
    with mounted(root, tmp_path / "mnt"):
        for name, (id_, child, child_id, ns) in want.items():
            parts = name.replace(":", "/").split("/")
            dirs = [tmp_path / "mnt" / Path(*parts)]
            if child is not None:
                dirs.append(dirs[0].with_name(f"{parts[-1]}@mlx"))
            for d in dirs:
                assert os.stat(d).st_mtime_ns == ns, d
                assert os.stat(d / "Modelfile").st_mtime_ns == ns, d
                tag = os.getxattr(d, "user.modelfs.tag_digest").decode()
                assert Digest.parse(tag).short == id_
                served = os.getxattr(d, "user.modelfs.manifest_digest").decode()
                assert (d / ".ollama" / "digest").read_text() == served + "\n"
                if child is None:
                    assert served == tag
            if child is not None:
                # The plain tag directory serves the child `show` names; @mlx its own.
                assert (
                    Digest.parse(
                        os.getxattr(dirs[0], "user.modelfs.manifest_digest").decode()
                    ).short
                    == child_id
                )
                assert os.getxattr(dirs[1], "user.modelfs.manifest_digest").decode() != llamacpp
