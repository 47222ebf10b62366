"""A forwarding HTTP proxy (absolute-form requests and CONNECT) that counts what passes, as a
process, for tests.

    python tests/forwardproxy.py        -> prints `READY http://127.0.0.1:PORT`

Absolute-form requests (`GET http://host:port/path HTTP/1.1`, what a client sends an http
proxy for an http URL) are sent on to the host with `Connection: close` and the answer relayed
byte for byte; `CONNECT host:port` opens a tunnel (what a client does for an https URL).
`GET /_stats` (origin-form, to the proxy itself) answers what it carried: per target
`host:port`, the requests, CONNECTs and bytes sent back to clients.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections import defaultdict

CHUNK = 1 << 20
stats: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "connects": 0, "bytes": 0})
lock = threading.Lock()


def _count(target: str, key: str, n: int = 1) -> None:
    with lock:
        stats[target][key] += n


def _pipe(src: socket.socket, dst: socket.socket, target: str | None) -> None:
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
            if target is not None:
                _count(target, "bytes", len(data))
    except OSError:
        pass
    finally:
        for s in (dst,):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)


def _read_head(sock: socket.socket) -> tuple[bytes, bytes] | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def handle(client: socket.socket) -> None:
    try:
        got = _read_head(client)
        if got is None:
            return
        head, rest = got
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            _count(target, "connects")
            upstream = socket.create_connection((host.strip("[]"), int(port)))
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            t = threading.Thread(target=_pipe, args=(client, upstream, None), daemon=True)
            t.start()
            _pipe(upstream, client, target)
            t.join()
            upstream.close()
            return
        if not target.startswith("http://"):
            body = json.dumps(stats).encode()
            client.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            return
        hostport, _, path = target[len("http://") :].partition("/")
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "80")
        _count(hostport, "requests")
        headers = [
            line
            for line in lines[1:]
            if line and not line.lower().startswith(("proxy-", "connection:", "keep-alive:"))
        ]
        request = "\r\n".join([f"{method} /{path} {version}", *headers, "Connection: close"])
        upstream = socket.create_connection((host.strip("[]"), int(port or 80)))
        upstream.sendall(request.encode("latin-1") + b"\r\n\r\n" + rest)
        t = threading.Thread(target=_pipe, args=(client, upstream, None), daemon=True)
        t.start()
        answer = _read_head(upstream)
        if answer is not None:
            # The connection ends with this answer: say so, so clients do not reuse it.
            rhead, rrest = answer
            kept = [
                line
                for line in rhead.split(b"\r\n")
                if not line.lower().startswith((b"connection:", b"keep-alive:"))
            ]
            out = b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n" + rrest
            client.sendall(out)
            _count(hostport, "bytes", len(rrest))
            _pipe(upstream, client, hostport)
        upstream.close()
    except OSError:
        pass
    finally:
        client.close()


def main() -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    print(f"READY http://127.0.0.1:{server.getsockname()[1]}", flush=True)

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()


if __name__ == "__main__":
    main()
