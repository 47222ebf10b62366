"""`modelfs push` on a terminal: the progress line, the summary per model, JSON lines.

The pushing itself is modelfs/sync/client/push.py; this module only says what it did.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TextIO

import trio

from modelfs.store.formats.artifacts import OLLAMA
from modelfs.store.scan import StoreIndex
from modelfs.sync.client.credentials import Credentials
from modelfs.sync.client.peer import peer_session
from modelfs.sync.client.push import Progress, PushResult, check_url, plan_model, push_all

log = logging.getLogger(__name__)


def _human_bytes(n: int) -> str:
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "KB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def summary(result: PushResult, url: str) -> str:
    """One human line per pushed model."""
    where = f"{url}/{result.repository}:{result.tag}"
    blobs = result.uploaded + result.mounted + result.present
    counts = (
        f"{blobs} blobs: {result.uploaded} uploaded ({_human_bytes(result.uploaded_bytes)}), "
        f"{result.mounted} mounted, {result.present} already there"
    )
    line = f"pushed {result.name.shortest} to {where} ({result.digest.short}, {counts}"
    if result.variants:
        line += f"; variants: {', '.join(result.variants)}"
    if result.left_out:
        line += f"; not pushed (absent here): {', '.join(result.left_out)}"
    if not result.manifests_pushed and not result.uploaded and not result.mounted:
        line += "; already up to date"
    return line + ")"


class TerminalProgress:
    """A single status line rewritten in place on a terminal (stderr)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.width = 0

    def __call__(self, p: Progress) -> None:
        if p.status.startswith("pushing ") and p.status != "pushing manifest":
            text = p.status
        elif p.total:
            text = f"{p.status} {p.digest[7:19]} {p.completed * 100 // p.total:3d}% of "
            text += _human_bytes(p.total)
        else:
            text = f"{p.status} {p.digest[7:19]}"
        self.stream.write("\r" + text.ljust(self.width))
        self.width = len(text)
        self.stream.flush()

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def run_push(
    index: StoreIndex,
    names: Sequence[str],
    url: str,
    *,
    json_lines: bool = False,
    credentials: Credentials | None = None,
    fmt: str = OLLAMA,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> list[PushResult]:
    """`modelfs push`: plan every name (refusing before any upload), then push them in order."""
    out = out or sys.stdout
    err = err or sys.stderr
    base = check_url(url)
    plans = [plan_model(index, name, fmt, base) for name in names]
    terminal = TerminalProgress(err) if not json_lines and err.isatty() else None
    # httpx logs every request at INFO: worth seeing with -v, noise otherwise.
    verbose = log.isEnabledFor(logging.DEBUG)
    logging.getLogger("httpx").setLevel(logging.NOTSET if verbose else logging.WARNING)

    def progress(p: Progress) -> None:
        if json_lines:
            out.write(p.as_json() + "\n")
            out.flush()
        elif terminal is not None:
            terminal(p)

    def on_result(result: PushResult) -> None:
        if terminal is not None:
            terminal.clear()
        if not json_lines:
            out.write(summary(result, base) + "\n")
            out.flush()

    async def main() -> list[PushResult]:
        async with peer_session(credentials, push=True) as session:
            try:
                return await push_all(
                    plans, base, session.http, progress=progress, on_result=on_result
                )
            finally:
                if terminal is not None:
                    terminal.clear()

    return trio.run(main)
