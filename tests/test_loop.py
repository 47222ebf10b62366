"""fsd.loop: pyfuse3's worker lock that does not wake a worker per request."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing

from modelfs.fsd import loop


def run(fn) -> None:  # type: ignore[no-untyped-def]
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_handing_off_hands_over_only_when_the_handler_suspends(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    handed: list[str] = []

    class Spy:
        def hand_off(self) -> None:
            handed.append("x")

    monkeypatch.setattr(loop, "_lock", Spy())

    async def quick() -> int:
        return 1

    async def slow() -> int:
        await trio.sleep(1)
        return 2

    async def fails() -> None:
        await trio.sleep(1)
        raise KeyError("k")

    async def main() -> None:
        assert await loop.handing_off(quick()) == 1
        assert handed == []
        assert await loop.handing_off(slow()) == 2
        assert handed == ["x"]
        try:
            await loop.handing_off(fails())
        except KeyError:
            pass
        else:
            raise AssertionError("no KeyError")
        with trio.move_on_after(0.5) as scope:
            await loop.handing_off(slow())
        assert scope.cancelled_caught

    run(main)


def test_fast_lock_release_leaves_the_waiter_parked_until_a_hand_off() -> None:
    events: list[str] = []

    async def main() -> None:
        lock = loop.FastLock()

        async def waiter() -> None:
            async with lock:
                events.append("waiter has it")

        await lock.__aenter__()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.01)
            await lock.__aexit__(None, None, None)  # free, nobody woken
            await trio.lowlevel.checkpoint()
            await lock.__aenter__()  # the releaser takes it again without waiting
            assert events == []
            await lock.__aexit__(None, None, None)
            lock.hand_off()  # a handler suspends: the parked worker takes over at once
            await trio.sleep(0.01)
            assert events == ["waiter has it"]

    run(main)


@pytest.mark.parametrize(
    ("exc", "within"),
    [
        # The releaser leaves the loop (an unmount from outside): the waiter is not stranded.
        (None, 2 * loop.WAKE_S),
        # The fd closed under the lock (SIGTERM): the next worker wakes at once to see it.
        (trio.ClosedResourceError, loop.WAKE_S / 10),
    ],
)
def test_fast_lock_waiter_is_never_stranded(exc: type[BaseException] | None, within: float) -> None:
    async def main() -> None:
        lock = loop.FastLock()
        got = trio.Event()

        async def waiter() -> None:
            async with lock:
                got.set()

        await lock.__aenter__()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.01)
            await lock.__aexit__(exc, None, None)
            with trio.fail_after(within):
                await got.wait()

    run(main)
