"""Sizes and times as `ollama list` prints them (format/bytes.go, format/time.go); sizes are
store.units', shared with the layers below."""

from __future__ import annotations

import re
import time
from typing import Any

_HOUR_NS = 3600 * 1_000_000_000
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def go_text(text: str) -> str:
    """`text` as Go holds it: a lone surrogate (JSON `"\\ud800"`, which Python's decoder keeps
    and no UTF-8 encoder accepts) becomes U+FFFD, as Go's decoder makes it."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def go_strings(obj: Any) -> Any:
    """`go_text` over every string (keys too) of a JSON-shaped object."""
    if isinstance(obj, str):
        return go_text(obj)
    if isinstance(obj, dict):
        return {go_text(k): go_strings(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [go_strings(v) for v in obj]
    return obj


def _duration(ns: int) -> str:
    """Go's humanDuration, in integer nanoseconds as time.Duration is (`ns` >= 0)."""
    seconds = ns // 1_000_000_000
    if seconds < 1:
        return "Less than a second"
    if seconds == 1:
        return "1 second"
    if seconds < 60:
        return f"{seconds} seconds"
    minutes = ns // 60_000_000_000
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    # Go's math.Round rounds half away from zero; Python's round() would give 2 for 2.5 h.
    whole_hours, rest = divmod(ns, _HOUR_NS)
    hours = whole_hours + (1 if 2 * rest >= _HOUR_NS else 0)
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
    return f"{whole_hours // 24 // 365} years"


def human_time(ts: float, now: float | None = None) -> str:
    """`ollama list`'s MODIFIED column (format.HumanTime): `2 weeks ago`, `3 hours from now`."""
    delta = round(((time.time() if now is None else now) - ts) * 1e9)
    if delta < 0:
        # Go: int(delta.Hours())/24/365 < -20, with division truncating toward zero.
        if -delta // _HOUR_NS // (24 * 365) > 20:
            return "Forever"
        return f"{_duration(-delta)} from now"
    return f"{_duration(delta)} ago"


def rfc3339_nano(mtime_ns: int) -> str:
    """Go's time.Format(time.RFC3339Nano) in local time, as Ollama's JSON prints a mtime.

    The fraction loses its trailing zeros (and its dot when zero); a zero UTC offset prints
    `Z`; an offset with seconds (pre-1900 local mean time) is cut to minutes, as Go does.
    """
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    try:
        t = time.localtime(seconds)
        offset = t.tm_gmtoff or 0
    except (OverflowError, OSError, ValueError):
        t, offset = time.gmtime(seconds), 0
    year = f"-{-t.tm_year:04d}" if t.tm_year < 0 else f"{t.tm_year:04d}"
    text = f"{year}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    if nanos:
        text += "." + f"{nanos:09d}".rstrip("0")
    if offset == 0:
        return text + "Z"
    zone = abs(offset) // 60  # Go: offset / 60, truncated toward zero
    sign = "-" if offset < 0 and zone else "+"
    return f"{text}{sign}{zone // 60:02d}:{zone % 60:02d}"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns four spaces apart, as `ollama list` pads its tablewriter.

    Ollama also leaves the padding after the last column; we trim trailing blanks.
    """
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=True)]
        lines.append("    ".join(cells).rstrip())
    return "\n".join(lines)
