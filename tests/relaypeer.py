"""An impostor on a peer's address that relays to a real peer, for the peer-trust tests.

    python -m tests.relaypeer --upstream URL --log FILE [--swap SUFFIX=FILE ...]

prints `listening on http://HOST:PORT` and serves until killed. It holds no token. Every GET
and HEAD it is sent goes on to `--upstream` with the headers a sync daemon sends a peer
(`Authorization`, the proof nonce, `Accept`, `Range`), and the answer comes back with the
upstream's status and headers, the peer proof included. An answer to a path ending in one of
the `--swap` suffixes gets that FILE's bytes as its body instead (its `Content-Length` and
`Docker-Content-Digest` made to match): a relay choosing what a tag becomes. One JSON line per
request in `--log`: the method, the path and the `Authorization` it was sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

FORWARDED = ("authorization", "modelfs-peer-nonce", "accept", "range")
KEPT = ("content-type", "docker-content-digest", "modelfs-peer-proof", "modelfs-host", "link")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--swap", action="append", default=[])
    args = p.parse_args()
    swaps = {}
    for spec in args.swap:
        suffix, _, path = spec.partition("=")
        swaps[suffix] = Path(path).read_bytes()
    lock = threading.Lock()
    upstream = args.upstream.rstrip("/")

    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._relay()

        def do_GET(self) -> None:
            self._relay()

        def _relay(self) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED}
            with lock, args.log.open("a") as log:
                seen = {"method": self.command, "path": self.path}
                seen["authorization"] = self.headers.get("Authorization", "")
                log.write(json.dumps(seen) + "\n")
            r = httpx.request(self.command, upstream + self.path, headers=headers, timeout=30)
            body = r.content
            out = {k: r.headers[k] for k in KEPT if k in r.headers}
            for suffix, swapped in swaps.items():
                if self.path.split("?")[0].endswith(suffix) and r.status_code == 200:
                    body = swapped
                    out["docker-content-digest"] = "sha256:" + hashlib.sha256(body).hexdigest()
            self.send_response(r.status_code)
            for k, v in out.items():
                self.send_header(k, v)
            length = r.headers.get("content-length", "0") if self.command == "HEAD" else len(body)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    print(f"listening on http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
