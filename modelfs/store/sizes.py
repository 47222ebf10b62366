"""Sizes as `ollama list` prints them (ollama/ollama fb30760 format/bytes.go): the one
spelling of a byte count in tables, logs and errors."""

from __future__ import annotations

import math

_UNITS = ((1000**4, "TB"), (1000**3, "GB"), (1000**2, "MB"), (1000, "KB"))


def human_bytes(n: int) -> str:
    """Decimal units, as Ollama's format.HumanBytes: `17 GB`, `2.5 GB`, `300 B`."""
    for scale, unit in _UNITS:
        if n >= scale:
            value = float(n) / scale  # Go divides float64(b), rounded first
            if value >= 10 or value == math.trunc(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 model`, `2 models`, `0 models`: a count in words, never `(s)`."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
