"""A mount started the way systemd/modelfs-mount.service starts it, or as a plain user, on a
machine without that user: in a mount namespace of its own that has the user (tests and
scripts/bench/read share this).

The namespace looks like a Debian host with Ollama installed: the unit's user exists,
/dev/fuse is 0666 and /etc/fuse.conf has user_allow_other (scripts/install sets it),
and the interpreter is reachable by that user. Its mount is seen from outside through the
daemon's /proc/PID/root (the daemon is the Popen's own process: unshare, sh and setpriv exec).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "modelfs-mount.service"
UID = 4242  # the unit's user, made in the namespace only


def unit_settings() -> dict[str, str]:
    settings = {}
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings[key] = value
    return settings


def setpriv_args(settings: dict[str, str], *, unit: bool = True) -> list[str]:
    """setpriv doing what systemd does with the unit's User=, Group= and capabilities; with
    unit=False, the same user as a login gives it (no capability, the full bounding set)."""
    who = [f"--reuid={settings['User']}", f"--regid={settings['Group']}", "--clear-groups"]
    if not unit:
        return ["setpriv", *who, "--inh-caps=-all", "--ambient-caps=-all"]
    ambient = [c.lower().removeprefix("cap_") for c in settings["AmbientCapabilities"].split()]
    bounding = [c.lower().removeprefix("cap_") for c in settings["CapabilityBoundingSet"].split()]
    caps = ",".join(f"+{c}" for c in ambient)
    return [
        "setpriv", *who, f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}",
        "--bounding-set=-all," + ",".join(f"+{c}" for c in bounding),
    ]  # fmt: skip


def fresh_root_script(work: Path, user: str, group: str) -> str:
    """`sh -c` lines that set the namespace up (files go into `work`), then exec "$@"."""
    (work / "passwd").write_text(
        Path("/etc/passwd").read_text() + f"{user}:x:{UID}:{UID}::/nonexistent:/bin/false\n"
    )
    (work / "group").write_text(Path("/etc/group").read_text() + f"{group}:x:{UID}:\n")
    (work / "fuse.conf").write_text("user_allow_other\n")
    lines = [
        "set -e",
        f"mknod -m 0666 {work}/fuse c 10 229",
        f"mount --bind {work}/fuse /dev/fuse",
        *(f"mount --bind {work}/{f} /etc/{f}" for f in ("passwd", "group", "fuse.conf")),
    ]
    python = Path(os.path.realpath(sys.executable))
    if python.is_relative_to("/root"):  # 0700: this run's interpreter is in there
        top = Path("/root") / python.relative_to("/root").parts[0]
        lines += [
            f"mkdir {work}/keep",
            f"mount --bind {top} {work}/keep",
            "mount -t tmpfs -o mode=0755 none /root",
            f"mkdir {top}",
            f"mount --bind {work}/keep {top}",
        ]
    return "\n".join([*lines, 'exec "$@"'])


def namespaced_argv(work: Path, argv: list[str], *, unit: bool = True) -> list[str]:
    """`argv` run as the unit runs it (or as its user, unit=False), in a namespace set up in
    `work` (which must be reachable by that user)."""
    settings = unit_settings()
    script = fresh_root_script(work, settings["User"], settings["Group"])
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
        *setpriv_args(settings, unit=unit), *argv,
    ]  # fmt: skip


def seen_from_outside(pid: int, path: Path) -> Path:
    """`path` in the namespace of process `pid`, as this process can open it."""
    return Path(f"/proc/{pid}/root") / path.resolve().relative_to("/")


def capabilities(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("CapEff:")).split()[1], 16)
