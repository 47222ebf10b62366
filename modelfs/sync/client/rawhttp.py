"""The raw receiver: just enough HTTP/1.1 on a blocking socket to send one ranged GET of a blob
and receive its body straight into the caller's buffer (sync.client.peer `open_range` speaks
it; the module docstring there says why large blobs do not go through httpx).

    range_request(conn, url, start, end, authorization) -> bytes    the request to send
    RangeBody(conn, remaining, ...).readinto(view) -> int            the body, until 0
    parse_head(head) -> (status, headers)

A response this receiver does not understand raises `NeedsHttpx`; a body cut short is a
`TruncatedBodyError`.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from modelfs.sync.client.http import USER_AGENT
from modelfs.sync.client.partial import Stopped
from modelfs.sync.errors import PeerError, PeerLiedError, PeerUnreachableError


class TruncatedBodyError(PeerLiedError):
    """The peer closed the connection before sending the bytes it promised."""


class NeedsHttpx(Exception):
    """A response the raw receiver does not handle; fetch this range with httpx."""


# -- the raw receiver -------------------------------------------------------------------------
def range_request(conn: Conn, url: str, start: int, end: int, authorization: str | None) -> bytes:
    """The bytes of a GET of `url`'s bytes `start` to `end` on `conn` (absolute-form through
    a forwarding proxy), with `authorization` when there is one."""
    scheme, host, port, target = split_url(url)
    host_header = f"{f'[{host}]' if ':' in host else host}" + (
        "" if port in (80, 443) else f":{port}"
    )
    lines = [
        f"GET {f'{scheme}://{host_header}{target}' if conn.forward else target} HTTP/1.1",
        f"Host: {host_header}",
        f"User-Agent: {USER_AGENT}",
        "Accept-Encoding: identity",
        f"Range: bytes={start}-{end - 1}",
    ]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    if conn.proxy_authorization:
        lines.append(f"Proxy-Authorization: {conn.proxy_authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class Conn:
    """A kept-alive connection to one host, reusable for the next request to it."""

    sock: socket.socket
    key: tuple[str, str, int]
    buffered: bytearray = field(default_factory=bytearray)
    used: bool = False
    # Through an http proxy to an http URL: requests in absolute form, with these credentials
    # for the proxy (CONNECT tunnels and direct connections need neither).
    forward: bool = False
    proxy_authorization: str | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class RangeBody:
    """The body of one 200/206 blob response on a blocking socket; `readinto` until 0.

    `pos` is the blob offset of the next byte. A 206 starts at the range asked for; a 200
    (a peer that ignores Range: a plain web server, some proxies) is `whole`, from byte 0,
    and the caller reads only as far as it wants, `skip_to` its next range, and closes it.
    """

    def __init__(
        self,
        conn: Conn,
        remaining: int,
        *,
        url: str,
        what: str,
        stop: threading.Event,
        read_timeout: float,
        keep_alive: bool,
        pos: int,
        whole: bool,
    ) -> None:
        self.conn = conn
        self.remaining = remaining
        self.expected = remaining
        self.pos = pos
        self.whole = whole
        self.url = url
        self.what = what
        self.stop = stop
        self.read_timeout = read_timeout
        self.keep_alive = keep_alive

    def readinto(self, view: memoryview) -> int:
        """Fill as much of `view` as the peer sends now (at least one byte), 0 at the end."""
        if self.remaining == 0:
            return 0
        want = min(len(view), self.remaining)
        buffered = self.conn.buffered
        if buffered:
            n = min(want, len(buffered))
            view[:n] = buffered[:n]
            del buffered[:n]
            self.remaining -= n
            self.pos += n
            return n
        idle_since = time.monotonic()
        while True:
            if self.stop.is_set():
                raise Stopped()
            try:
                n = self.conn.sock.recv_into(view, want)
            except (TimeoutError, BlockingIOError):
                if time.monotonic() - idle_since > self.read_timeout:
                    raise PeerUnreachableError(
                        f"{self.url}: stalled, no data for {self.read_timeout:g} s while "
                        f"fetching {self.what}"
                    ) from None
                continue
            except OSError as exc:
                raise self._truncated(exc.strerror or str(exc)) from None
            if n == 0:
                raise self._truncated("connection closed")
            self.remaining -= n
            self.pos += n
            return n

    def skip_to(self, offset: int) -> None:
        """Read and drop the bytes before blob offset `offset` (a no-op at or past it)."""
        if self.pos >= offset:
            return
        scratch = bytearray(min(1 << 20, offset - self.pos))
        with memoryview(scratch) as view:
            while self.pos < offset:
                self.readinto(view[: min(len(view), offset - self.pos)])

    def close(self) -> None:
        self.conn.close()

    def _truncated(self, why: str) -> TruncatedBodyError:
        got = self.expected - self.remaining
        return TruncatedBodyError(
            f"{self.url}: truncated body ({why} after {got} of {self.expected} bytes) "
            f"while fetching {self.what}"
        )

    def release(self) -> Conn | None:
        """The connection, if it can carry another request; else it is closed."""
        if self.remaining == 0 and self.keep_alive and not self.conn.buffered:
            return self.conn
        self.conn.close()
        return None


def split_url(url: str) -> tuple[str, str, int, str]:
    u = urlsplit(url)
    scheme = u.scheme.lower()
    if scheme not in ("http", "https") or not u.hostname:
        raise PeerError(f"{url}: not an http(s) URL")
    port = u.port or (443 if scheme == "https" else 80)
    target = u.path or "/"
    if u.query:
        target += "?" + u.query
    return scheme, u.hostname, port, target


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"bad header line {line[:80]!r}")
        key = key.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return int(parts[1]), headers


class StaleConnection(Exception):
    pass


def proxy_authorization(proxy: httpx.URL | None) -> str | None:
    """Basic credentials for a proxy named `http://user:pass@host:port`, as httpx sends them."""
    if proxy is None or not proxy.username:
        return None
    raw = f"{proxy.username}:{proxy.password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")
