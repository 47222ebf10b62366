"""What the mount asks of the C allocator, so that its resident size follows what it holds.

A rebuild frees a whole tree at once, and glibc's malloc keeps most of what is freed: `free`
gives memory back to the kernel only from the top of a heap, and each thread that allocates
while another holds an arena gets an arena of its own (up to eight per CPU), each with its own
high-water mark. Rebuilds run in trio's worker threads, so successive trees were built in
different arenas, and the resident size rose by ~2 MiB over the first 100 store changes of
`scripts/bench/mount-memory` with nothing more alive (1.09x; with MALLOC_ARENA_MAX=1, 1.03x).

Both calls are glibc's; elsewhere (musl) they are missing and nothing is done.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h

_libc = ctypes.CDLL(None)


def one_arena() -> None:
    """Have every thread allocate from the main arena. Python code runs one thread at a time
    (the GIL), so arenas per thread buy the mount no parallelism, only memory. To be called
    before any thread starts: a thread keeps the arena it already has."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None and not mallopt(M_ARENA_MAX, 1):
        log.debug("mallopt(M_ARENA_MAX, 1) refused")


def trim() -> None:
    """Give the free pages inside the heap back to the kernel, not only those at its top
    (glibc's malloc_trim(0), ~0.2 ms after a rebuild of 200 models)."""
    malloc_trim = getattr(_libc, "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
