"""Blob checks on every core: worker processes that each run `check_batch` on the units of
work they are handed, one at a time, until there are none left.

    with Workers(layout, n) as pool: pool.run(units, stop=..., done=...) -> list[Batch]

Processes, not threads: a small blob costs Python time (open, fstat, read, close, a hash of a
few hundred bytes, for which hashlib keeps the GIL), so threads checking small blobs take
turns on one core. A unit is a list of blob names (a large blob alone, small ones together),
so a hand-off costs the same for one blob as for hundreds; a worker answers with one `Batch`
(tuples, and objects only for the blobs that are not ok).

Workers are forked: a fork costs a millisecond and carries the store's layout and the code in
memory, where a fresh interpreter would spend tens of milliseconds importing it. They ignore
SIGINT (Ctrl-C reaches the whole process group: the parent decides), exit when their pipe
closes (the parent is gone), and are terminated, then killed, by whatever ends `run`: its end,
an error, or `stop()`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from modelfs.store.collect.verify import Batch, CacheEntry, Interrupted, check_batch
from modelfs.store.layout import Layout

# A unit: blob names, and for a quick check the cache entries of those names (by position).
Unit = tuple[list[str], list[CacheEntry | None] | None]

POLL = 0.1  # seconds between looks at stop() while every worker is busy


class WorkerError(Exception):
    """A worker process died (killed, out of memory) before it answered."""


def _blobs_fd(layout: Layout) -> int | None:
    """blobs/, open: thousands of small blobs are each opened by name in it, and by name in
    an open directory the system need not walk the tree to it each time."""
    try:
        return os.open(layout.blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # each check then says what is wrong with its blob


def check_units(layout: Layout, units: Sequence[Unit], stop: Callable[[], bool]) -> list[Batch]:
    """The units in this process, in order (one core; or too little work for a fork)."""
    dir_fd = _blobs_fd(layout)
    try:
        return [
            check_batch(dir_fd, names, str(layout.root), cached, stop=stop)
            for names, cached in units
        ]
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def _serve(conn: Connection, root: str) -> None:
    """A worker: check each unit received and send back its Batch, until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    layout = Layout(root)
    dir_fd = _blobs_fd(layout)

    def orphaned() -> bool:  # between chunks of a large blob: the parent was killed
        return os.getppid() != parent

    try:
        while True:
            try:
                unit = conn.recv()
            except EOFError:
                return
            if unit is None:
                return
            names, cached = unit
            try:
                reply: Any = check_batch(dir_fd, names, root, cached, stop=orphaned)
            except Interrupted:
                return
            except Exception as exc:  # a bug: said to the parent, which raises it
                reply = exc
            conn.send(reply)
    finally:
        conn.close()


class Workers:
    """`workers` forked processes, for `run` to hand units to. Fork them (`start`, or
    entering the `with`) before starting threads that may hold a lock the children need."""

    def __init__(self, layout: Layout, workers: int) -> None:
        self.layout = layout
        self.workers = workers
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.finished = False

    def start(self) -> Workers:
        ctx = multiprocessing.get_context("fork")
        try:
            for _ in range(self.workers if self.workers > 1 else 0):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(there, str(self.layout.root)), daemon=True)
                proc.start()
                there.close()
                self.procs.append(proc)
                self.conns.append(here)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Workers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        units: Sequence[Unit],
        *,
        stop: Callable[[], bool],
        done: Callable[[int, Batch], None] | None = None,
    ) -> list[Batch]:
        """Check every unit (in this process when there are no workers); the Batch of each
        unit, in the order of `units`. `done(i, batch)` is called as each unit comes back.
        Raises Interrupted when `stop()` says so; `close` then stops the workers at once."""
        if not self.conns:
            out = check_units(self.layout, units, stop)
            if done is not None:
                for i, batch in enumerate(out):
                    done(i, batch)
            return out
        results: list[Batch | None] = [None] * len(units)
        todo = iter(range(len(units)))
        busy: dict[Connection, int] = {}

        def hand_out(conn: Connection) -> None:
            i = next(todo, None)
            try:
                conn.send(None if i is None else units[i])
            except OSError:  # EPIPE: it died after its last answer
                raise WorkerError("a verify worker process died") from None
            if i is not None:
                busy[conn] = i

        for conn in self.conns:
            hand_out(conn)
        while busy:
            if stop():
                raise Interrupted()
            for ready in wait(list(busy), timeout=POLL):
                assert isinstance(ready, Connection)
                i = busy.pop(ready)
                try:
                    reply = ready.recv()
                except EOFError:
                    raise WorkerError("a verify worker process died") from None
                if isinstance(reply, Exception):
                    raise reply
                results[i] = reply
                if done is not None:
                    done(i, reply)
                hand_out(ready)
        self.finished = True
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Every worker ends: told to (EOF) after the last unit, terminated in any other
        case (stopped, an error, a worker that died)."""
        for conn in self.conns:
            conn.close()  # an idle worker reads EOF and exits
        for proc in self.procs:
            if self.finished:
                proc.join(1)
            if proc.is_alive():  # in the middle of a unit
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.join()
            proc.close()
        self.procs, self.conns = [], []
