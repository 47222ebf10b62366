"""What the registry server counts (`Stats`), and /metrics: those counts and the store's in
Prometheus text format."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from modelfs.sync.registry.view import View

# One Prometheus metric: name (after `modelfs_`), type, help, and (labels, value) samples.
MetricFamily = tuple[str, str, str, list[tuple[str, float]]]
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class Stats:
    started: float = field(default_factory=time.monotonic)
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    bytes_served: int = 0
    blobs_served: int = 0
    manifests_served: int = 0


def metrics_text(view: View, s: Stats, extra: Iterable[MetricFamily]) -> str:
    """The counters, the store's counts and `extra` families in Prometheus text format."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> None:
        out.append(f"# HELP modelfs_{name} {help_text}")
        out.append(f"# TYPE modelfs_{name} {kind}")
        for labels, value in samples:
            out.append(
                f"modelfs_{name}{labels} {value:g}"
                if isinstance(value, float)
                else f"modelfs_{name}{labels} {value}"
            )

    metric(
        "http_requests_total",
        "counter",
        "HTTP requests answered, by method and status code.",
        ((f'{{method="{m}",code="{c}"}}', n) for (m, c), n in sorted(s.requests.items())),
    )
    metric("bytes_served_total", "counter", "Response body bytes sent.", [("", s.bytes_served)])
    metric(
        "blobs_served_total",
        "counter",
        "Blob GETs answered with the blob.",
        [("", s.blobs_served)],
    )
    metric("manifests_served_total", "counter", "Manifest GETs served.", [("", s.manifests_served)])
    metric("models", "gauge", "Tags in the store.", [("", len(view.index))])
    metric("blobs", "gauge", "Blobs in the store.", [("", len(view.index.blob_names))])
    metric(
        "store_problems",
        "gauge",
        "Problems found by the last scan.",
        [("", len(view.index.problems))],
    )
    metric(
        "uptime_seconds",
        "gauge",
        "Seconds since the server started.",
        [("", round(time.monotonic() - s.started, 3))],
    )
    for family in extra:
        metric(*family)
    return "\n".join(out) + "\n"
