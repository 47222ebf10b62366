"""The large-blob fast path: one attempt at a blob from one peer, straight to disk and hash.

    await attempt(layout, options, name, peer, Transfer(partial, gaps, pool), workers) -> hex

`Transfer` is the shared state of the attempt, over a `sync.partial.PartialBlob` (a
preallocated temp file, a sidecar of finished byte ranges, a lock). A receiver thread sends a
ranged GET on a plain socket (`PeerClient.open_range`) and `recv_into`s page-aligned pool
buffers of `chunk` bytes (16 MiB); each full buffer goes to two places at once: a writer
thread, which writes it with O_DIRECT at its offset (no page cache to fill and write back; an
ordinary pwrite where the filesystem refuses O_DIRECT), and the hasher thread, which feeds
buffers to sha256 strictly in order. Nothing is read back, except bytes a previous run left on
disk. One connection asks for the rest of the blob in one GET; blobs from `parallel_min`
(256 MiB) on are asked for in chunk-sized ranges, handed out in order, and up to `workers` (4)
connections share them, a new one opened whenever the hasher spent over half of the last half
second waiting for bytes (so on loopback or a LAN, where one stream outruns sha256, one stream
it stays). The pool (connections + 3 buffers) bounds the memory and how far receivers run
ahead of the hash. Every second the progress is made durable (fdatasync, then the sidecar).
When the last byte is written the file is fsynced and the hash returned; what to do with a
match or a mismatch is the caller's (sync.transfer).

A peer that ignores `Range` (a plain web server, some proxies) answers 200 with the whole
blob: the bytes before each missing range are read and dropped, one stream carries them all,
and no more connections are opened. An answer the raw receiver does not take (chunked,
compressed) is received through httpx instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass

import trio

from modelfs.store.layout import Layout
from modelfs.store.names import Name
from modelfs.sync.client.http import mapped_errors, raise_for_status
from modelfs.sync.client.partial import (
    ALIGN,
    AlignedPool,
    PartialBlob,
    RangeSet,
    Stopped,
    split,
    start_writeback,
)
from modelfs.sync.client.peer import PeerClient
from modelfs.sync.client.rawhttp import Conn, NeedsHttpx, RangeBody, TruncatedBodyError
from modelfs.sync.client.threads import in_thread
from modelfs.sync.errors import LocalWriteError, PeerError, local_error
from modelfs.sync.pull.options import PullOptions

log = logging.getLogger(__name__)

WRITERS = 2  # threads writing one blob: two direct writes in flight keep a disk busy


@dataclass(eq=False)
class _Segment:
    """Bytes [start, start + length) of the blob in a pool buffer, on their way to the disk
    and to the hash; the buffer goes back to the pool when both are done with it."""

    start: int
    length: int
    buf: mmap.mmap
    refs: int = 2


@dataclass(eq=False)
class _Piece:
    """A byte range one connection is fetching. `end` may be pulled in (under the transfer's
    lock) when the rest is split among more connections; `pos` is where it is now."""

    start: int
    end: int
    pos: int = -1


class Transfer:
    """Shared state of one large blob's attempt from one peer.

    Receivers (one per connection) fill page-aligned pool buffers, one `_Segment` at a
    time, and hand each to the writers (O_DIRECT pwrite, `write_q`) and to the hasher
    (`ready`, by offset); the hasher consumes segments strictly in order. Ranges are handed
    out in order too, so the hasher never waits long, and the pool's size bounds how far the
    receivers can run ahead of it.
    """

    def __init__(
        self, partial: PartialBlob, pieces: list[tuple[int, int]], pool: AlignedPool
    ) -> None:
        self.partial = partial
        self.size = partial.size
        self.on_disk = RangeSet(partial.done.as_list())  # from before this attempt
        self.done = RangeSet(partial.done.as_list())  # on disk now
        self.todo = [_Piece(a, b, a) for a, b in pieces]
        self.active: list[_Piece] = []
        self.pool = pool
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.ready: dict[int, _Segment] = {}
        self.write_q: queue.Queue[_Segment | None] = queue.Queue()
        self.hash_wait = 0.0  # seconds the hasher spent waiting for bytes
        # The peer answered a range with the whole blob (it ignores Range): one stream
        # carries the rest, and no more connections are opened (each would resend it all).
        self.whole = False

    def take(self) -> _Piece | None:
        with self.cond:
            if self.stop.is_set() or not self.todo:
                return None
            piece = self.todo.pop(0)
            self.active.append(piece)
            return piece

    def finished(self, piece: _Piece) -> None:
        with self.cond:
            self.active.remove(piece)

    def is_head(self, piece: _Piece) -> bool:
        """True if `piece` is the active range furthest behind: the hash waits on it."""
        with self.cond:
            return all(piece.pos <= p.pos or p.pos < 0 for p in self.active)

    def make_room(self) -> bool:
        """Work for one more connection: a range not yet started, or else the far end of the
        range with the most left, cut off in chunk-sized ranges. False if too little is left."""
        size = self.pool.size
        with self.cond:
            if self.todo:
                return True
            piece = max(self.active, key=lambda p: p.end - p.pos, default=None)
            if piece is None:
                return False
            cut = max(piece.pos, piece.start) + 2 * size
            if piece.end - cut < 2 * size:
                return False
            self.todo = [_Piece(a, b, a) for a, b in split([(cut, piece.end)], size)]
            piece.end = cut
            return True

    def submit(self, seg: _Segment, *, hash_it: bool = True) -> None:
        if hash_it:
            with self.cond:
                self.ready[seg.start] = seg
                self.cond.notify_all()
        else:
            seg.refs -= 1
        self.write_q.put(seg)

    def written(self, seg: _Segment) -> None:
        with self.cond:
            self.done.add(seg.start, seg.start + seg.length)
            self.cond.notify_all()
        self.release(seg)

    def release(self, seg: _Segment) -> None:
        with self.cond:
            seg.refs -= 1
            free = seg.refs == 0
        if free:
            self.pool.put(seg.buf)

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.stop.set()
            self.cond.notify_all()

    def snapshot(self) -> RangeSet:
        with self.cond:
            return RangeSet(self.done.as_list())

    def completed(self) -> int:
        with self.cond:
            return self.done.total()

    def received(self) -> int:
        """Bytes this attempt brought (on disk now, not before it)."""
        with self.cond:
            return self.done.total() - self.on_disk.total()

    def segment_at(self, pos: int) -> _Segment:
        """Block until the segment that starts at `pos` has arrived; Stopped on stop."""
        with self.cond:
            t0 = time.monotonic()
            try:
                while (seg := self.ready.pop(pos, None)) is None:
                    if self.stop.is_set():
                        raise Stopped()
                    self.cond.wait(0.25)
                return seg
            finally:
                self.hash_wait += time.monotonic() - t0


async def attempt(
    layout: Layout, opts: PullOptions, name: Name, peer: PeerClient, t: Transfer, workers: int
) -> str:
    """Fetch what `t` lacks from `peer`. Returns the sha256 hex of the whole file once
    every byte is on disk and fsynced; raises the first error otherwise, after making
    what did arrive durable (fdatasync + sidecar) for a later resume."""
    partial = t.partial
    writes_done = trio.Event()
    digest_hex: list[str] = []

    async def receiver() -> None:
        # A kept-alive connection, or the open body of a whole-blob answer to go on with.
        conn: Conn | RangeBody | None = None
        try:
            while (piece := t.take()) is not None:
                try:
                    conn = await in_thread(_receive, peer, name, t, piece, conn, stop=t.stop)
                except NeedsHttpx:
                    conn = None
                    await _receive_httpx(peer, name, t, piece)
        except Stopped:
            pass
        except Exception as exc:
            t.fail(exc)
        finally:
            if conn is not None:
                conn.close()

    running = 0
    growing = trio.CancelScope()

    async def tracked_receiver() -> None:
        nonlocal running
        running += 1
        try:
            await receiver()
        finally:
            running -= 1
            if running == 0:
                growing.cancel()  # nothing left to share

    async def more_receivers(receivers: trio.Nursery, most: int) -> None:
        with growing:
            await grow(receivers, most)

    async def grow(receivers: trio.Nursery, most: int) -> None:
        # Another connection only helps when one connection is what we wait for: open
        # one more (up to `most`) when, over the last half second, the hasher spent over
        # half its time waiting for bytes and they came slower than `parallel_below`
        # (a per-connection limit, a long fat pipe). On loopback or a LAN one stream
        # does better than several (each range is another request), so it stays one.
        # A connection that did not make things 10% faster is the last one opened.
        count = 1
        last_wait, last, last_bytes = t.hash_wait, time.monotonic(), t.completed()
        rate_before: float | None = None
        while count < most:
            await trio.sleep(0.5)
            if t.stop.is_set() or t.whole:
                return
            now, got = time.monotonic(), t.completed()
            starved = (t.hash_wait - last_wait) / (now - last) > 0.5
            rate = (got - last_bytes) / (now - last)
            last_wait, last, last_bytes = t.hash_wait, now, got
            if rate_before is not None and rate < rate_before * 1.1:
                return
            if starved and rate < opts.parallel_below:
                if not t.make_room():
                    return
                t.pool.grow(1)
                receivers.start_soon(tracked_receiver)
                count += 1
                rate_before = rate
                log.debug("%s: connection %d of %d", partial.digest, count, most)
                await trio.sleep(0.5)  # let it get going before judging it
                last_wait, last, last_bytes = t.hash_wait, time.monotonic(), t.completed()
            else:
                rate_before = None

    async def writer() -> None:
        try:
            await in_thread(_writer, layout, t, stop=t.stop)
        except Stopped:
            pass
        except Exception as exc:
            t.fail(exc)

    async def hasher() -> None:
        try:
            digest_hex.append(await in_thread(_hash, t, stop=t.stop))
        except Stopped:
            pass
        except Exception as exc:
            t.fail(exc)

    async def syncer() -> None:
        # Make progress durable every so often while bytes arrive (fdatasync, then the
        # sidecar), and fsync once the last byte is written, while the hash catches up.
        while not writes_done.is_set():
            with trio.move_on_after(opts.checkpoint_every):
                await writes_done.wait()
            if writes_done.is_set():
                break
            await trio.to_thread.run_sync(start_writeback, partial.fd)
            try:
                await trio.to_thread.run_sync(partial.checkpoint, t.snapshot())
            except OSError as exc:
                t.fail(local_error(exc, layout, f"blob {partial.digest}"))
                return
        if t.error is None:
            try:
                await trio.to_thread.run_sync(os.fsync, partial.fd)
            except OSError as exc:
                t.fail(local_error(exc, layout, f"blob {partial.digest}"))

    complete = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hasher)
            nursery.start_soon(syncer)
            async with trio.open_nursery() as io:
                for _ in range(WRITERS):
                    io.start_soon(writer)
                async with trio.open_nursery() as receivers:
                    receivers.start_soon(tracked_receiver)
                    if workers > 1:
                        receivers.start_soon(more_receivers, receivers, workers)
                for _ in range(WRITERS):
                    t.write_q.put(None)
            writes_done.set()
        complete = t.error is None and bool(digest_hex)
    finally:
        # Segments the hasher never took (it stopped): their buffers go back to the pool,
        # which the next attempt reuses.
        with t.cond:
            leftovers = list(t.ready.values())
            t.ready.clear()
        for seg in leftovers:
            t.release(seg)
        partial.done = t.snapshot()
        if not complete:
            # Interrupted, cancelled or failed: make what arrived durable for a resume.
            with trio.CancelScope(shield=True), contextlib.suppress(OSError):
                await trio.to_thread.run_sync(partial.checkpoint, partial.done)
    if t.error is not None:
        err = t.error
        if isinstance(err, OSError):
            raise local_error(err, layout, f"blob {partial.digest}")
        raise err
    if not digest_hex:  # pragma: no cover - every byte written but no hash: a bug
        raise PeerError(f"{peer.url}: blob {partial.digest} incomplete")
    return digest_hex[0]


def _receive(
    peer: PeerClient,
    name: Name,
    t: Transfer,
    piece: _Piece,
    conn: Conn | RangeBody | None,
) -> Conn | RangeBody | None:
    """One ranged GET, received into pool buffers, segment by segment (a thread).

    A peer that ignores Range answers with the whole blob: the bytes before the piece
    (on disk already, or another connection's) are read and dropped, and the open body
    is returned to carry the next piece too, so a resume or a blob cut in ranges costs
    one pass over the wire. `conn` may be such a body, if it has not passed the piece.
    """
    body: RangeBody | None = None
    try:
        if isinstance(conn, RangeBody) and conn.pos <= piece.start:
            body = conn
        else:
            if isinstance(conn, RangeBody):
                conn.close()
                conn = None
            body = peer.open_range(
                name, t.partial.digest, piece.start, piece.end, t.size, stop=t.stop, conn=conn
            )
            if body.whole:
                t.whole = True
        body.skip_to(piece.start)
    except NeedsHttpx:
        raise  # the piece stays active: `_receive_httpx` takes it over
    except BaseException:
        if body is not None:
            body.close()
        t.finished(piece)
        raise
    pos = piece.start
    try:
        while True:
            with t.cond:
                piece.pos, end = pos, piece.end
            if pos >= end:
                break
            buf = t.pool.get(t.stop, last=lambda: t.is_head(piece))
            view = memoryview(buf)
            limit = min(len(buf), end - pos)
            filled = 0
            try:
                while filled < limit:
                    filled += body.readinto(view[filled:limit])
            except BaseException:
                # What arrived before the failure is as good as any byte: keep the
                # block-aligned part of it (the rest is asked for again).
                keep = filled - filled % ALIGN
                if keep:
                    t.submit(_Segment(pos, keep, buf), hash_it=False)
                else:
                    t.pool.put(buf)
                raise
            finally:
                view.release()
            t.submit(_Segment(pos, filled, buf))
            pos += filled
    except BaseException:
        body.conn.close()
        raise
    finally:
        t.finished(piece)
    if body.whole and body.remaining:
        return body
    return body.release()  # closed, not kept, if the range was cut short


async def _receive_httpx(peer: PeerClient, name: Name, t: Transfer, piece: _Piece) -> None:
    """The same range through httpx, for answers the raw receiver does not take (it is
    not cut short for another connection; a whole-blob answer is read from byte 0 and
    what comes before the range is dropped)."""
    try:
        await _receive_httpx_range(peer, name, t, piece.start, piece.end)
    finally:
        t.finished(piece)


async def _receive_httpx_range(
    peer: PeerClient, name: Name, t: Transfer, start: int, end: int
) -> None:
    what = f"blob {t.partial.digest}"
    url = peer.blob_url(peer.repositories(name)[0], t.partial.digest)
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    pos = start
    buf: mmap.mmap | None = None
    filled = 0

    def flush(*, hash_it: bool = True) -> None:
        nonlocal buf, filled, pos
        if buf is not None:
            keep = filled if hash_it else filled - filled % ALIGN
            if keep:
                t.submit(_Segment(pos, keep, buf), hash_it=hash_it)
            else:
                t.pool.put(buf)
            pos += keep
            buf, filled = None, 0

    try:
        with mapped_errors(peer.url, what):
            async with peer.http.stream("GET", url, headers=headers) as response:
                raise_for_status(response, what)
                skip = 0
                if response.status_code == 200:
                    t.whole = True
                    skip = start
                async for chunk in response.aiter_bytes():
                    data = memoryview(chunk)
                    if skip:
                        dropped = min(skip, len(data))
                        data, skip = data[dropped:], skip - dropped
                    while data and pos + filled < end:
                        if buf is None:
                            get = functools.partial(t.pool.get, last=lambda: True)
                            buf = await in_thread(get, t.stop, stop=t.stop)
                        n = min(len(data), len(buf) - filled, end - pos - filled)
                        buf[filled : filled + n] = data[:n]
                        filled += n
                        data = data[n:]
                        if filled == len(buf) or pos + filled == end:
                            flush()
                    if pos >= end:
                        break
    except BaseException as exc:
        flush(hash_it=False)
        if isinstance(exc, PeerError) and (
            "incomplete" in str(exc).lower() or "peer closed" in str(exc).lower()
        ):
            raise TruncatedBodyError(
                f"{url}: truncated body ({pos - start} of {end - start} bytes) "
                f"while fetching {what}"
            ) from None
        raise
    if pos < end:
        flush(hash_it=False)
        raise TruncatedBodyError(
            f"{url}: truncated body ({pos - start} of {end - start} bytes) while fetching {what}"
        )


def _writer(layout: Layout, t: Transfer) -> None:
    """Write segments to the file as they come (a thread; runs until its None, or until
    the transfer stops and nothing is left to write)."""
    while True:
        try:
            seg = t.write_q.get(timeout=0.25)
        except queue.Empty:
            if t.stop.is_set():
                return
            continue
        if seg is None:
            return
        try:
            if t.error is None or not isinstance(t.error, LocalWriteError):
                with memoryview(seg.buf) as view:
                    t.partial.write(view[: seg.length], seg.start)
                t.written(seg)
                continue
        except OSError as exc:
            t.fail(local_error(exc, layout, f"blob {t.partial.digest}"))
        t.release(seg)


def _hash(t: Transfer) -> str:
    """sha256 of the blob from byte 0 (a thread): bytes already on disk from an earlier
    run or attempt are read back, the rest is hashed from the receive buffers in order."""
    h = hashlib.sha256()
    pos = 0
    scratch: bytearray | None = None
    while pos < t.size:
        end = t.on_disk.end_of(pos)
        if end is not None:
            scratch = scratch or bytearray(1 << 20)
            for piece in t.partial.chunks(pos, end, scratch):
                h.update(piece)
                if t.stop.is_set():
                    raise Stopped()
            pos = end
            continue
        seg = t.segment_at(pos)
        with memoryview(seg.buf) as view:
            h.update(view[: seg.length])
        pos += seg.length
        t.release(seg)
    return h.hexdigest()
