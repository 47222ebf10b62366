"""Shared helpers for the benchmarks under scripts/bench (README, "Tests and benchmarks").

Only the standard library is imported at module level, so a script can import this first and
re-exec itself with the repository's virtualenv (`ensure_venv`) before it needs anything else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# This checkout's virtualenv; a checkout without one (a git worktree) runs under the
# interpreter it was started with, whose `modelfs` script imports this checkout's code as
# long as the children get PYTHONPATH=REPO (see `child_env`).
VENV = REPO / ".venv" if (REPO / ".venv" / "bin" / "python").exists() else Path(sys.prefix)
MODELFS = VENV / "bin" / "modelfs"
if not MODELFS.exists():
    # A worktree without a venv of its own, run by another checkout's interpreter: its entry
    # point, importing this checkout's code (PYTHONPATH below), as this process does.
    MODELFS = Path(sys.executable).parent / "modelfs"
# What this checkout's benches start (the CLI, a mount, a server) runs this checkout's code,
# not an editable install of another one.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
)
# As an installed modelfs runs: from compiled bytecode (pip and Debian's packages compile it at
# install). An environment that says not to write any (PYTHONDONTWRITEBYTECODE) would have
# every process started here compile each module it imports again, ~40 ms of a mount's start.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
MB = 1e6
GiB = 1 << 30

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def ensure_venv(script: str) -> None:
    """Re-exec `script` with .venv/bin/python unless this interpreter is already that one."""
    python = VENV / "bin" / "python"
    if python.exists() and Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(python, [str(python), script, *sys.argv[1:]])


def child_env() -> dict[str, str]:
    """The environment for a child process that must run this checkout's code."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}


def install_sigterm_as_exit() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` (unmounts, temp dirs) still runs."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def age_past_racy_margin(root: Path) -> None:
    """Sleep until the newest ctime in the store is older than the scan and reach indexes'
    racy margin: a store written moments ago is all "racy", so the first warm runs would read it
    all again and rewrite the index, and look slower than no index at all."""
    from modelfs.store.index.indexfile import RACY_NS

    newest = 0
    for dirpath, dirs, files in os.walk(root):
        if os.path.basename(dirpath) == ".modelfs":
            dirs.clear()
            continue
        for name in (".", *dirs, *files):
            newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_ctime_ns)
    wait = (newest + RACY_NS - time.time_ns()) / 1e9 + 0.1
    if wait > 0:
        print(f"  waiting {wait:.1f} s: the store is younger than the index's racy margin")
        time.sleep(wait)


# -- the page cache ----------------------------------------------------------------------------
def drop_caches() -> bool:
    """`sync; echo 3 > /proc/sys/vm/drop_caches`; False when not allowed (not root, container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def bdi_path(path: str | os.PathLike[str]) -> Path:
    dev = os.stat(path).st_dev
    return Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")


def read_ahead_kb(path: str | os.PathLike[str]) -> int | None:
    try:
        return int(bdi_path(path).read_text())
    except (OSError, ValueError):
        return None


def set_read_ahead_kb(path: str | os.PathLike[str], kb: int) -> bool:
    try:
        bdi_path(path).write_text(str(kb))
    except OSError:
        return False
    return True


# -- processes ---------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def lazy_unmount(mountpoint: Path) -> None:
    if os.path.ismount(mountpoint):
        subprocess.run(
            ["fusermount3", "-u", "-z", str(mountpoint)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )


@dataclass
class FuseMount:
    """A FUSE daemon run in the foreground by this process, mounted on `mountpoint`."""

    argv: list[str]
    mountpoint: Path
    name: str
    proc: subprocess.Popen[bytes] | None = None
    ready_s: float = 0.0
    log: Path | None = None
    namespaced: bool = False  # mounted in a mount namespace of its own (tests/unitmount.py)

    @property
    def view(self) -> Path:
        """The mount point as this process can open it."""
        if not self.namespaced:
            return self.mountpoint
        from tests.unitmount import seen_from_outside

        return seen_from_outside(self.pid, self.mountpoint)

    def start(self, timeout: float = 30.0) -> FuseMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        err = open(self.log, "wb") if self.log else subprocess.DEVNULL  # noqa: SIM115
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err
            )
        finally:
            if self.log:
                err.close()  # type: ignore[union-attr]
        while not os.path.ismount(self.view):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}{self._tail()}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{self.name} not mounted after {timeout:.0f} s{self._tail()}")
            time.sleep(0.002)
        self.ready_s = time.perf_counter() - t0
        return self

    def _tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return (": " + lines[-1]) if lines else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM (a clean unmount), then `fusermount3 -u -z` and SIGKILL if that fails."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    lazy_unmount(self.mountpoint)
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        finally:
            lazy_unmount(self.mountpoint)

    def __enter__(self) -> FuseMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def modelfs_mount(
    store: Path, mountpoint: Path, log: Path | None = None, extra: Sequence[str] = ()
) -> FuseMount:
    argv = [str(MODELFS), "mount", "-q", "--store", str(store), *extra, str(mountpoint)]
    return FuseMount(argv, mountpoint, "modelfs", log=log)


def modelfs_unit_mount(
    store: Path, mountpoint: Path, work: Path, log: Path | None = None, *, unit: bool = True
) -> FuseMount:
    """`modelfs mount` as systemd/modelfs-mount.service runs it (its user, group and
    capabilities), or with unit=False as that user's own mount (no capability), each in a
    mount namespace set up in `work` (tests/unitmount.py). The store must be readable by
    that user; the mount point is made theirs."""
    from tests.unitmount import UID, namespaced_argv

    for d in (work, mountpoint):
        d.mkdir(parents=True, exist_ok=True)
    os.chown(mountpoint, UID, UID)
    argv = [str(MODELFS), "mount", "-q", "--store", str(store), "--allow-other", str(mountpoint)]
    name = "modelfs unit" if unit else "modelfs user"
    return FuseMount(namespaced_argv(work, argv, unit=unit), mountpoint, name, log=log,
                     namespaced=True)  # fmt: skip


def bindfs_mount(source: Path, mountpoint: Path, log: Path | None = None) -> FuseMount:
    """Read-only bindfs in the foreground, as an ordinary user would run it (single-threaded,
    kernel defaults)."""
    if shutil.which("bindfs") is None:
        raise RuntimeError("bindfs is not installed (apt-get install bindfs)")
    argv = ["bindfs", "-f", "-r", "--no-allow-other", str(source), str(mountpoint)]
    return FuseMount(argv, mountpoint, "bindfs", log=log)


# -- servers and pulls -------------------------------------------------------------------------
def start_server(
    store: Path, kind: str = "serve", extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """`modelfs serve` (or tests/fakepeer.py) on 127.0.0.1:0: the process and its URL."""
    import select

    if kind == "serve":
        argv = [str(MODELFS), "serve", "-q", "--store", str(store), "--listen", "127.0.0.1:0"]
    else:
        argv = [sys.executable, "-m", "tests.fakepeer", "--store", str(store)]
    proc = subprocess.Popen(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"bench: {argv[1]} did not start ({line!r})")
    return proc, line.removeprefix("listening on ")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pull_once(
    url: str, name: str, target: Path, big: str, extra: Sequence[str] = ()
) -> tuple[float, float, int, float]:
    """`modelfs pull NAME --from URL --json` into an empty `target`: (process seconds,
    big-blob seconds from its first progress line to `success`, bytes fetched, CPU s)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    t0 = time.perf_counter()
    argv = [str(MODELFS), "pull", "-q", "--store", str(target), name, "--from", url, "--json"]
    proc = subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    blob_start = blob_end = None
    totals: dict[str, int] = {}
    for raw in proc.stdout:
        now = time.perf_counter()
        line = json.loads(raw)
        digest = line.get("digest")
        if digest is not None:
            totals[digest] = line["total"]
            if digest == big and blob_start is None:
                blob_start = now
        if line.get("status") == "success":
            blob_end = now
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or blob_start is None or blob_end is None:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"bench: modelfs pull failed ({proc.returncode}): {err.strip()}")
    cpu = usage.ru_utime + usage.ru_stime
    return wall, blob_end - blob_start, sum(totals.values()), cpu


# -- stores ------------------------------------------------------------------------------------
def tiny_gguf(name: str, n: int) -> bytes:
    """A valid GGUF v3 file with no tensors and a few keys, so header readers succeed."""

    def text(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    kv = [
        text("general.architecture") + struct.pack("<I", 8) + text("llama"),
        text("general.name") + struct.pack("<I", 8) + text(name),
        text("general.file_type") + struct.pack("<II", 4, 15),
        text("general.parameter_count") + struct.pack("<IQ", 10, 1_000_000 + n),
    ]
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv)


def write_many_models(root: Path, count: int) -> int:
    """A store of `count` tiny GGUF models with Ollama's legacy layout; returns the blob count.

    Three namespaces shapes (library, a user namespace, another host). Blobs shared by every
    model (template, license) go through BlobStore; the per-model blobs and manifests are written
    without fsync, which is fine for a throwaway store and keeps 5,000 models to a few seconds.
    """
    from modelfs.store.blobs import FILE_MODE, BlobStore
    from modelfs.store.digest import Digest
    from modelfs.store.layout import Layout
    from modelfs.store.manifest import LAYER_PREFIX, MEDIA_CONFIG, MEDIA_MANIFEST
    from modelfs.store.names import parse_name

    layout = Layout(root)
    blobs = BlobStore(layout)
    blobs.ensure_dirs()
    layout.manifests.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> Digest:
        digest = Digest.of_bytes(data)
        path = layout.blob(digest)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return digest

    def layer(media: str, digest: Digest, size: int) -> dict[str, object]:
        return {"mediaType": media, "digest": str(digest), "size": size}

    template = b"{{ .System }}\n{{ .Prompt }}"
    license_ = b"MIT License\n"
    shared = [
        layer(LAYER_PREFIX + "template", blobs.put_bytes(template), len(template)),
        layer(LAYER_PREFIX + "license", blobs.put_bytes(license_), len(license_)),
    ]
    base = 1_700_000_000
    for i in range(count):
        if i % 20 == 0:
            text = f"hf.co/org{i % 7}/model{i // 20:04d}-GGUF:Q4_K_M"
        elif i % 5 == 1:
            text = f"user{i % 13}/model{i // 5:04d}:q{i % 3 + 4}"
        else:
            text = f"model{i // 10:04d}:tag{i % 10}"
        weights = tiny_gguf(f"model{i}", i)
        wd = put(weights)
        config = json.dumps(
            {
                "model_format": "gguf",
                "model_family": "llama",
                "model_type": f"{i % 70 + 1}B",
                "file_type": "Q4_K_M",
                "rootfs": {"type": "layers", "diff_ids": [str(wd)]},
            },
            separators=(",", ":"),
        ).encode()
        cd = put(config)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": layer(MEDIA_CONFIG, cd, len(config)),
            "layers": [layer(LAYER_PREFIX + "model", wd, len(weights)), *shared],
        }
        raw = json.dumps(manifest, separators=(",", ":")).encode() + b"\n"
        path = layout.legacy_manifest(parse_name(text))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        os.utime(path, (base + i, base + i))
    return sum(1 for _ in layout.blobs.iterdir())


# -- results -----------------------------------------------------------------------------------
@dataclass
class Row:
    metric: str
    path: str
    samples: list[float] = field(default_factory=list)
    unit: str = "MB/s"
    note: str = ""
    ratio: float | None = None  # to native, filled in by the script
    target: str = ""
    result: str = ""  # PASS / MISS / "" (information only)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.2f}"
    if value >= 100_000:
        return f"{value / 1000:,.0f}k"
    return f"{value:,.0f}"


def print_table(rows: Sequence[Row], out=sys.stdout) -> None:  # type: ignore[no-untyped-def]
    head = ("metric", "path", "value", "unit", "× native", "target", "result", "runs")
    table = [head]
    for r in rows:
        runs = " ".join(fmt(s, r.unit) for s in r.samples) if len(r.samples) > 1 else ""
        table.append(
            (
                r.metric,
                r.path + (f" ({r.note})" if r.note else ""),
                fmt(r.value, r.unit),
                r.unit,
                f"{r.ratio:.2f}" if r.ratio is not None else "",
                r.target,
                r.result,
                runs,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    right = {2, 4}
    previous = None
    for n, row in enumerate(table):
        cells = []
        for i, cell in enumerate(row):
            if i == 0 and n > 1 and cell == previous:
                cell = ""
            cells.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        if n > 0:
            previous = row[0]
        print("  ".join(cells).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
