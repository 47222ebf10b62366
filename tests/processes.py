"""Child processes the tests start: the one way to stop them."""

from __future__ import annotations

import signal
import subprocess


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a clean shutdown is what most tests want to see), then SIGKILL after 10 s, so
    a process that hangs on the way out never outlives its test."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
