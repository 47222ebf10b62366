"""scripts/install for systemd hosts, followed as written (docs/systemd.md) in a fresh root.

The fresh root is this machine seen through a mount and network namespace of the test's own:
/etc, /opt and /usr are overlays whose writes land in the test's directory, /mnt is empty, and
the network is a loopback of its own; the user `ollama` is made there as Ollama's Linux
installer makes it; PyPI is a wheelhouse made beforehand. No systemd runs here, so
tests/systemctl_shim.py stands in for `systemctl` and starts what the units say, as the units'
user.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
import zipfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from modelfs.sync.daemon.config import load_config
from tests.mounting import fuse

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MODELFS = str(REPO / ".venv" / "bin" / "modelfs")
VENV = "/opt/modelfs/venv"
STORE = "/usr/share/ollama/.ollama/models"
# A fresh Debian root's PATH, not this machine's (which may put another Python first).
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def section(page: str, title: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(f"\n{title}\n")
    end = re.compile(r"^#{2,3} ", re.M).search(text, start + len(title) + 2)
    return text[start : end.start() if end else None]


def install_block() -> list[str]:
    """The commands of the first ```sh block of docs/systemd.md's "Running under systemd",
    comments dropped."""
    text = section("systemd.md", "## Running under systemd")
    block = text[text.index("```sh\n") + 6 :]
    block = block[: block.index("```")]
    lines = [re.sub(r"\s+#.*$", "", ln).strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_version_is_the_installed_distributions() -> None:
    """The installed version, and the commit when the code that runs is a git checkout's
    (tests/test_words.py checks both cases)."""
    done = subprocess.run([MODELFS, "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        rf"modelfs {re.escape(version('modelfs'))}( \(git [^)]+\))?",
        done.stdout.strip(),
    ), done.stdout


@pytest.mark.network
def test_the_wheel_installs_one_package_named_modelfs(tmp_path: Path) -> None:
    """`pip install .` puts `modelfs` (and its dist-info) into site-packages and nothing else:
    top-level `store`, `sync` or `runtime` would clash with the PyPI projects of those names."""
    subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(tmp_path), str(REPO)],
        check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("modelfs-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"modelfs", f"modelfs-{version('modelfs')}.dist-info"}, top
    # Every layer and the data files are in it.
    for member in ("store/scan.py", "store/compat/handlers.py", "fsd/ops.py",
                   "sync/registry/server.py", "runtime/leasing.py", "cli/app.py",
                   "py.typed"):  # fmt: skip
        assert f"modelfs/{member}" in names, member


def test_readme_names_the_packages_and_files_the_install_uses() -> None:
    script = (REPO / "scripts" / "install").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith("ensure_debian_packages")]
    packages = line.split()[2:]
    assert {"fuse3", "python3-dev", "libfuse3-dev", "pkg-config", "gcc"} <= set(packages)
    text = section("systemd.md", "## Running under systemd")
    for p in packages:
        if p != "python3":  # Debian has it already
            assert f"`{p}`" in text, p
    assert install_block()[0] == "scripts/install"
    for path in ("/opt/modelfs/venv", "/etc/modelfs/config.toml", "/etc/fuse.conf"):
        assert path in text and path in script, path


def test_shipped_and_readme_configs_load_with_the_daemons_loader(tmp_path: Path) -> None:
    shipped = load_config(REPO / "etc" / "modelfs" / "config.toml")
    assert shipped.store == Path(STORE) and shipped.token_file == Path("/etc/modelfs/token")
    assert shipped.peers == () and shipped.replicate == ()  # serve only until edited
    # The store the config names is the one the units may write.
    sync_unit = (REPO / "systemd" / "modelfs-sync.service").read_text()
    assert f"ReadWritePaths={STORE}\n" in sync_unit
    text = section("sync.md", "## The config")
    example = text[text.index("```toml\n") + 8 :]
    example = example[: example.index("```")]
    (tmp_path / "config.toml").write_text(example)
    assert load_config(tmp_path / "config.toml").peers
    # Every key docs/sync.md shows is in the shipped file (commented out or set).
    shipped_text = (REPO / "etc" / "modelfs" / "config.toml").read_text()
    table = tomllib.loads(example)
    for key in [k for k in table if k != "gc"] + list(table["gc"]):
        assert re.search(rf"^#? ?{key} = ", shipped_text, re.M), key


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--venv", "/root/modelfs"], "ProtectHome=yes"),
        (["--venv", "/home/me/venv"], "ProtectHome=yes"),
        (["--venv", "opt/venv"], "absolute path"),
        (["--prefix", "/opt"], "unknown argument --prefix"),
    ],
)
def test_install_refuses_a_venv_the_units_cannot_run_in_one_line(
    args: list[str], needle: str
) -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "install"), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert line.startswith("install: ") and needle in line, line


# -- the fresh root -------------------------------------------------------------------------------
class FreshRoot:
    """Commands run inside the namespaces of a holder process (nsenter)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "--",
             "sh", "-c", "echo ready; exec sleep 3600"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None
        assert self.holder.stdout.readline().strip() == "ready"
        for d in ("etc", "opt", "usr"):
            (tmp / d / "upper").mkdir(parents=True)
            (tmp / d / "work").mkdir()
            opts = f"lowerdir=/{d},upperdir={tmp / d / 'upper'},workdir={tmp / d / 'work'}"
            self.run("mount", "-t", "overlay", "overlay", "-o", opts, f"/{d}")
        self.run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/mnt")
        self.run("ip", "link", "set", "lo", "up")
        self.state = Path("/mnt/.shim")  # seen by the units' user (the notify sockets)
        self.run("install", "-d", "-m", "0755", str(self.state))
        # A Debian host's udev makes /dev/fuse 0666, so users mount through fusermount3; a
        # container's may be 0600 (root only). The fresh root gets a 0666 node of its own.
        fuse_dev = f"{self.state}/fuse"
        self.run("mknod", "-m", "0666", fuse_dev, "c", "10", "229")
        self.run("mount", "--bind", fuse_dev, "/dev/fuse")

    def run(
        self,
        *argv: str,
        user: str | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if user is not None:
            cmd = ["runuser", "-u", user, "--", *cmd]
        full = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
        done = subprocess.run(
            ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", "env", "-i",
             *(f"{k}={v}" for k, v in full.items()), *cmd],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check:
            assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
        return done

    def read(self, path: str) -> str:
        return self.run("cat", path).stdout

    def close(self) -> None:
        pids = self.run("cat", f"{self.state}/pids", check=False).stdout.split()[1::2]
        for pid in pids:
            self.run("kill", "-TERM", pid, check=False)
        deadline = time.monotonic() + 20
        while pids and time.monotonic() < deadline:
            if self.run("kill", "-0", *pids, check=False).returncode != 0:
                pids = [p for p in pids if self.run("kill", "-0", p, check=False).returncode == 0]
            else:
                time.sleep(0.1)
        for pid in pids:
            self.run("kill", "-KILL", pid, check=False)
        self.run("fusermount3", "-u", "-z", "/mnt/models", check=False)
        self.holder.kill()
        self.holder.wait(timeout=10)


@pytest.fixture
def fresh_root(tmp_path: Path) -> Iterator[FreshRoot]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    root = FreshRoot(tmp_path)
    try:
        yield root
    finally:
        root.close()


@fuse
@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(900)
def test_readme_install_in_a_fresh_root(fresh_root: FreshRoot, tmp_path: Path) -> None:
    """Follows "Running under systemd" line by line, then checks what the units run.

    The user as ollama/ollama fb30760 scripts/install.sh:200 makes it: `useradd -r -s
    /bin/false -U -m -d /usr/share/ollama ollama`. FUSE passthrough is not built here
    (MODELFS_SKIP_PASSTHROUGH=1): it took 19 min on this shared machine; scripts/setup builds
    it for the rest of the suite.
    """
    r = fresh_root
    r.run("useradd", "-r", "-s", "/bin/false", "-U", "-m", "-d", "/usr/share/ollama", "ollama")
    r.run(MODELFS, "demo-store", STORE)
    r.run("chown", "-R", "ollama:ollama", "/usr/share/ollama/.ollama")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "systemctl").write_text(
        f'#!/bin/sh\nexec /usr/bin/python3 {REPO / "tests" / "systemctl_shim.py"} "$@"\n'
    )
    (shim / "systemctl").chmod(0o755)
    # The fresh root's network is a loopback of its own (its daemon has port 11500 to itself),
    # so PyPI comes as a wheelhouse made out here.
    wheels = tmp_path / "wheels"
    subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "-q", "-w", str(wheels),
         str(REPO), "setuptools>=77"],  # and modelfs's build backend
        check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    env = {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PATH": f"{shim}:{PATH}",
        "MODELFS_SKIP_PASSTHROUGH": "1",
        "SHIM_STATE": str(r.state),
        "SHIM_HIDE": str(REPO),
    }
    script = "set -euo pipefail\ncd " + str(REPO) + "\n" + "\n".join(install_block())
    t0 = time.monotonic()
    r.run("bash", "-c", script, env=env, timeout=600)
    print(f"docs/systemd.md install block: {time.monotonic() - t0:.0f} s")
    calls = r.read(f"{r.state}/calls")
    assert "enable --now modelfs-sync.service" in calls
    assert "enable --now modelfs-mount.service" in calls

    # The units: ExecStart= names the venv, hardening intact, and systemd accepts them.
    units = sorted(
        f"/etc/systemd/system/{u.name}"
        for u in (REPO / "systemd").iterdir()
        if u.suffix in (".service", ".timer")
    )
    for unit in units:
        text = r.read(unit)
        assert "/usr/local/bin/modelfs" not in text, unit
        if unit.endswith(".service"):
            assert f"ExecStart={VENV}/bin/modelfs " in text and "User=ollama" in text, unit
    assert "ProtectHome=yes" in r.read("/etc/systemd/system/modelfs-sync.service")
    verify = r.run("systemd-analyze", "verify", *units, check=False)
    assert verify.returncode == 0 and not verify.stdout.strip() and not verify.stderr.strip(), (
        verify
    )

    # The venv, as the units' user and as anybody: its version, the store.
    assert r.run(f"{VENV}/bin/modelfs", "--version", user="ollama").stdout.strip() == (
        f"modelfs {version('modelfs')}"
    )
    ls = r.run("modelfs", "ls", "--store", STORE, user="nobody")
    assert "gemma4:26b" in ls.stdout, ls
    config = r.run(
        f"{VENV}/bin/python", "-c",
        "import sys; from modelfs.sync.daemon.config import load_config;"
        " print(load_config(sys.argv[1]).store)",
        "/etc/modelfs/config.toml", user="ollama",
    )  # fmt: skip
    assert config.stdout.strip() == STORE
    assert re.search(r"^user_allow_other$", r.read("/etc/fuse.conf"), re.M)
    assert r.run("stat", "-c", "%U:%G %a", "/etc/modelfs/token").stdout.split() == [
        "root:ollama",
        "640",
    ]

    # The mount unit's /mnt/models, made by ollama with --allow-other, read by another user.
    assert r.run("mountpoint", "-q", "/mnt/models", check=False).returncode == 0
    model = r.run("head", "-c", "4", "/mnt/models/gemma4/26b/model.gguf", user="nobody")
    assert model.stdout == "GGUF"

    # The sync unit: with the token, /metrics and status want it, from loopback too.
    token = r.read("/etc/modelfs/token").strip()
    url = "http://127.0.0.1:11500"
    code = r.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/metrics")
    assert code.stdout == "401"
    metrics = r.run("curl", "-sf", "-H", f"Authorization: Bearer {token}", f"{url}/metrics")
    assert "modelfs_" in metrics.stdout
    # `modelfs status` alone finds the daemon and its token through /etc/modelfs/config.toml;
    # a user who may not read the token gets one line, no traceback.
    bare = r.run("modelfs", "status", check=False)
    assert bare.returncode == 0 and bare.stdout.startswith("host "), bare
    denied = r.run("modelfs", "status", check=False, user="nobody")
    assert denied.returncode == 1 and denied.stderr.startswith("modelfs: error: "), denied
    assert "Traceback" not in denied.stderr
    status = r.run("modelfs", "status", "--token-file", "/etc/modelfs/token", user="ollama")
    assert status.returncode == 0 and status.stdout.strip()

    # Again, as after a `git pull`: what the user changed stays (a mistake in it is named in
    # one line, by the daemon's own loader), nothing is added twice.
    r.run("sh", "-c", "echo 'peer = []' >> /etc/modelfs/config.toml")
    before = {p: r.read(p) for p in ("/etc/modelfs/token", "/etc/fuse.conf", *units)}
    again = r.run(str(REPO / "scripts" / "install"), env=env, timeout=600)
    assert "wrote" not in again.stderr and "set user_allow_other" not in again.stderr, again
    assert "install: warning: /etc/modelfs/config.toml: gc.peer: unknown key;" in again.stderr
    assert "Traceback" not in again.stderr
    assert r.read("/etc/modelfs/config.toml").endswith("peer = []\n")
    assert {p: r.read(p) for p in before} == before
    assert r.run(f"{VENV}/bin/modelfs", "--version", user="ollama").returncode == 0
