"""A real CNCF distribution registry (Debian's `docker-registry`) on a loopback port, for tests.

    with running_registry(tmp_path) as reg:       # or the `registry` fixture in test modules
        reg.url                                   # "http://127.0.0.1:40123"
        reg.requests()                            # [(method, uri), …] the registry served

Each registry gets its own storage directory and config file under the test's directory, and is
stopped (SIGTERM, then SIGKILL) however the test ends. scripts/setup installs the package and
stops the system service it ships; tests skip with a reason only if the binary is missing.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.processes import stop

DOCKER_REGISTRY = "/usr/bin/docker-registry"

needs_registry = pytest.mark.skipif(
    not os.access(DOCKER_REGISTRY, os.X_OK),
    reason=f"needs {DOCKER_REGISTRY} (Debian package docker-registry; scripts/setup installs it)",
)

# A bcrypt hash of "s3cret" (cost 4, the minimum: tests need no slow hashing).
HTPASSWD_USER = "pusher"
HTPASSWD_PASSWORD = "s3cret"
HTPASSWD_LINE = f"{HTPASSWD_USER}:$2b$04$4j.DE/4B3QjXPFxOXkL7qucbRFThIQ9izkmBDD966RiHapXedolsy"

# logfmt quotes a value only when it needs it (a digest's ':' does, a plain path does not).
_REQUEST = re.compile(
    r'msg="response completed(?: with error)?"'
    r'.*?http\.request\.method=(\S+).*?http\.request\.uri=(?:"([^"]*)"|(\S+))'
)


@dataclass
class Registry:
    url: str
    address: str
    """`127.0.0.1:PORT`, as skopeo wants it."""
    storage: Path
    log: Path
    process: subprocess.Popen[bytes]

    def requests(self, settle: float = 0.3) -> list[tuple[str, str]]:
        """(method, uri) of every request the registry has answered so far, in order.

        The registry logs a request just as it answers it, so wait until the log stops growing.
        """
        text = self.log.read_text(errors="replace")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(settle)
            newer = self.log.read_text(errors="replace")
            if newer == text:
                break
            text = newer
        return [(method, quoted or plain) for method, quoted, plain in _REQUEST.findall(text)]

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(storage: Path, address: str, htpasswd: Path | None) -> str:
    auth = ""
    if htpasswd is not None:
        auth = f"auth:\n  htpasswd:\n    realm: modelfs-test\n    path: {htpasswd}\n"
    return (
        "version: 0.1\n"
        "log:\n  level: info\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n" + auth
    )


@contextmanager
def running_registry(workdir: Path, *, htpasswd: bool = False) -> Iterator[Registry]:
    """Start a registry in `workdir` (created), wait until it answers, stop it afterwards.

    With `htpasswd`, it demands basic auth for HTPASSWD_USER / HTPASSWD_PASSWORD.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "storage"
    storage.mkdir(exist_ok=True)
    auth_file = None
    if htpasswd:
        auth_file = workdir / "htpasswd"
        auth_file.write_text(HTPASSWD_LINE + "\n")
    log = workdir / "registry.log"
    last_error = ""
    for _attempt in range(5):  # another process may take the free port before the registry
        address = f"127.0.0.1:{free_port()}"
        config = workdir / "config.yml"
        config.write_text(_config(storage, address, auth_file))
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [DOCKER_REGISTRY, "serve", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        registry = Registry(f"http://{address}", address, storage, log, process)
        try:
            if _wait_ready(registry):
                break
            last_error = registry.log_tail()
        except BaseException:
            stop(process)
            raise
        stop(process)
    else:
        raise AssertionError(f"docker-registry did not start:\n{last_error}")
    try:
        yield registry
    finally:
        stop(process)


def _wait_ready(registry: Registry, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            return False
        try:
            response = httpx.get(f"{registry.url}/v2/", timeout=1.0)
            if response.status_code in (200, 401):
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return False
