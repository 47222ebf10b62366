"""A plain static web server in front of a store, as a user might put one: it ignores `Range`
(every GET is answered 200 with the whole file), like `python -m http.server`, whose handler
it is, and can send slowly, so that a pull can be killed in the middle of a blob, or in
chunked encoding (which modelfs receives through httpx).

    python -m tests.rangeless_peer --directory DIR [--rate BYTES_PER_S] [--chunked]

prints `listening on http://HOST:PORT` and serves until killed. `lay_out(store, dest, name)`
writes the directory it serves: `v2/<repo>/manifests/<tag>` and `v2/<repo>/blobs/<digest>`.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import time
from collections.abc import Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

from modelfs.store.layout import Layout
from modelfs.store.manifest import Manifest, parse_manifest
from modelfs.store.names import parse_name
from modelfs.sync.client.peer import repositories


def lay_out(store: Path, dest: Path, name: str) -> Path:
    """The files a static server needs to answer a pull of `name` from `store`'s copy."""
    layout = Layout(store)
    n = parse_name(name)
    raw = layout.manifests.joinpath(*n.legacy_parts()).read_bytes()
    manifest = parse_manifest(raw, name)
    assert isinstance(manifest, Manifest)
    repo = dest / "v2" / repositories(n)[0]
    (repo / "manifests").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "manifests" / n.tag).write_bytes(raw)
    for ref in [manifest.config, *manifest.layers]:
        if ref is not None:
            target = repo / "blobs" / str(ref.digest)
            if not target.exists():
                os.link(layout.blob(ref.digest), target)
    return dest


class _Handler(SimpleHTTPRequestHandler):
    rate = 0.0
    chunked = False

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        if self.chunked:
            # The file's length goes; the body is sent in chunks (a proxy that re-encodes).
            self._headers_buffer = [
                h for h in self._headers_buffer if not h.lower().startswith(b"content-length:")
            ]
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
        super().end_headers()

    def copyfile(self, source: BinaryIO, outputfile: Any) -> None:  # type: ignore[override]
        if not self.rate and not self.chunked:
            shutil.copyfileobj(source, outputfile)
            return
        while chunk := source.read(64 << 10):
            outputfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self.chunked else chunk)
            if self.rate:
                time.sleep(len(chunk) / self.rate)
        if self.chunked:
            outputfile.write(b"0\r\n\r\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rangeless_peer")
    ap.add_argument("--directory", required=True)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes per second (0: no limit)")
    ap.add_argument("--chunked", action="store_true", help="bodies in chunked encoding")
    args = ap.parse_args(argv)
    attrs: dict[str, Any] = {"rate": args.rate, "chunked": args.chunked}
    if args.chunked:
        attrs["protocol_version"] = "HTTP/1.1"
    handler = type("Handler", (_Handler,), attrs)
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=args.directory)
    )
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
