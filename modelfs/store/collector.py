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
            _promote()
            gc.enable()


def _promote() -> None:
    """Move what the block made to the oldest generation as it stands. Turned back on as it
    was, the collector's next allocation finds its young generation holding all of it and
    walks it (10 ms after an index load, 8 ms after a warm scan of 5,000 models, measured
    with scripts/bench/scan's store), and again as it ages. freeze() moves every tracked
    object to the permanent generation and unfreeze() that to the oldest, each in constant
    time; a full collection still looks at all of it. Not when something is frozen already
    (a mount freezes the tree it serves, fsd.mount): unfreeze() would let that go too."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
