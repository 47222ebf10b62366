"""A lease kept on disk from trio: what the mount (fsd) and a pull (sync) share of lease
keeping. It lives in `runtime`, beside both, so that fsd and sync do not import each other.

store.leases.LeaseKeeper counts what is held and writes the file; LiveLease says when:

- `await hold(...)` returns once the file on disk lists everything held, so a GC on any host
  that reads the leases after it returned sees it. Writes go through a worker thread.
- `drop(...)` only marks the lease changed; the `run` task writes it soon after, and touches
  the file every `heartbeat` seconds between changes.
- `leased(...)` writes the (empty) lease on entry, runs that task, and removes the file on
  exit however the body ends. A process killed with -9 leaves it to expire by its TTL.

Writes are serialized, so the file on disk only moves forward. A `strict` lease (a pull)
raises the OSError when a hold cannot be written: nothing is fetched that is not leased.
Another (the mount of a read-only store) logs one warning, goes on unleased, and tries again
at every hold and heartbeat.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Iterable

import trio

from modelfs.store.digest import Digest
from modelfs.store.leases import HEARTBEAT, LeaseKeeper

log = logging.getLogger(__name__)


class LiveLease:
    def __init__(self, keeper: LeaseKeeper, *, strict: bool, heartbeat: float = HEARTBEAT) -> None:
        self.keeper = keeper
        self.strict = strict
        self.heartbeat = heartbeat
        self.failing: str | None = None  # why the last write failed; None while on disk
        self.closed = False
        self._lock = trio.Lock()
        self._changed = trio.Event()
        # (due, order, digests, manifests): a heap, earliest first
        self._lingering: list[tuple[float, int, tuple[Digest, ...], tuple[Digest, ...]]] = []
        self._order = itertools.count()

    async def hold(self, digests: Iterable[Digest] = (), manifests: Iterable[Digest] = ()) -> None:
        """Hold, and return once the lease on disk says so (or, not strict, failed to)."""
        self.keeper.hold(digests, manifests)
        try:
            await self._save()
        except OSError as exc:
            if self.strict:
                raise
            self._failed(exc)

    def drop(
        self,
        digests: Iterable[Digest] = (),
        manifests: Iterable[Digest] = (),
        *,
        linger: float = 0.0,
    ) -> None:
        """Let go; written by `run` soon after (a GC that still sees it only keeps more).

        With `linger`, the hold stays that many seconds more, so a file closed and opened
        again at once (a loader that opens a model twice, a benchmark's passes) finds its
        hold on disk already instead of waiting for a second fsynced write."""
        if linger > 0:
            due = trio.current_time() + linger
            earliest = not self._lingering or due < self._lingering[0][0]
            item = (due, next(self._order), tuple(digests), tuple(manifests))
            heapq.heappush(self._lingering, item)
            if earliest:
                self._changed.set()  # `run` sets its alarm by the earliest
            return
        self.keeper.drop(digests, manifests)
        if self.keeper.dirty:
            self._changed.set()

    def _drop_due(self) -> None:
        now = trio.current_time()
        while self._lingering and self._lingering[0][0] <= now:
            _, _, digests, manifests = heapq.heappop(self._lingering)
            self.keeper.drop(digests, manifests)

    async def _save(self, *, touch: bool = False) -> None:
        """Write the lease if it changed since it was last written, else touch it if asked."""
        async with self._lock:
            keeper = self.keeper
            if self.closed or not (keeper.dirty or touch):
                return
            snapshot = keeper.snapshot()  # taken here: the counts change while a thread writes
            if keeper.dirty:
                await trio.to_thread.run_sync(keeper.write, snapshot)
            else:
                await trio.to_thread.run_sync(keeper.touch, snapshot)
            if self.failing is not None:
                log.info("lease %s written", keeper.path)
                self.failing = None

    def _failed(self, exc: OSError) -> None:
        why = exc.strerror or str(exc)
        if self.failing is None:
            log.warning(
                "cannot write lease %s: %s; a GC on this store will not know what this %s "
                "holds (going on without it)",
                self.keeper.path,
                why,
                self.keeper.purpose,
            )
        self.failing = why

    async def run(self) -> None:
        """Write changes soon after they happen; touch the file every `heartbeat` seconds."""
        beat = trio.current_time() + self.heartbeat
        while True:
            alarm = min(beat, self._lingering[0][0]) if self._lingering else beat
            with trio.move_on_at(alarm):
                await self._changed.wait()
            self._changed = trio.Event()
            self._drop_due()
            touch = trio.current_time() >= beat
            if touch or self.keeper.dirty:
                beat = trio.current_time() + self.heartbeat
            try:
                await self._save(touch=touch)
            except OSError as exc:
                self._failed(exc)

    async def close(self) -> None:
        """Remove the file, even from a cancelled task; a write in flight finishes first."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                self.closed = True
                try:
                    await trio.to_thread.run_sync(self.keeper.remove)
                except OSError as exc:
                    if self.failing is None:
                        why = exc.strerror or str(exc)
                        log.warning("cannot remove lease %s: %s", self.keeper.path, why)


@contextlib.asynccontextmanager
async def leased(
    keeper: LeaseKeeper, *, strict: bool, heartbeat: float = HEARTBEAT
) -> AsyncIterator[LiveLease]:
    """A LiveLease on disk (and kept alive) for the body; its file removed after it."""
    lease = LiveLease(keeper, strict=strict, heartbeat=heartbeat)
    await lease.hold()  # strict: an OSError here, before anything else happened
    failure: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lease.run)
            try:
                yield lease
            except BaseException as exc:
                failure = exc  # raised below as itself, not inside the nursery's group
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await lease.close()
    if failure is not None:
        raise failure
