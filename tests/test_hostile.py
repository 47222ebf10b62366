"""Stores that are not clean: strays from Macs and editors, and special files where manifests
and blobs should be. Every command finishes in bounded time, says what it met by path and
kind, deletes nothing it should not, and prints no traceback."""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from modelfs.store.digest import Digest
from tests.builders import TinyStore
from tests.test_gc import MODELFS, gc, orphan, present
from tests.test_pull_hosts import server

QWEN = ("registry.ollama.ai", "library", "qwen2.5")


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A modelfs command that must end on its own well within `timeout`."""
    return subprocess.run([MODELFS, *argv], capture_output=True, text=True, timeout=timeout)


def test_strays_are_reported_with_the_same_words_and_gc_goes_on(tmp_path: Path) -> None:
    """A `.DS_Store` or `._latest` beside the tags (a Mac on the share), and a manifest copied
    under a name no tag can have: GC runs, keeps them and what the last one names, and
    `verify` and `gc` name them alike."""
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("qwen2.5:7b", payload=b"weights")
    junk = orphan(tiny, b"nobody's")
    d = tiny.layout.manifests.joinpath(*QWEN)
    (d / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1\x00junk")
    (d / "._latest").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    kept_blob = b"named only by a manifest under an odd name"
    odd = tiny.manifest([tiny.layer("model", kept_blob)])
    (d / "7b~").write_bytes(odd)
    kept = Digest.of_bytes(kept_blob)
    os.utime(tiny.layout.blob(kept), (time.time() - 7200,) * 2)
    before = {p.name for p in d.iterdir()}

    for _ in range(2):
        rc, report, err = gc(tiny, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
        assert rc == 0, err
        assert report["refused"] == []
        strays = {s["path"].rsplit("/", 1)[-1]: s["message"] for s in report["strays"]}
        assert set(strays) == {".DS_Store", "._latest", "7b~"}
    assert not present(tiny, junk)  # GC did its work
    assert present(tiny, kept)  # what a stray manifest names is kept
    assert {p.name for p in d.iterdir()} == before  # never deleted
    v = run("verify", "--store", str(tiny.root))
    assert v.returncode == 0, v.stdout + v.stderr
    for name, message in strays.items():
        line = next(ln for ln in v.stdout.splitlines() if name in ln)
        assert message in line
    assert "Traceback" not in v.stdout + v.stderr


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _socket(p: Path) -> None:
    os.mknod(p, 0o600 | stat.S_IFSOCK)  # what bind() leaves, without its path length limit


def _loop(p: Path) -> None:
    p.symlink_to(p.name)


SPECIAL: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "a FIFO"),
    "dev-zero": (_zero, "a character device"),
    "socket": (_socket, "a socket"),
    "link-loop": (_loop, "symbolic links"),
}


@pytest.mark.parametrize("where", ["manifests", "manifests-v2"])
@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_a_special_file_where_a_tag_is(tmp_path: Path, kind: str, where: str) -> None:
    """`ls`, `gc --dry-run` and `verify` finish at once, name the file and its kind, and GC,
    which cannot know what such a tag would keep, deletes nothing."""
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("fine:1")
    junk = orphan(tiny, b"would go")
    make, words = SPECIAL[kind]
    host = "ollama.com" if where == "manifests-v2" else "registry.ollama.ai"
    path = tiny.root / where / host / "library" / "odd" / "latest"
    path.parent.mkdir(parents=True)
    make(path)
    for argv in (("ls",), ("gc", "--dry-run"), ("verify",)):
        r = run(*argv, "--store", str(tiny.root))
        out = r.stdout + r.stderr
        assert "Traceback" not in out, out
        if argv[0] != "ls":
            assert r.returncode == 1, out
            assert "odd/latest" in out, out
        if argv[0] == "gc":
            assert words in out, out
    rc, report, _ = gc(tiny, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
    assert rc == 1 and report["refused"]
    assert present(tiny, junk)


@pytest.mark.parametrize("where", ["manifests", "manifests-v2"])
@pytest.mark.parametrize("link", [False, True], ids=["directory", "link-to-directory"])
def test_a_directory_where_a_tag_is_is_a_stray(tmp_path: Path, where: str, link: bool) -> None:
    """A directory (or a link to one) at a tag's path holds no manifest and names no blobs;
    Ollama's own listing skips it (ollama/ollama fb30760 manifest/manifest.go:189-194).
    `verify` and `gc` call it a stray in the same words, exit 0, keep it, and GC goes on."""
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("fine:1", payload=b"fine weights")
    junk = orphan(tiny, b"would go")
    host = "ollama.com" if where == "manifests-v2" else "registry.ollama.ai"
    path = tiny.root / where / host / "library" / "odd" / "latest"
    path.parent.mkdir(parents=True)
    if link:
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"not looked at")
    rel = f"{where}/{host}/library/odd/latest"

    rc, report, err = gc(tiny, "--dry-run")
    assert rc == 0 and report["refused"] == [], err
    (stray,) = [s for s in report["strays"] if s["path"] == rel]
    v = run("verify", "--store", str(tiny.root))
    assert v.returncode == 0, v.stdout + v.stderr
    (line,) = [ln for ln in v.stdout.splitlines() if rel in ln]
    assert stray["message"] in line and "STRAY" in line.upper(), line

    rc, report, err = gc(tiny, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
    assert rc == 0 and report["refused"] == [], err
    rc, report, err = gc(tiny, "--grace", "0", "--grace-below-floor", "--trash-retention", "0")
    assert rc == 0, err
    assert not present(tiny, junk)  # GC went on
    assert present(tiny, Digest.of_bytes(b"fine weights"))
    assert path.is_dir()  # the stray is kept
    assert "Traceback" not in v.stdout + v.stderr + err


def test_a_fifo_blob_never_holds_up_the_server(tmp_path: Path) -> None:
    """A FIFO named like a blob: each request for it answers at once (a 404), many of them at
    the same time leave the server free for everything else, and SIGTERM stops it."""
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("fine:1", payload=b"good weights")
    fifo = Digest.of_bytes(b"a blob that is a FIFO")
    os.mkfifo(tiny.layout.blob(fifo))
    good = Digest.of_bytes(b"good weights")
    argv = [MODELFS, "serve", "--store", str(tiny.root), "--listen", "127.0.0.1:0"]
    with server(argv) as url:
        host, port = urlsplit(url).hostname, urlsplit(url).port
        assert host and port

        def get(digest: Digest) -> int:
            conn = http.client.HTTPConnection(host, port, timeout=20)
            try:
                conn.request("GET", f"/v2/library/fine/blobs/{digest}")
                return conn.getresponse().status
            finally:
                conn.close()

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            bad = [pool.submit(get, fifo) for _ in range(60)]
            assert {f.result(timeout=30) for f in bad} == {404}
        assert get(good) == 200
        pid = int(
            subprocess.run(
                ["pgrep", "-f", f"serve --store {tiny.root}"], capture_output=True, text=True
            ).stdout.split()[0]
        )
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _running(pid):
            assert time.monotonic() < deadline, "serve did not stop on SIGTERM"
            time.sleep(0.1)


def _running(pid: int) -> bool:
    """Alive and not a zombie (the test's own child, reaped later)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "argv",
    [
        ("serve", "--listen", "127.0.0.1:0", "--token-file"),
        ("serve", "--listen", "127.0.0.1:0", "--authorized-keys"),
        ("sync", "--config"),
    ],
    ids=["token-file", "authorized-keys", "config"],
)
def test_a_fifo_given_as_a_secret_or_config_is_one_line(tmp_path: Path, argv: tuple[str]) -> None:
    """Files beside the store go by the same rule: a FIFO (no writer) is refused at once."""
    tiny = TinyStore(tmp_path / "s")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run(*argv, str(fifo), "--store", str(tiny.root), timeout=30)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("modelfs: error:")]
    assert r.returncode == 1 and len(lines) == 1, r.stdout + r.stderr
    assert "FIFO" in lines[0] and "Traceback" not in r.stderr
