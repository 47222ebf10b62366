"""The sync daemon as a user meets it: `modelfs status` finds it through its config, and a
host takes catalogs and manifests only from peers that prove they hold the shared token.
Daemons and impostors are separate processes on loopback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.test_daemon import MODELFS, daemon
from tests.test_pull_hosts import _env


def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MODELFS, "status", *args], capture_output=True, text=True, timeout=30, env=_env()
    )


def test_status_finds_the_daemon_through_its_config_alone(tmp_path: Path) -> None:
    """No --url, no --token-file: the listen address and the token come from the config."""
    token = tmp_path / "token"
    token.write_text("c3RhdHVzLWZpbmRzLWl0cy1kYWVtb24=\n")
    with daemon(tmp_path, "solo", store=str(tmp_path / "s"), token_file=str(token)) as d:
        r = status_cli("--config", str(d.config))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("host solo: store "), r.stdout
        # --url still wins over the config's address.
        r = status_cli("--config", str(d.config), "--url", "http://127.0.0.1:9")
        assert r.returncode == 1 and "no sync daemon answers at http://127.0.0.1:9" in r.stderr
    missing = tmp_path / "nowhere.toml"
    r = status_cli("--config", str(missing))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"modelfs: error: {missing}: cannot read: No such file or directory"
    ]
