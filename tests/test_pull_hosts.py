"""`modelfs pull` as a real process between hosts that are real processes.

Every host is a store root of its own and a server process on a loopback port: the real
`modelfs serve` where it is about replication, tests/fakepeer.py (`python -m
tests.fakepeer`) where a fault or a throttle is needed. Every pull is the `modelfs` console
script in a child process, so exit codes, stderr, kill -9 and NDJSON are the user's.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modelfs.demo import GEMMA, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.test_pull import (
    assert_no_manifest,
    assert_store_sound,
    tree,
    weights,
)

REPO = Path(__file__).resolve().parent.parent
MODELFS = str(Path(sys.executable).with_name("modelfs"))
MiB = 1 << 20


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS",)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def server(argv: list[str]) -> Iterator[str]:
    """A server process that prints `listening on URL`; yields the URL, kills it after."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=_env()
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].strip()
                break
        assert url, f"server {argv} did not start (exit {proc.poll()})"
        yield url
    finally:
        proc.kill()
        proc.wait()


def modelfs_serve(store: Path) -> Iterator[str]:
    return server([MODELFS, "serve", "--store", str(store), "--listen", "127.0.0.1:0"])


def fakepeer(store: Path, *faults: str, log: Path | None = None) -> Iterator[str]:
    argv = [sys.executable, "-m", "tests.fakepeer", "--store", str(store)]
    for f in faults:
        argv += ["--fault", f]
    if log is not None:
        argv += ["--log", str(log)]
    return server(argv)


def modelfs(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MODELFS, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
        check=False,
    )


def pull(store: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return modelfs("pull", "--store", str(store), *argv, timeout=timeout)


def one_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("modelfs: error: ")]
    assert len(errors) == 1, r.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


# -- replication between hosts ----------------------------------------------------------------
def test_three_hosts_a_to_b_to_c_byte_identical(tmp_path: Path) -> None:
    demo = build_demo_store(tmp_path / "a")
    b, c = tmp_path / "b", tmp_path / "c"
    names = list(demo.names)
    with modelfs_serve(demo.root) as url_a:
        r = pull(b, *names, "--all-variants", "--from", url_a)
        assert r.returncode == 0, r.stderr
    assert tree(b) == tree(demo.root)
    assert assert_store_sound(b) == []
    listed = json.loads(modelfs("ls", "--json", "--store", str(b)).stdout)
    assert sorted(m["name"] for m in listed["models"]) == sorted([*demo.names, "gemma4:26b-mlx"])
    with modelfs_serve(b) as url_b:
        r = pull(c, *names, "--all-variants", "--from", url_b)
        assert r.returncode == 0, r.stderr
    assert tree(c) == tree(b)

    def listing(store: Path) -> list[tuple[str, str, int]]:
        models = json.loads(modelfs("ls", "--json", "--store", str(store)).stdout)["models"]
        return sorted((m["name"], m["digest"], m["size"]) for m in models)

    assert listing(c) == listing(b)
    assert listing(demo.root) == listing(b)  # gemma4:26b-mlx too, as a pull writes it


def test_two_hosts_default_variant_then_onward(tmp_path: Path) -> None:
    """B takes gemma4's preferred child only; C, pulling from B, gets exactly B's files."""
    demo = build_demo_store(tmp_path / "a")
    b, c = tmp_path / "b", tmp_path / "c"
    with modelfs_serve(demo.root) as url_a:
        assert pull(b, GEMMA, "--from", url_a).returncode == 0
    with modelfs_serve(b) as url_b:
        assert pull(c, GEMMA, "--from", url_b).returncode == 0
    assert tree(c) == tree(b)
    mlx = demo.manifests[f"{GEMMA}@mlx"]
    assert not Layout(b).blob(mlx.digest).exists()
    assert [v.runner for v in scan_store(c).lookup(GEMMA).variants] == ["llamacpp"]


def one_big_model(root: Path) -> tuple[TinyStore, Digest]:
    """A store of `m:1`, whose 12 MiB layer the large-blob receiver carries."""
    tiny = TinyStore(root)
    payload = weights(12 * MiB)
    tiny.gguf_model("m:1", payload)
    return tiny, Digest.of_bytes(payload)


def test_fails_over_from_a_dead_and_a_lying_peer(tmp_path: Path) -> None:
    tiny, big = one_big_model(tmp_path / "a")
    b = tmp_path / "b"
    with (
        fakepeer(tiny.root, f"flip@{big.hex[:12]}") as liar,
        modelfs_serve(tiny.root) as good,
    ):
        r = pull(b, "m:1", "--from", closed_port_url(), "--from", liar, "--from", good)
    assert r.returncode == 0, r.stderr
    assert f"{liar}: blob {big} arrived with sha256" in r.stderr
    assert tree(b) == tree(tiny.root)


def test_a_liars_bytes_do_not_make_an_honest_peer_a_liar(tmp_path: Path) -> None:
    """The first peer sends half a blob as zeros and hangs up; the honest second peer sends
    the rest, and the whole does not hash. Bytes that were here before the honest peer sent
    its part are what may be wrong, so the blob is fetched whole again from it: the pull
    succeeds and the honest peer is not named a liar (it was, and the model never came)."""
    tiny, big = one_big_model(tmp_path / "a")
    b = tmp_path / "b"
    with (
        fakepeer(tiny.root, f"poison@{big.hex[:12]}#1") as liar,
        modelfs_serve(tiny.root) as good,
    ):
        r = pull(b, "m:1", "--from", liar, "--from", good)
    assert r.returncode == 0, r.stderr
    assert f"{good}: blob {big} arrived with sha256" not in r.stderr
    assert "fetching it whole again" in r.stderr, r.stderr
    assert tree(b) == tree(tiny.root)


# -- kill -9 and resume -----------------------------------------------------------------------
def kill_mid_blob(
    store: Layout,
    digest: Digest,
    argv: list[str],
    least: int,
    check: Callable[[], None] = lambda: None,
) -> int:
    """Run `modelfs pull --store STORE ARGV…` and kill -9 it once the sidecar of `digest`
    lists at least `least` bytes from byte 0 (`check` runs at every look meanwhile);
    returns how many it listed."""
    sidecar = store.tmp / f"pull-{digest.blob_name}.json"
    proc = subprocess.Popen(
        [MODELFS, "pull", "--store", str(store.root), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 60
        done = 0
        while done < least:
            assert time.monotonic() < deadline, "no progress"
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            check()
            try:
                ranges = json.loads(sidecar.read_bytes())["done"]
                done = ranges[0][1] if ranges and ranges[0][0] == 0 else 0
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return done


def test_kill_9_mid_blob_then_resume(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "a")
    payload = weights(64 * MiB, 7)
    tiny.gguf_model("big:1", payload)
    big = Digest.of_bytes(payload)
    b = Layout(tmp_path / "b")
    log1, log2 = tmp_path / "peer1.jsonl", tmp_path / "peer2.jsonl"

    def sound() -> None:
        # Never a partial blob in blobs/, never a manifest before its blobs.
        assert not b.blob(big).exists()
        assert_no_manifest(b.root)
        for entry in b.blobs.iterdir() if b.blobs.exists() else ():
            assert hashlib.sha256(entry.read_bytes()).hexdigest() == entry.name[7:]

    with fakepeer(tiny.root, f"throttle=12M@{big.hex[:12]}", log=log1) as slow:
        done = kill_mid_blob(b, big, ["big:1", "--from", slow], 8 * MiB, sound)
    assert not b.blob(big).exists()
    assert_no_manifest(b.root)
    left = assert_store_sound(b.root, killed=True)
    assert f"pull-{big.blob_name}.partial" in left

    with fakepeer(tiny.root, log=log2) as fast:
        r = pull(b.root, "big:1", "--from", fast)
    assert r.returncode == 0, r.stderr
    requests = [json.loads(line) for line in log2.read_text().splitlines()]
    ranges = [q["range"] for q in requests if q["digest"] == big.hex]
    first = min(int(rng[6:].split("-")[0]) for rng in ranges)
    assert first >= done > 0  # the verified prefix is not fetched again
    assert tree(b.root) == tree(tiny.root)
    assert assert_store_sound(b.root) == []
    assert not (b.tmp / f"pull-{big.blob_name}.lock").exists()


# -- the user's view: errors, NDJSON ----------------------------------------------------------
@pytest.fixture(scope="module")
def small_src(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyStore, Digest]:
    tiny = TinyStore(tmp_path_factory.mktemp("src"))
    payload = weights(10 * MiB, 3)
    tiny.gguf_model("m:1", payload)
    return tiny, Digest.of_bytes(payload)


def test_errors_are_one_line_naming_the_peer(
    tmp_path: Path, small_src: tuple[TinyStore, Digest]
) -> None:
    tiny, _big = small_src
    b = tmp_path / "b"
    dead = closed_port_url()
    one_error(pull(b, "m:1", "--from", dead), dead, "cannot connect")
    with modelfs_serve(tiny.root) as url:
        one_error(pull(b, "nosuch:1", "--from", url), url, "404", "nosuch:1")
    one_error(pull(b, "m:1", "--from", "ftp://x"), "--from")
    with server(
        [sys.executable, "-m", "tests.fakepeer", "--store", str(tiny.root), "--token", "t"]
    ) as url:
        one_error(pull(b, "m:1", "--from", url), url, "401")
        token = tmp_path / "token"
        token.write_text("t\n")
        assert pull(b, "m:1", "--from", url, "--token-file", str(token)).returncode == 0
    assert tree(b) == tree(tiny.root)


@pytest.mark.parametrize(
    ("fault", "needles"),
    [
        ("stall", ["stalled", "1 s"]),
        ("flip", ["arrived with sha256"]),
        ("truncate", ["truncated body"]),
        ("long-length", ["Content-Length"]),
        ("status=500", ["HTTP 500"]),
    ],
)
def test_blob_faults_from_the_cli(
    tmp_path: Path, small_src: tuple[TinyStore, Digest], fault: str, needles: list[str]
) -> None:
    tiny, big = small_src
    b = tmp_path / "b"
    with fakepeer(tiny.root, f"{fault}@{big.hex[:12]}") as url:
        r = pull(b, "m:1", "--from", url, "--timeout", "1s", "--json")
    one_error(r, url, str(big), *needles)
    last = json.loads(r.stdout.splitlines()[-1])
    assert set(last) == {"error"} and url in last["error"]
    assert not Layout(b).blob(big).exists()
    assert_no_manifest(b)
    assert_store_sound(b)


def test_json_progress_is_ollamas_shape(
    tmp_path: Path, small_src: tuple[TinyStore, Digest]
) -> None:
    tiny, big = small_src
    with modelfs_serve(tiny.root) as url:
        r = pull(tmp_path / "b", "m:1", "--from", url, "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    statuses = [x["status"] for x in lines]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    blobs = [x for x in lines if "digest" in x]
    assert blobs and all(set(x) == {"status", "digest", "total", "completed"} for x in blobs)
    for x in blobs:
        assert x["status"] == f"pulling {x['digest'][7:19]}"
    final = {x["digest"]: x for x in blobs}
    assert all(x["completed"] == x["total"] for x in final.values())
    assert final[str(big)]["total"] == 10 * MiB
    assert {x["status"] for x in lines} >= {"pulling manifest", "success"}


def test_full_disk_from_the_cli(tmp_path: Path, small_src: tuple[TinyStore, Digest]) -> None:
    tiny, big = small_src
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        store = mnt / "models"
        with modelfs_serve(tiny.root) as url:
            r = pull(store, "m:1", "--from", url)
        one_error(r, "no space left on device", str(store))
        assert not Layout(store).blob(big).exists()
        assert_no_manifest(store)
        assert assert_store_sound(store) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_pull_starts_a_store_where_there_is_none(
    tmp_path: Path, small_src: tuple[TinyStore, Digest]
) -> None:
    tiny, _big = small_src
    home = tmp_path / "home"
    home.mkdir()
    env = {**_env(), "HOME": str(home)}
    with modelfs_serve(tiny.root) as url:
        r = subprocess.run(
            [MODELFS, "pull", "m:1", "--from", url],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert r.returncode == 0, r.stderr
    assert f"store: {home}/.ollama/models" in r.stderr
    assert tree(home / ".ollama" / "models") == tree(tiny.root)


@pytest.mark.slow
def test_a_pull_cut_short_by_a_dead_peer_leaves_no_broken_model(tmp_path: Path) -> None:
    """`modelfs pull` of a manifest list whose main blob takes the large path, from a real
    `modelfs serve` killed (-9) mid-transfer: `verify` and `ls` then find nothing wrong (no
    child manifest without its blobs), and the child this host does not want (mlx, by the
    default prefer) is never written, neither then nor once the pull completes."""
    from modelfs.sync.pull.options import PullOptions
    from tests.test_daemon import free_port, wait_until
    from tests.throttle import Throttle

    demo = build_demo_store(tmp_path / "a", weight_bytes=2 * PullOptions().small_max)
    b = tmp_path / "b"
    unwanted = {d for runner, _, d in demo.lists[GEMMA].children if runner == "mlx"}
    assert unwanted
    port = free_port()
    argv = [MODELFS, "serve", "--store", str(demo.root), "--listen", f"127.0.0.1:{port}"]

    def serve() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None and "listening on" in proc.stdout.readline().decode()
        return proc

    def sound() -> None:
        r = modelfs("verify", "--store", str(b))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ok: every blob matches its name" in r.stdout
        r = modelfs("ls", "--store", str(b))
        assert r.returncode == 0 and "problem" not in r.stderr, r.stderr
        assert not any(Layout(b).blob(d).exists() for d in unwanted)

    peer = serve()
    try:
        with Throttle(("127.0.0.1", port), rate=4 * MiB) as proxy:
            pulling = subprocess.Popen(
                [MODELFS, "pull", GEMMA, "--from", proxy.url, "--store", str(b)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=_env(),
            )
            wait_until(lambda: proxy.relayed > 4 * MiB, 60, "the pull to be under way")
            peer.kill()
            peer.wait()
            _, err = pulling.communicate(timeout=120)
            assert pulling.returncode == 1, err
        sound()
        assert GEMMA not in {e.name.shortest for e in scan_store(b)}
        peer = serve()
        r = modelfs("pull", GEMMA, "--from", f"http://127.0.0.1:{port}", "--store", str(b))
        assert r.returncode == 0, r.stderr
        sound()
        assert GEMMA in {e.name.shortest for e in scan_store(b)}
    finally:
        peer.kill()
        peer.wait()
