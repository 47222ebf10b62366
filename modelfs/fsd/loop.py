"""pyfuse3's request loop with one pass of trio's scheduler per request instead of three.

pyfuse3 reads requests in worker tasks that take turns waiting on the FUSE fd under a
`trio.Lock`: a worker waits for the fd holding the lock, releases it when a request arrives
(waking the next worker, which takes its turn at the fd), and handles the request. So every
request costs trio three scheduler passes (the uncontended acquire is a checkpoint; the woken
worker must run to start its wait), each an `epoll_wait`, the run queue and the deadlines.
On a metadata walk such as `ls -lR`, where a request's own work is a dict look-up, that was
a third of the daemon's CPU.

Almost every handler finishes without suspending, so the worker that just handled a request
might as well wait for the next one itself. `FastLock` releases without waking anyone, and
takes an uncontended lock without yielding; the other worker stays parked until a handler
really suspends (`handing_off` wraps every handler: a lease write on `open`, a GGUF header
read for an xattr), and then it takes the fd at once, as with pyfuse3's own lock. A parked
worker also looks every WAKE_S seconds whether the lock has been left free, so a worker that
leaves the loop (an unmount from outside) can never strand the others.

pyfuse3 finds trio through its module attribute `pyfuse3.trio` (its asyncio mode swaps it the
same way); `install` puts there a view of trio whose `Lock` is `FastLock`. The mount skips
that with MODELFS_FUSE_LOOP=trio (for comparisons, or should a pyfuse3 release change its loop).
"""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

import pyfuse3
import trio

T = TypeVar("T")

WAKE_S = 0.5

_lock: FastLock | None = None  # the one pyfuse3 makes


class FastLock:
    """A lock for `async with` that a release leaves free without waking a waiter."""

    def __init__(self) -> None:
        global _lock
        self._held = False
        self._parked = trio.lowlevel.ParkingLot()
        _lock = self

    async def __aenter__(self) -> None:
        while self._held:
            with trio.move_on_after(WAKE_S):
                await self._parked.park()
                return  # handed over: we own it
        self._held = True

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            # The fd is closing (unmount): the next worker must wake to see it.
            self._pass()
        else:
            self._held = False

    def _pass(self) -> None:
        if self._parked:
            self._parked.unpark()  # it owns the lock now
        else:
            self._held = False

    def hand_off(self) -> None:
        """A handler is about to suspend: let a parked worker wait for the fd meanwhile."""
        if not self._held and self._parked:
            self._held = True
            self._parked.unpark()


@types.coroutine
def handing_off(coro: Coroutine[Any, Any, T]) -> Generator[Any, Any, T]:
    """Await `coro`; if it suspends, first hand the FUSE fd to a parked worker."""
    try:
        value = coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    if _lock is not None:
        _lock.hand_off()
    while True:  # what `yield from coro` would do from here on
        try:
            sent = yield value
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                value = coro.throw(exc)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        else:
            try:
                value = coro.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


class _Trio(types.ModuleType):
    """trio as pyfuse3 sees it: all of it, but `Lock`."""

    Lock = FastLock

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


def install() -> None:
    """Before `pyfuse3.main` first runs in this process (it makes its lock on first use)."""
    if getattr(pyfuse3, "trio", None) is trio:
        pyfuse3.trio = _Trio("trio")  # type: ignore[attr-defined]
