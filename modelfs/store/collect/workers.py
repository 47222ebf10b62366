"""Blob checks on every core: worker processes, forked with the list of units of work in
memory, each taking the next unit no other has taken until none is left.

    with Workers(layout, units, n) as pool: pool.run(stop=...) -> list[Batch]

Processes, not threads: a small blob costs Python time (open, fstat, read, close, a hash of a
few hundred bytes, for which hashlib keeps the GIL), so threads checking small blobs take
turns on one core. A unit is a list of blob names (a large blob alone, small ones together);
the workers take units by their index, under one shared counter, so the parent hands nothing
out: it scans the store meanwhile, and a worker never waits for it (or for its GIL). Each
worker sends its Batches (tuples, and objects only for the blobs that are not ok) once, at
its end.

Workers are forked: a fork costs a millisecond and carries the store's layout, the units and
the code in memory, where a fresh interpreter would spend tens of milliseconds importing it.
They ignore SIGINT (Ctrl-C reaches the whole process group: the parent decides), stop between
chunks of a large blob when the parent is gone, and are terminated, then killed, by whatever
ends `run` other than its end: an error, or `stop()`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from modelfs.store.collect.verify import (
    Batch,
    CacheEntry,
    Interrupted,
    Look,
    Looked,
    check_batch,
    look_batch,
)
from modelfs.store.layout import Layout

# A unit: blob names, and for a quick check the cache entries of those names (by position);
# or, for a quick check, a Look: names to stat and compare with the cache in one go.
Unit = tuple[list[str], list[CacheEntry | None] | None] | Look
Result = Batch | Looked  # a Batch for blob names, a Looked for a Look

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


def check_units(layout: Layout, units: Sequence[Unit], stop: Callable[[], bool]) -> list[Result]:
    """The units in this process, in order (one core; or too little work for a fork)."""
    dir_fd = _blobs_fd(layout)
    try:
        return [do_unit(dir_fd, str(layout.root), unit, stop) for unit in units]
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def do_unit(dir_fd: int | None, root: str, unit: Unit, stop: Callable[[], bool]) -> Result:
    if isinstance(unit, Look):
        return look_batch(dir_fd, unit, root, stop=stop)
    names, cached = unit
    return check_batch(dir_fd, names, root, cached, stop=stop)


class _Shared:
    """What the workers share, in memory the fork maps into each: the index of the next unit
    to take, and how many blobs and bytes are done (for progress lines)."""

    def __init__(self, ctx: Any) -> None:
        self.next = ctx.Value("q", 0)  # its lock guards all three
        self.blobs = ctx.Value("q", 0, lock=False)
        self.bytes = ctx.Value("q", 0, lock=False)

    def take(self) -> int:
        with self.next.get_lock():
            i: int = self.next.value
            self.next.value = i + 1
        return i

    def count(self, result: Result) -> None:
        blobs = result.blobs if isinstance(result, Looked) else len(result.stamps)
        with self.next.get_lock():
            self.blobs.value += blobs
            self.bytes.value += result.bytes


def _serve(conn: Connection, root: str, units: Sequence[Unit], shared: _Shared) -> None:
    """A worker: take the next unit not taken until none is left, then send the parent
    every (index, Batch) at once. The units were in memory before the fork: nothing is
    handed out, so a parent busy with a scan (and the GIL) never keeps a worker waiting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    layout = Layout(root)
    dir_fd = _blobs_fd(layout)

    def orphaned() -> bool:  # between chunks of a large blob: the parent was killed
        return os.getppid() != parent

    done: list[tuple[int, Result]] = []
    reply: Any = done
    try:
        while (i := shared.take()) < len(units):
            result = do_unit(dir_fd, root, units[i], orphaned)
            shared.count(result)
            done.append((i, result))
    except Interrupted:
        return
    except Exception as exc:  # a bug: said to the parent, which raises it
        reply = _sendable(exc)
    try:
        conn.send(reply)
    finally:
        conn.close()


def _sendable(exc: Exception) -> Exception:
    """`exc`, or where it would not come through a pipe (an attribute that does not pickle,
    an __init__ its arguments do not fit), a WorkerError with its type and message: without
    it, the parent saw only "a verify worker process died"."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return WorkerError(f"a verify worker failed: {type(exc).__qualname__}: {exc}")
    return exc


class Workers:
    """`workers` processes forked to check `units`: they start at once, each taking the next
    unit not taken (largest first, as `units` is given), and `run` collects what they found.
    Fork them (`start`, or entering the `with`) before starting threads that may hold a lock
    the children need."""

    def __init__(self, layout: Layout, units: Sequence[Unit], workers: int) -> None:
        self.layout = layout
        self.units = units
        # No more processes than units: a worker with nothing to take only costs a fork.
        self.workers = min(workers, len(units)) if workers > 1 and len(units) > 1 else 0
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.shared: _Shared | None = None
        self.finished = False

    def start(self) -> Workers:
        ctx = multiprocessing.get_context("fork")
        try:
            if self.workers:
                self.shared = _Shared(ctx)
            for _ in range(self.workers):
                here, there = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_serve,
                    args=(there, str(self.layout.root), self.units, self.shared),
                    daemon=True,
                )
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

    def progress(self) -> tuple[int, int]:
        """Blobs and bytes checked so far (by the workers; 0 without any)."""
        if self.shared is None:
            return 0, 0
        return self.shared.blobs.value, self.shared.bytes.value

    def run(self, *, stop: Callable[[], bool]) -> list[Result]:
        """The Batch of each unit, in the order of `units` (checked here when there are no
        workers). Raises Interrupted when `stop()` says so (`close` then stops the workers
        at once), WorkerError when one died."""
        if not self.conns:
            return check_units(self.layout, self.units, stop)
        results: list[Result | None] = [None] * len(self.units)
        waiting = list(self.conns)
        while waiting:
            if stop():
                raise Interrupted()
            for ready in wait(waiting, timeout=POLL):
                assert isinstance(ready, Connection)
                waiting.remove(ready)
                try:
                    reply = ready.recv()
                except EOFError:
                    raise WorkerError("a verify worker process died") from None
                if isinstance(reply, Exception):
                    raise reply
                for i, batch in reply:
                    results[i] = batch
        if any(r is None for r in results):
            raise WorkerError("a verify worker process died")
        self.finished = True
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Every worker ends: on its own after the last unit, terminated in any other case
        (stopped, an error, a worker that died)."""
        for conn in self.conns:
            conn.close()
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
