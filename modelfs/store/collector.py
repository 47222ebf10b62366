"""Python's cyclic garbage collector, paused while a scan or a GC plan builds its objects.

A scan of 5,000 models makes some 100,000 objects (names, manifests, layers, digests) and a
GC plan reads 100,000 layers from JSON. None of them forms a reference cycle, so reference
counting frees all they drop, yet the collector walks the young ones every 700 allocations
and, as the kept ones pile up, all of them now and then: a fifth of a scan's time, measured
(`scripts/bench/scan`, `scripts/bench/gc`), for nothing it could free.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cycles_uncollected() -> Iterator[None]:
    """Pause the cyclic collector for the block. It is process-wide: another thread that
    pauses it meanwhile finds it paused and leaves it to this one to turn back on, so it
    ends on whatever the first pauser found."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
