"""Threads and `trio.run` for the sync commands.

    await in_thread(fn, *args, stop=event)    a worker thread that is stopped, not abandoned
    run_unwrapped(main)                       trio.run, raising a lone failure as itself

Kept apart from `sync.pull` (and httpx) so that commands that only hash, such as `verify`
without `--repair-from`, start quickly.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from modelfs.runtime.groups import unwrapped
from modelfs.sync.client.partial import Stopped

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any, stop: threading.Event) -> T:
    """Run `fn` in a worker thread. On cancellation, set `stop` (which `fn` polls) and wait
    for the thread to return before unwinding, so no thread outlives the files it uses."""
    lock = threading.Lock()
    started = cancelled = False
    finished = threading.Event()

    def run() -> T:
        nonlocal started
        with lock:
            if cancelled:  # cancelled while waiting for a thread: never start
                raise Stopped()
            started = True
        try:
            return fn(*args)
        finally:
            finished.set()

    try:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    except trio.Cancelled:
        stop.set()
        with lock:
            cancelled = True
            running = started
        if running:
            with trio.CancelScope(shield=True):
                # The thread polls `stop` every POLL seconds. (Waiting for it in another
                # thread would need a slot in a pool that may be full.)
                while not finished.is_set():  # noqa: ASYNC110
                    await trio.sleep(0.01)
        raise


def run_unwrapped(main: Callable[[], Awaitable[T]]) -> T:
    """`trio.run(main)`, raising a nursery's lone failure as itself: the CLI prints a
    SyncError as one line."""
    with unwrapped():
        return trio.run(main)
