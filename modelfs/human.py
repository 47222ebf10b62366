"""Sizes and times as `ollama list` prints them (format/bytes.go, format/time.go)."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

_UNITS = ((1000**4, "TB"), (1000**3, "GB"), (1000**2, "MB"), (1000, "KB"))


def human_bytes(n: int) -> str:
    """Decimal units, as Ollama's format.HumanBytes: `17 GB`, `2.5 GB`, `300 B`."""
    for scale, unit in _UNITS:
        if n >= scale:
            value = n / scale
            if value >= 10 or value == math.trunc(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = s // 60
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds / 3600 / 24 / 365)} years"


def human_time(ts: float, now: float | None = None) -> str:
    delta = (time.time() if now is None else now) - ts
    if delta < 0:
        return f"{_duration(-delta)} from now"
    return f"{_duration(delta)} ago"


def rfc3339_nano(mtime_ns: int) -> str:
    """Go's time.RFC3339Nano in local time: trailing zeros of the fraction dropped."""
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    local = datetime.fromtimestamp(seconds, UTC).astimezone()
    text = local.strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        text += "." + f"{nanos:09d}".rstrip("0")
    offset = local.strftime("%z")
    text += "Z" if offset in ("+0000", "") else f"{offset[:3]}:{offset[3:]}"
    return text


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns separated by at least three spaces, like Ollama's tabwriter."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=True)]
        lines.append("   ".join(cells).rstrip())
    return "\n".join(lines)
