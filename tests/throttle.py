"""A TCP proxy on loopback that slows the answers of a real server (a `modelfs sync` daemon has
no throttle of its own), so a test can kill the server mid-transfer. It notes the head of each
HTTP request that goes through: method, path, `Range`, and whether `Authorization` was sent.

    with Throttle(("127.0.0.1", port), rate=4 << 20) as proxy:   # bytes/s, server -> client
        proxy.url, proxy.requests, proxy.relayed
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorized: bool


class Throttle:
    def __init__(self, upstream: tuple[str, int], rate: float) -> None:
        self.upstream = upstream
        self.rate = rate
        self.requests: list[Seen] = []
        self.relayed = 0  # bytes from the server to clients, all connections
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []

    def __enter__(self) -> Throttle:
        self._spawn(self._accept)
        return self

    def __exit__(
        self,
        _t: type[BaseException] | None,
        _e: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._listener.close()
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(5)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()  # the server is down: so is the proxy, for this connection
                continue
            self._socks += [client, server]
            self._spawn(self._requests, client, server)
            self._spawn(self._answers, server, client)

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Client -> server, unthrottled; each request head is noted (bodies are empty)."""
        buf = b""
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
                buf += chunk
                while (end := buf.find(b"\r\n\r\n")) >= 0:
                    self._note(buf[:end].decode("latin-1"))
                    buf = buf[end + 4 :]
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _note(self, head: str) -> None:
        first, *lines = head.split("\r\n")
        method, path, *_ = [*first.split(" "), "", ""]
        headers = {}
        for line in lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        self.requests.append(Seen(method, path, headers.get("range"), "authorization" in headers))

    def _answers(self, src: socket.socket, dst: socket.socket) -> None:
        """Server -> client at `rate` bytes/s at most, in pieces of up to 64 KiB."""
        with contextlib.suppress(OSError):
            while chunk := src.recv(64 << 10):
                dst.sendall(chunk)
                self.relayed += len(chunk)
                time.sleep(len(chunk) / self.rate)  # read anew: a test may change it
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
