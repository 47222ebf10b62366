"""How `modelfs pull` shows a pull's progress (modelfs/sync/pull/progress.py has the events):

JsonProgress(stream)      one JSON object per line, the shape of Ollama's /api/pull
                          stream: {"status"[, "digest", "total", "completed"]}
BarProgress(stream)       one redrawn line per model on a terminal
LineProgress(logger)      plain log lines (stderr that is not a terminal)
"""

from __future__ import annotations

import json
import logging
import time
from typing import TextIO

from modelfs.store.digest import Digest
from modelfs.store.units import human_bytes
from modelfs.sync.pull.progress import PULLING_MANIFEST, SUCCESS, Totals, pulling


class JsonProgress:
    """NDJSON on `stream`. Blob lines are sent when a blob starts, at most every `interval`
    seconds while it moves, and when it completes."""

    def __init__(self, stream: TextIO, interval: float = 0.1) -> None:
        self.stream = stream
        self.interval = interval
        self._last: dict[Digest, tuple[float, int]] = {}

    def _emit(self, obj: dict[str, object]) -> None:
        self.stream.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.stream.flush()

    def status(self, model: str, status: str) -> None:
        self._emit({"status": status})

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        now = time.monotonic()
        last = self._last.get(digest)
        if last is not None:
            when, sent = last
            if completed == sent or (completed < total and now - when < self.interval):
                return
        self._last[digest] = (now, completed)
        self._emit(
            {
                "status": pulling(digest),
                "digest": str(digest),
                "total": total,
                "completed": completed,
            }
        )

    def done(self, model: str) -> None:
        self._emit({"status": SUCCESS})

    def error(self, message: str) -> None:
        self._emit({"error": message})


class BarProgress:
    """One line per model, redrawn in place: name, bar, percent, bytes, rate."""

    WIDTH = 24

    def __init__(self, stream: TextIO, interval: float = 0.1) -> None:
        self.stream = stream
        self.interval = interval
        self._models: dict[str, Totals] = {}
        self._status: dict[str, str] = {}
        self._drawn = 0.0
        self._open = False

    def _draw(self, model: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < self.interval:
            return
        self._drawn = now
        t = self._models.get(model)
        status = self._status.get(model, "")
        if t is None or t.total == 0:
            line = f"{model}  {status}"
        else:
            frac = min(1.0, t.completed / t.total)
            fill = int(frac * self.WIDTH)
            bar = "█" * fill + "░" * (self.WIDTH - fill)
            rate = t.rate()
            speed = f"  {human_bytes(int(rate))}/s" if rate else ""
            line = (
                f"{model}  {bar} {frac * 100:3.0f}%  "
                f"{human_bytes(t.completed)}/{human_bytes(t.total)}{speed}"
            )
            if status and not status.startswith("pulling "):
                line += f"  {status}"
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()
        self._open = True

    def status(self, model: str, status: str) -> None:
        self._models.setdefault(model, Totals())
        self._status[model] = status
        self._draw(model, force=True)

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        self._models.setdefault(model, Totals()).update(digest, total, completed)
        self._draw(model)

    def done(self, model: str) -> None:
        self._status[model] = SUCCESS
        self._draw(model, force=True)
        self.stream.write("\n")
        self.stream.flush()
        self._open = False

    def error(self, message: str) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


class LineProgress:
    """Log lines: each status once, and a progress line per model every `interval` s."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.log = logger
        self.interval = interval
        self._models: dict[str, Totals] = {}
        self._said: dict[str, float] = {}

    def status(self, model: str, status: str) -> None:
        self._models.setdefault(model, Totals())
        self._said.setdefault(model, time.monotonic())
        if not status.startswith("pulling ") or status == PULLING_MANIFEST:
            self.log.info("%s: %s", model, status)

    def blob(self, model: str, digest: Digest, total: int, completed: int) -> None:
        t = self._models.setdefault(model, Totals())
        t.update(digest, total, completed)
        now = time.monotonic()
        if now - self._said.get(model, now) >= self.interval:
            self._said[model] = now
            rate = t.rate()
            self.log.info(
                "%s: %.0f%% (%s of %s%s)",
                model,
                100 * t.completed / t.total if t.total else 100,
                human_bytes(t.completed),
                human_bytes(t.total),
                f", {human_bytes(int(rate))}/s" if rate else "",
            )

    def done(self, model: str) -> None:
        t = self._models.get(model)
        if t is not None and t.total:
            elapsed = time.monotonic() - t.started
            self.log.info(
                "%s: success (%s in %.1f s)", model, human_bytes(t.total - t.base), elapsed
            )
        else:
            self.log.info("%s: success", model)

    def error(self, message: str) -> None:
        pass
