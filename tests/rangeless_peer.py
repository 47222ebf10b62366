"""A plain static web server in front of a store, as a user might put one: it ignores `Range`
(every GET is answered 200 with the whole file), like `python -m http.server`, whose handler
it is, and can send slowly, so that a pull can be killed in the middle of a blob.

    python -m tests.rangeless_peer --directory DIR [--rate BYTES_PER_S]

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

from store.layout import Layout
from store.manifest import Manifest, parse_manifest
from store.names import parse_name
from sync.client import repositories


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

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def copyfile(self, source: BinaryIO, outputfile: Any) -> None:  # type: ignore[override]
        if not self.rate:
            shutil.copyfileobj(source, outputfile)
            return
        while chunk := source.read(64 << 10):
            outputfile.write(chunk)
            time.sleep(len(chunk) / self.rate)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rangeless_peer")
    ap.add_argument("--directory", required=True)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes per second (0: no limit)")
    args = ap.parse_args(argv)
    handler = type("Handler", (_Handler,), {"rate": args.rate})
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
