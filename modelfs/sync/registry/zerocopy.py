"""Hypercorn on trio with the ASGI zero-copy send extension: file bodies go out with sendfile(2).

    await serve_hypercorn(app, config, shutdown_trigger=stop.wait, task_status=...)

What `hypercorn.trio.serve` does (lifespan, listeners, graceful shutdown), with one change:
each plain-HTTP/1.1 connection offers the app `scope["extensions"]["http.response.zerocopysend"]`
(ASGI spec, "Zero Copy Send"), and a message

    {"type": "http.response.zerocopysend", "file": fd, "offset": 0, "count": n, "more_body": False}

sends `n` bytes of the open file `fd` from `offset` as the response body, kernel to socket. A
blob then never passes through Python: no pread copy, no h11 bytes object, no userspace write;
what docker-registry (Go: read into a buffer, write it out) does in two copies, sendfile does in
none on the sender's side. Hypercorn 0.18 has no such extension, so the connection class
(`hypercorn.trio.tcp_server.TCPServer`) is subclassed: h11 still frames the body, through
`send_with_data_passthrough` (h11's documented sendfile hook: it counts the bytes of a
placeholder it hands back untouched), and the bytes go out under the connection's send lock.
TLS connections, h2 and anything unexpected in hypercorn's internals get no extension: the app
sends its body as it always did.

Each body is sent by one worker thread (`_send_all`): sendfile until the socket is full, then
poll(2) until it takes more, the GIL free in both, so a page-cache miss blocks that thread on the
disk, never the event loop, and the loop does no work per chunk at all (a thread hop per burst
cost a fifth of the server's CPU). The thread also polls a pipe, which a cancellation of the
send (shutdown, the client's disconnect) writes to, so it returns at once. A client that hangs
up ends the send quietly, as hypercorn does for its own writes; any other failure (the file
cut short, a cancellation) shuts the socket, since h11 already counted the bytes that did not
go out. `scripts/bench/serve` measures it against docker-registry.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown

from modelfs.runtime.groups import sole
from modelfs.store.errors import CorruptBlobError

ZEROCOPY = "http.response.zerocopysend"
Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
# A client that hung up, or that the listener's TCP_USER_TIMEOUT dropped (sync.serve).
_GONE = (BrokenPipeError, ConnectionResetError, TimeoutError, trio.ClosedResourceError)
# One thread per body being sent: far more than trio's default 40, so that many clients
# never wait on each other; each thread sleeps in poll(2) while its socket is full.
_SENDERS: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("senders")
SENDERS = 1024


def _senders() -> trio.CapacityLimiter:
    try:
        return _SENDERS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(SENDERS)
        _SENDERS.set(limiter)
        return limiter


class _Placeholder:
    """What h11 frames instead of the body bytes: only its length matters."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def _send_all(sock_fd: int, file_fd: int, at: int, count: int, stop_fd: int) -> None:
    """sendfile `count` bytes of `file_fd` from `at` to the non-blocking socket, waiting in
    poll(2) while it is full, until done or `stop_fd` is readable. In a worker thread: the
    GIL is free in both calls, and a page-cache miss blocks only this thread."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    poller.register(stop_fd, select.POLLIN)
    end = at + count
    while at < end:
        try:
            n = os.sendfile(sock_fd, file_fd, at, end - at)
        except BlockingIOError:
            if any(fd == stop_fd for fd, _ in poller.poll()):
                return
            continue
        if n == 0:
            raise CorruptBlobError(f"file ended at byte {at}, {end - at} bytes short")
        at += n


async def _write_on_cancel(fd: int) -> None:
    try:
        await trio.sleep_forever()
    finally:
        os.write(fd, b"x")


class ZeroCopyTCPServer(TCPServer):
    """One connection: hypercorn's, with the zero-copy send extension on plain HTTP/1.1."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        state: ConnectionState,
        stream: trio.SSLStream[trio.SocketStream],  # or a plain SocketStream, as in hypercorn
    ) -> None:
        # hypercorn's AppWrapper types name its own message TypedDicts; ours are plain dicts.
        super().__init__(cast(AppWrapper, self._app), config, context, state, stream)
        self._inner = app

    async def _app(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Message]],
        send: Send,
        sync_spawn: Callable[..., Any],
        call_soon: Callable[..., Any],
    ) -> None:
        if scope.get("type") == "http" and self._socket() is not None:
            scope.setdefault("extensions", {})[ZEROCOPY] = {}
            send = partial(self._send, send)
        await self._inner(scope, receive, send, sync_spawn, call_soon)  # type: ignore[arg-type]

    def _socket(self) -> trio.socket.SocketType | None:
        """The plain socket under an HTTP/1.1 connection, else None (TLS, h2, or a
        hypercorn whose internals are not the ones this was written against)."""
        stream: object = self.stream
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        if (
            isinstance(stream, trio.SocketStream)
            and isinstance(protocol, H11Protocol)
            and isinstance(protocol.connection, h11.Connection)
        ):
            return stream.socket
        return None

    async def _send(self, send: Send, message: Message) -> None:
        if message.get("type") != ZEROCOPY:
            await send(message)
            return
        file = message["file"]
        fd = file if isinstance(file, int) else file.fileno()
        offset = int(message.get("offset", 0))
        count = message.get("count")
        if count is None:
            count = os.fstat(fd).st_size - offset
        if count > 0:
            await self._sendfile(fd, offset, int(count))
        if not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _sendfile(self, fd: int, offset: int, count: int) -> None:
        sock = self._socket()
        protocol = self.protocol.protocol
        assert sock is not None and isinstance(protocol, H11Protocol)
        connection = cast(h11.Connection, protocol.connection)
        async with self.send_lock:
            # h11 checks the length against Content-Length and frames it (chunks, if any).
            pieces = connection.send_with_data_passthrough(
                h11.Data(data=cast(bytes, _Placeholder(count)))
            )
            try:
                for piece in pieces or ():
                    if isinstance(piece, _Placeholder):
                        await self._send_file(sock, fd, offset, count)
                    else:
                        await self.stream.send_all(piece)
            except _GONE:
                pass  # the client hung up: as hypercorn does for its own writes
            except BaseException:
                # h11 counted bytes that never went out: this connection cannot go on.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                raise
            else:
                return
        await self.protocol.handle(Closed())

    async def _send_file(self, sock: trio.socket.SocketType, fd: int, at: int, count: int) -> None:
        os.posix_fadvise(fd, at, count, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        stop_r, stop_w = os.pipe()
        try:
            async with trio.open_nursery() as nursery:
                # The thread call is not cancellable itself; a cancel reaches it as a byte
                # on the pipe, and it returns at once.
                nursery.start_soon(_write_on_cancel, stop_w)
                await trio.to_thread.run_sync(
                    _send_all, sock.fileno(), fd, at, count, stop_r, limiter=_senders()
                )
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The thread's failure, bare, so that `_sendfile` tells a hang-up from the rest.
            # A cancellation that came with it (the client's disconnect) is dropped here and
            # raised again at the next checkpoint: trio's cancellation is level-triggered.
            failure, _ = group.split(Exception)
            if failure is None:
                raise
            raise sole(failure) from None
        finally:
            os.close(stop_r)
            os.close(stop_w)


async def serve_hypercorn(
    app: Any,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`hypercorn.trio.serve(app, config, shutdown_trigger=...)` for TCP binds, each
    connection a `ZeroCopyTCPServer`; graceful shutdown as hypercorn's (`graceful_timeout`)."""
    from hypercorn.app_wrappers import ASGIWrapper

    wrapped = ASGIWrapper(app)
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context()
            listeners: list[trio.abc.Listener[Any]] = []
            for sock in sockets.secure_sockets:
                assert ssl_context is not None  # hypercorn makes secure sockets only for it
                sock.listen(config.backlog)
                plain = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                listeners.append(trio.SSLListener(plain, ssl_context, https_compatible=True))
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            task_status.started([])
            handler = partial(
                ZeroCopyTCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy())
            )
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners,
                            handler,
                            listeners,
                            handler_nursery=server_nursery,
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, others = error.split(ShutdownError)
                if others is not None:
                    raise others from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
