"""A hostile registry, for `modelfs serve --mirror` (tests/test_serve_load.py).

    python -m tests.hostile_upstream [--listen 127.0.0.1:0]

prints `listening on http://HOST:PORT` and serves until killed. `/v2/library/<mode>/…` is
answered as `mode` says: `redirect` to itself for ever, `endless` bodies (for at most
`ENDLESS_FOR` seconds each), `gzip` bombs (1 GiB of zeros in about 1 MiB), `corrupt` gzip.
`<mode>-blob` (`BAD`) has a good manifest whose config blob is right and whose 1 MiB layer is
answered so, or with the `wrong` bytes. `gzipped` and `deflated` are that good manifest,
honestly compressed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import time
import zlib
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOB_BYTES = 1 << 20
ENDLESS_FOR = 15.0  # seconds an endless body goes on, at most, if the mirror keeps reading


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


BAD = {
    m: digest_of((m.encode() * BLOB_BYTES)[:BLOB_BYTES])
    for m in ("endless-blob", "gzip-blob", "wrong-blob")
}

CONFIG = b"{}"


def manifest_of(mode: str) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": digest_of(CONFIG),
                "size": len(CONFIG),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.ollama.image.model",
                    "digest": BAD[mode],
                    "size": BLOB_BYTES,
                }
            ],
        }
    ).encode()


def gzip_bomb(size: int) -> bytes:
    """`size` zero bytes, gzipped: about a thousandth of that."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(size >> 20)) + packer.flush()


class Hostile(BaseHTTPRequestHandler):
    """The answers of the module's docstring."""

    protocol_version = "HTTP/1.1"
    bomb = b""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle(self) -> None:
        # The mirror hangs up on what it refuses: no traceback for that.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            super().handle()

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        parts = self.path.split("/")
        repo = parts[3] if len(parts) > 4 else ""
        mode = repo.removesuffix("-blob")
        if mode == "redirect":
            self._answer(302, b"", {"Location": self.path})
        elif self.path.endswith(digest_of(CONFIG)):
            self._answer(200, CONFIG)
        elif "/manifests/" in self.path and repo in BAD:
            raw = manifest_of(repo)
            self._answer(200, raw, {"Docker-Content-Digest": digest_of(raw)})
        elif mode == "endless":
            self._endless(b" " if "/manifests/" in self.path else b"x")
        elif mode == "gzip":
            self._answer(200, self.bomb, {"Content-Encoding": "gzip"})
        elif mode in ("gzipped", "deflated"):  # an honest compressed manifest, as a CDN sends
            raw = manifest_of("wrong-blob")
            packed = zlib.compress(raw, wbits=16 + zlib.MAX_WBITS if mode == "gzipped" else 15)
            coding = {"Content-Encoding": "gzip" if mode == "gzipped" else "deflate"}
            self._answer(200, packed, {"Docker-Content-Digest": digest_of(raw), **coding})
        elif mode == "corrupt":  # gzip that breaks off after its header
            self._answer(
                200, zlib.compress(b"{}" * 1000, wbits=31)[:30], {"Content-Encoding": "gzip"}
            )
        elif mode == "wrong":
            self._answer(200, bytes(BLOB_BYTES))
        else:
            self._answer(404, b"{}")

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if "/manifests/" in self.path:
            self.send_header("Content-Type", "application/vnd.docker.distribution.manifest.v2+json")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            try:
                self.wfile.write(body)
            except OSError:
                self.close_connection = True

    def _endless(self, byte: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.docker.distribution.manifest.v2+json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        if self.command != "GET":
            return
        piece = b"10000\r\n" + byte * 0x10000 + b"\r\n"
        started = time.monotonic()
        try:
            while time.monotonic() - started < ENDLESS_FOR:
                self.wfile.write(piece)
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hostile_upstream")
    p.add_argument("--listen", default="127.0.0.1:0")
    args = p.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    Hostile.bomb = gzip_bomb(1 << 30)
    server = ThreadingHTTPServer((host, int(port)), Hostile)
    server.daemon_threads = True
    print(f"listening on http://{host}:{server.server_port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
