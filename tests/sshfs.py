"""A store shared over sshfs, as users share one between hosts: a real sshd on loopback,
started for the test with keys made for it, and a real sshfs mount of a directory.

    with sshd(tmp) as server, sshfs(server, source_dir, mountpoint, "cache=no"):
        ...                        # mountpoint is source_dir, through SFTP

Both are separate processes, stopped (and the mount lazily unmounted) however the test ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSHFS = shutil.which("sshfs")


def available() -> bool:
    return SSHFS is not None and os.path.exists(SSHD) and os.geteuid() == 0


@dataclass
class Sshd:
    port: int
    key: Path  # the client's private key
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def sshd(where: Path) -> Iterator[Sshd]:
    where.mkdir(parents=True, exist_ok=True)
    host_key, key = where / "host_key", where / "id_ed25519"
    for path in (host_key, key):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
            check=True,
            capture_output=True,
        )
    authorized = where / "authorized_keys"
    shutil.copy(f"{key}.pub", authorized)
    port = _free_port()
    config = where / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized}\nPidFile {where / 'sshd.pid'}\n"
        "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nSubsystem sftp internal-sftp\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory
    log = where / "sshd.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=err)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, log.read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "sshd did not listen"
            time.sleep(0.05)
        yield Sshd(port, key, log)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def sshfs(server: Sshd, source: Path, mountpoint: Path, *options: str) -> Iterator[None]:
    assert SSHFS is not None
    mountpoint.mkdir(parents=True, exist_ok=True)
    opts = [
        f"port={server.port}",
        f"IdentityFile={server.key}",
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "LogLevel=ERROR",
        *options,
    ]
    proc = subprocess.Popen(
        [SSHFS, "-f", f"root@127.0.0.1:{source}", str(mountpoint), "-o", ",".join(opts)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                raise AssertionError(f"sshfs exited: {proc.stderr.read() if proc.stderr else ''}")
            assert time.monotonic() < deadline, "sshfs did not mount"
            time.sleep(0.05)
        yield
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
