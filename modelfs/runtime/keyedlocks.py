"""One trio lock per key, kept only while a task holds or waits for it.

A server that locks per name a client chose (a tag asked of a mirror, a token's scope) and
kept every lock it ever made would grow by one lock per name asked, for as long as it runs;
any client could make it grow without bound by asking for names that do not exist.

    locks = KeyedLocks[str]()
    async with locks.hold("library/gemma4:26b"):
        ...   # no other task holds this key; other keys run on
    len(locks)   # the keys held or waited for now
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Hashable
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.users = 0


class KeyedLocks(Generic[K]):
    def __init__(self) -> None:
        self._entries: dict[K, _Entry] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        """Hold `key`'s lock for the body; the lock is forgotten once no task holds or
        waits for it (a task cancelled while waiting counts out as well)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
