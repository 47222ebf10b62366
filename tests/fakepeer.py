"""A small OCI-distribution peer over a store, with fault injection, for the pull tests.

    python -m tests.fakepeer --store DIR [--listen 127.0.0.1:0] [--fault SPEC ...]
                             [--token T] [--log FILE]

prints `listening on http://HOST:PORT` (as `modelfs serve` does) and serves until killed. In a
test process, `FakePeer(root, faults=[...]).start()` runs the same server in a thread.

It serves what a pull needs and no more: `GET /v2/`, `GET|HEAD /v2/<repo>/manifests/<ref>`
(a tag or a digest; a manifest list only when `Accept` names its type, else the preferred
child), `GET|HEAD /v2/<repo>/blobs/<digest>` with one `bytes=a-b` / `bytes=a-` range, and
`Docker-Content-Digest` on every manifest and blob. Healthy blob bodies go out with
`sendfile`, so the peer is not what a benchmark measures.

A fault SPEC is `KIND[=ARG][@TARGET][#TIMES]`:

    flip            one byte of the body is flipped (at the blob's middle, if in range)
    truncate        the full Content-Length is promised, half the body is sent, then close
    poison          as truncate, but the half sent is zeros (wrong bytes, then a hang-up)
    short-length    Content-Length is one byte short, and so is the body (a lying length)
    long-length     Content-Length is 100 bytes long, the real body is sent, then close
    stall           half the body, then nothing (until the peer is stopped)
    status=N        answer N (500, 401, 404, …) with a small JSON error
    throttle=RATE   send at RATE bytes/s (`50M`, `200K`), in 64 KiB pieces
    chunked         a `Transfer-Encoding: chunked` body instead of Content-Length
    drop            close the connection without an answer
    bad-digest      a wrong Docker-Content-Digest header (use with @manifest)

TARGET is `blob` (default: every blob), `manifest` (every manifest request), or a hex prefix of
one blob's digest; TIMES limits the fault to the first N matching requests. Every request is
recorded (`requests`, and one JSON line per request in `--log`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST, ManifestList, parse_manifest
from modelfs.store.scan import scan_store
from modelfs.sync.wire.protocol import name_from_repository, repository_of

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_PATH = re.compile(r"/v2/(?P<repo>.+)/(?P<kind>manifests|blobs)/(?P<ref>[^/]+)")
_RATE = re.compile(r"(\d+(?:\.\d+)?)([KMG]?)", re.IGNORECASE)


@dataclass
class Fault:
    kind: str
    arg: str = ""
    target: str = "blob"
    times: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Fault:
        times = None
        if "#" in spec:
            spec, n = spec.rsplit("#", 1)
            times = int(n)
        target = "blob"
        if "@" in spec:
            spec, target = spec.split("@", 1)
        kind, _, arg = spec.partition("=")
        known = {
            "flip",
            "truncate",
            "poison",
            "short-length",
            "long-length",
            "stall",
            "status",
            "throttle",
            "chunked",
            "drop",
            "bad-digest",
        }
        if kind not in known:
            raise ValueError(f"unknown fault {kind!r}")
        return cls(kind, arg, target, times)

    def matches(self, kind: str, digest: str | None) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.target == "manifest":
            return kind == "manifests"
        if self.target == "blob":
            return kind == "blobs"
        return kind == "blobs" and digest is not None and digest.startswith(self.target)

    @property
    def rate(self) -> float:
        m = _RATE.fullmatch(self.arg)
        if m is None:
            raise ValueError(f"bad rate {self.arg!r}")
        unit = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2).upper()]
        return float(m.group(1)) * unit


@dataclass
class FakePeer:
    """The peer's state: the store, the faults still armed, and every request seen."""

    root: Path
    faults: list[Fault] = field(default_factory=list)
    token: str | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.layout = Layout(self.root)
        self.faults = [Fault.parse(f) if isinstance(f, str) else f for f in self.faults]

    # -- lifecycle --------------------------------------------------------------------------
    def bind(self) -> ThreadingHTTPServer:
        peer = self

        class Handler(_Handler):
            pass

        Handler.peer = peer
        server = ThreadingHTTPServer((self.host, self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        return server

    def start(self) -> FakePeer:
        server = self.bind()
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakePeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- bookkeeping ------------------------------------------------------------------------
    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)
            if self.log_path is not None:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")

    def take_fault(self, kind: str, digest: str | None) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(kind, digest):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def blob_requests(self, prefix: str = "") -> list[dict[str, Any]]:
        with self._lock:
            return [
                r
                for r in self.requests
                if r["kind"] == "blobs" and (r["digest"] or "").startswith(prefix)
            ]


class _Handler(BaseHTTPRequestHandler):
    peer: FakePeer
    protocol_version = "HTTP/1.1"
    server_version = "fakepeer/1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        # A client that hangs up (a cancelled or killed pull) is not worth a traceback.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            super().handle()

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        headers = {"Content-Type": "application/json"}
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="fakepeer"'
        self._send(status, body, headers)

    def do_HEAD(self) -> None:
        self._handle()

    def do_GET(self) -> None:
        self._handle()

    # -- routing ----------------------------------------------------------------------------
    def _handle(self) -> None:
        peer = self.peer
        m = _PATH.fullmatch(self.path.split("?", 1)[0])
        kind = m.group("kind") if m else "other"
        ref = m.group("ref") if m else None
        digest = None
        if ref is not None and ref.startswith("sha256:"):
            with contextlib.suppress(StoreError):
                digest = Digest.parse(ref).hex
        peer.record(
            {
                "method": self.command,
                "path": self.path,
                "kind": kind,
                "digest": digest,
                "range": self.headers.get("Range"),
                "accept": self.headers.get("Accept"),
                "authorization": self.headers.get("Authorization"),
                "time": time.time(),
            }
        )
        if peer.token is not None and self.headers.get("Authorization") != f"Bearer {peer.token}":
            self._error(401, "UNAUTHORIZED", "authentication required")
            return
        if self.path == "/v2/" or self.path == "/v2":
            self._send(200, b"{}", {"Content-Type": "application/json"})
            return
        if m is None:
            self._listing(self.path.split("?", 1)[0])
            return
        fault = peer.take_fault(kind, digest)
        if fault is not None and fault.kind == "status":
            self._error(int(fault.arg or 500), "FAULT", "injected")
            return
        if fault is not None and fault.kind == "drop":
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        try:
            if kind == "manifests":
                self._manifest(m.group("repo"), m.group("ref"), fault)
            else:
                self._blob(digest, fault)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _listing(self, path: str) -> None:
        """`/v2/_catalog` and `/v2/<repo>/tags/list`, unpaginated, for the sync daemon."""
        tags: dict[str, list[str]] = {}
        for entry in scan_store(self.peer.layout):
            tags.setdefault(repository_of(entry.name), []).append(entry.name.tag)
        if path == "/v2/_catalog":
            body: dict[str, Any] = {"repositories": sorted(tags)}
        elif path.startswith("/v2/") and path.endswith("/tags/list"):
            repo = path[len("/v2/") : -len("/tags/list")]
            if repo not in tags:
                self._error(404, "NAME_UNKNOWN", f"no repository {repo}")
                return
            body = {"name": repo, "tags": sorted(tags[repo])}
        else:
            self._error(404, "NOT_FOUND", "no such endpoint")
            return
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _manifest(self, repo: str, ref: str, fault: Fault | None) -> None:
        layout = self.peer.layout
        accept = self.headers.get("Accept", "")
        if ref.startswith("sha256:"):
            try:
                digest = Digest.parse(ref)
                raw = layout.blob(digest).read_bytes()
                parsed = parse_manifest(raw, ref)
            except (StoreError, OSError):
                self._error(404, "MANIFEST_UNKNOWN", f"no manifest {ref}")
                return
        else:
            try:
                name = name_from_repository(repo, ref)
                entry = scan_store(layout).lookup(name)
            except StoreError:
                self._error(404, "MANIFEST_UNKNOWN", f"no manifest {repo}:{ref}")
                return
            parsed = entry.top
            if isinstance(parsed, ManifestList) and MEDIA_LIST not in accept:
                variant = entry.preferred()
                if variant is None:
                    self._error(404, "MANIFEST_UNKNOWN", "no variant present")
                    return
                parsed = variant.manifest
            raw = parsed.raw
        media = MEDIA_LIST if isinstance(parsed, ManifestList) else parsed.media_type
        self._send(
            200,
            raw,
            {
                "Content-Type": media or MEDIA_MANIFEST,
                "Docker-Content-Digest": str(
                    Digest.of_bytes(raw + (b"!" if fault and fault.kind == "bad-digest" else b""))
                ),
            },
        )

    def _blob(self, digest: str | None, fault: Fault | None) -> None:
        if digest is None:
            self._error(400, "DIGEST_INVALID", "bad digest")
            return
        path = self.peer.layout.blob(Digest(digest))
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError:
            self._error(404, "BLOB_UNKNOWN", f"no blob sha256:{digest}")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            start, end, status = 0, size, 200
            if (rng := self.headers.get("Range")) is not None:
                m = _RANGE.fullmatch(rng.strip())
                if m is None or int(m.group(1)) >= size:
                    self._error(416, "RANGE_INVALID", rng)
                    return
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                status = 206
            self._body(f, size, start, end, status, f"sha256:{digest}", fault)

    def _body(
        self,
        f: Any,
        size: int,
        start: int,
        end: int,
        status: int,
        digest: str,
        fault: Fault | None,
    ) -> None:
        length = end - start
        kind = fault.kind if fault else ""
        claimed = {"short-length": length - 1, "long-length": length + 100}.get(kind, length)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Docker-Content-Digest", digest)
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        if kind == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(claimed))
        self.end_headers()
        if self.command == "HEAD":
            return
        sock = self.connection
        if kind == "":
            self.wfile.flush()
            sock.sendfile(f, start, length)
            return
        # Faulty bodies are sent by hand, in pieces.
        self.close_connection = kind in (
            "truncate",
            "poison",
            "long-length",
            "stall",
            "short-length",
        )
        half = start + length // 2
        send_to = {"truncate": half, "poison": half, "stall": half}.get(kind, end)
        if kind == "short-length":
            send_to = end - 1
        flip_at = size // 2 if start <= size // 2 < end else start
        rate = fault.rate if fault and kind == "throttle" else 0.0
        t0, sent = time.monotonic(), 0
        pos = start
        piece = 64 << 10 if rate else 1 << 20
        while pos < send_to:
            n = min(piece, send_to - pos)
            data = bytearray(os.pread(f.fileno(), n, pos))
            if kind == "flip" and pos <= flip_at < pos + n:
                data[flip_at - pos] ^= 0xFF
            if kind == "poison":
                data = bytearray(n)
            if kind == "chunked":
                self.wfile.write(b"%x\r\n" % len(data) + bytes(data) + b"\r\n")
            else:
                self.wfile.write(data)
            pos += n
            sent += n
            if rate:
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0 and self.peer.stopping.wait(ahead):
                    return
        if kind == "chunked":
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        if kind == "stall":
            self.peer.stopping.wait(3600)
        if self.close_connection:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fakepeer")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--token")
    p.add_argument("--log", type=Path)
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    peer = FakePeer(
        args.store, args.fault, token=args.token, log_path=args.log, host=host, port=int(port)
    )
    server = peer.bind()
    print(f"listening on {peer.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
