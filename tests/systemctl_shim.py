"""`systemctl` for tests/test_install.py's fresh root, where no systemd runs (not PID 1).

    systemctl daemon-reload
    systemctl enable --now UNIT...

It starts what `enable --now` would, from the unit file in /etc/systemd/system: each
ExecStartPre= (a leading `+` runs it as root), then ExecStart= as User=/Group= with the
unit's Environment=; with ProtectHome=yes in a mount namespace of its own where /home, /root
and /run/user are hidden, as systemd does, and $SHIM_HIDE too (the test hides the checkout
there, so an install that still needs it fails). For Type=notify it waits for READY=1 on
$NOTIFY_SOCKET, as `systemctl start` does. Each started process is written as `UNIT PID` to
$SHIM_STATE/pids (the test stops them); its output goes to $SHIM_STATE/UNIT.log. Run by the
host's /usr/bin/python3 (standard library only).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

UNITS = Path("/etc/systemd/system")
READY_TIMEOUT = 90.0
# systemd's own default PATH for services
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def parse(path: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        keys.setdefault(key, []).append(value)
    return keys


def one(keys: dict[str, list[str]], key: str, default: str = "") -> str:
    return keys.get(key, [default])[-1]


def start(name: str, state: Path) -> None:
    unit = parse(UNITS / name)
    if name.endswith(".timer"):
        return  # enabling a timer starts nothing now
    for pre in unit.get("ExecStartPre", []):
        if not pre.startswith("+"):
            raise SystemExit(f"systemctl(shim): {name}: only '+' ExecStartPre= is supported")
        subprocess.run(shlex.split(pre[1:]), check=True)
    env = {"PATH": PATH, "LANG": "C.UTF-8"}
    for assignment in unit.get("Environment", []):
        for word in shlex.split(assignment):
            k, v = word.split("=", 1)
            env[k] = v
    user, group = one(unit, "User", "root"), one(unit, "Group", "root")
    # systemd gives a unit a mount namespace only for options like ProtectHome=; the mount
    # unit has none, so its FUSE mount is seen by everyone.
    hide = []
    if one(unit, "ProtectHome") == "yes":
        hide += [d for d in ("/home", "/root", "/run/user") if os.path.isdir(d)]
        if os.environ.get("SHIM_HIDE"):
            hide.append(os.environ["SHIM_HIDE"])
    notify = None
    if one(unit, "Type") == "notify":
        sock_path = state / f"{name}.notify"
        sock_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(sock_path))
        os.chmod(sock_path, 0o777)
        notify.settimeout(0.5)
        env["NOTIFY_SOCKET"] = str(sock_path)
    as_user = ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--"]
    argv = [*as_user, *shlex.split(one(unit, "ExecStart"))]
    if hide:
        mounts = "".join(f"mount -t tmpfs -o mode=000 tmpfs {shlex.quote(d)} && " for d in hide)
        argv = ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c",
                mounts + 'exec "$@"', "sh", *argv]  # fmt: skip
    log = open(state / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
    )
    with open(state / "pids", "a") as f:
        f.write(f"{name} {proc.pid}\n")
    if notify is None:
        return
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (state / f"{name}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"systemctl(shim): {name} exited with {proc.returncode}: {tail}")
        try:
            if "READY=1" in notify.recv(4096).decode().splitlines():
                return
        except TimeoutError:
            pass
    raise SystemExit(f"systemctl(shim): {name}: no READY=1 in {READY_TIMEOUT:.0f} s")


def main(argv: list[str]) -> int:
    state = Path(os.environ["SHIM_STATE"])
    with open(state / "calls", "a") as f:
        f.write(" ".join(argv) + "\n")
    if argv == ["daemon-reload"]:
        return 0
    if argv[:2] == ["enable", "--now"] and len(argv) > 2:
        for name in argv[2:]:
            start(name, state)
        return 0
    print(f"systemctl(shim): unsupported: {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
