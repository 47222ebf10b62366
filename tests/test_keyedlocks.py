"""runtime.keyedlocks: one lock per key, forgotten when no task holds or waits for it.
Real trio tasks; the order of events is what is checked, not timings."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from modelfs.runtime.keyedlocks import KeyedLocks


async def test_one_key_is_held_by_one_task_at_a_time_and_other_keys_run_on() -> None:
    locks = KeyedLocks[str]()
    events: list[str] = []
    release = trio.Event()

    async def hold(key: str, name: str) -> None:
        async with locks.hold(key):
            events.append(f"{name} in")
            await release.wait()
            events.append(f"{name} out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "a", "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "a", "second")
        nursery.start_soon(hold, "b", "other")
        await trio.testing.wait_all_tasks_blocked()
        # The second waits for the first; the other key is not held up.
        assert events == ["first in", "other in"]
        assert len(locks) == 2
        release.set()
    assert events.index("first out") < events.index("second in")
    assert len(locks) == 0


async def test_a_lock_is_forgotten_after_a_failure_and_after_a_cancelled_wait() -> None:
    locks = KeyedLocks[int]()
    with pytest.raises(ValueError):
        async with locks.hold(1):
            raise ValueError("the body failed")
    assert len(locks) == 0

    release = trio.Event()

    async def holder() -> None:
        async with locks.hold(2):
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.05) as waited:
            async with locks.hold(2):
                pytest.fail("held a key another task holds")
        assert waited.cancelled_caught
        assert len(locks) == 1  # the holder's alone
        release.set()
    assert len(locks) == 0


async def test_many_keys_asked_once_each_leave_nothing_behind() -> None:
    locks = KeyedLocks[str]()
    for i in range(10_000):
        async with locks.hold(f"library/nope-{i}:latest"):
            pass
    assert len(locks) == 0
