"""Durations as users write them in flags and the config: `90s`, `10m`, `1h`, `7d`, or
plain seconds."""

from __future__ import annotations

import math

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds, zero or more; ValueError with the text quoted otherwise."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * _UNITS[t[-1]] if t[-1:] in _UNITS else float(t)
    except (ValueError, KeyError):
        raise ValueError(f"expected a duration like 90s, 10m, 1h or 7d, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"expected a duration like 90s, 10m, 1h or 7d, got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: 3600 -> `1h`, 90 -> `90s`."""
    for unit in ("d", "h", "m"):
        size = _UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
