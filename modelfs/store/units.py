"""Quantities as users read and write them: durations as flags and the config take them
(`90s`, `10m`, `1h`, `7d`, or plain seconds), byte sizes as `ollama list` prints them
(ollama/ollama fb30760 format/bytes.go), the one spelling of a byte count in tables, logs and
errors, and counts in words."""

from __future__ import annotations

import math

_TIME_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds, zero or more; ValueError with the text quoted otherwise."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * _TIME_UNITS[t[-1]] if t[-1:] in _TIME_UNITS else float(t)
    except (ValueError, KeyError):
        raise ValueError(f"expected a duration like 90s, 10m, 1h or 7d, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"expected a duration like 90s, 10m, 1h or 7d, got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: 3600 -> `1h`, 90 -> `90s`."""
    for unit in ("d", "h", "m"):
        size = _TIME_UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


_SIZE_UNITS = ((1000**4, "TB"), (1000**3, "GB"), (1000**2, "MB"), (1000, "KB"))


def human_bytes(n: int) -> str:
    """Decimal units, as Ollama's format.HumanBytes: `17 GB`, `2.5 GB`, `300 B`."""
    for scale, unit in _SIZE_UNITS:
        if n >= scale:
            value = float(n) / scale  # Go divides float64(b), rounded first
            if value >= 10 or value == math.trunc(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 model`, `2 models`, `0 models`: a count in words, never `(s)`."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
