"""What a pull says while it runs: the events (`Progress`), Ollama's status words, and the
byte tally of a model's blobs. The pull calls a Progress from the trio thread only (the
executor polls its transfer threads), so none of them lock. Renderers for a user (NDJSON in
the shape of Ollama's /api/pull stream, a bar on a terminal, log lines) are the CLI's:
modelfs/cli/progress.py.

The statuses are Ollama's: "pulling manifest", "pulling <digest[:12]>", "verifying sha256
digest", "writing manifest", "success"; an error ends a JSON stream with {"error": "..."} as
Ollama's does.
"""

from __future__ import annotations

import time
from typing import Protocol

from modelfs.store.digest import Digest

PULLING_MANIFEST = "pulling manifest"
VERIFYING = "verifying sha256 digest"
WRITING_MANIFEST = "writing manifest"
SUCCESS = "success"


def pulling(digest: Digest) -> str:
    return f"pulling {digest.short}"


class Progress(Protocol):
    def status(self, model: str, status: str) -> None: ...

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None: ...

    def done(self, model: str) -> None: ...

    def error(self, message: str) -> None: ...


class NullProgress:
    def status(self, model: str, status: str) -> None:
        pass

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        pass

    def done(self, model: str) -> None:
        pass

    def error(self, message: str) -> None:
        pass


class Totals:
    """The blobs of one model: their sizes, the bytes done, and the rate since it started."""

    def __init__(self) -> None:
        self.blobs: dict[Digest, tuple[int, int]] = {}
        self.started = time.monotonic()
        self.base = 0  # bytes already complete when the model started (present blobs)

    def update(self, digest: Digest, total: int, completed: int) -> None:
        if digest not in self.blobs and completed >= total:
            self.base += total
        self.blobs[digest] = (total, completed)

    @property
    def total(self) -> int:
        return sum(t for t, _ in self.blobs.values())

    @property
    def completed(self) -> int:
        return sum(c for _, c in self.blobs.values())

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        moved = self.completed - self.base
        return moved / elapsed if elapsed > 0.2 and moved > 0 else 0.0


class TallyProgress(NullProgress):
    """Bytes of a pull's blobs, all and done so far: what the sync daemon's status shows of
    each transfer in flight."""

    def __init__(self) -> None:
        self.totals = Totals()

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        self.totals.update(digest, total, completed)
