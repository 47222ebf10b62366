"""`python -m modelfs.demo` and `modelfs demo-store`: build the store, print what was written."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from modelfs.demo.build import build_demo_store
from modelfs.demo.records import DemoStore
from modelfs.store.scan import listed_tag, ollama_entries, scan_store
from modelfs.store.units import human_bytes

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`small` (or 0) -> 0; `64M`, `1G`, `4GiB`, `1.5G`, `1048576` -> bytes (binary units)."""
    text = text.strip()
    if text.lower() in ("small", "0", ""):
        return 0
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"bad size {text!r} (want small, or a number with K, M, G or T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _summary(demo: DemoStore) -> dict[str, Any]:
    return {
        "root": str(demo.root),
        "names": list(demo.names),
        "manifests": {k: m.digest.hex for k, m in demo.manifests.items()},
        "lists": {k: v.digest.hex for k, v in demo.lists.items()},
        "model_blob": str(demo.blob_path(demo.model_blob)),
        "model_blob_size": demo.blob_path(demo.model_blob).stat().st_size,
        "blobs": len(demo.blobs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make-demo-store",
        description="Write a small, realistic Ollama model store (for tests, demos, benchmarks).",
    )
    parser.add_argument("dir", type=Path, help="the store root to write (created if missing)")
    parser.add_argument(
        "--size",
        default="small",
        help="small (default), or the first model's GGUF size, e.g. 64M, 1G, 4G",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    try:
        weight_bytes = parse_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        demo = build_demo_store(args.dir, weight_bytes=weight_bytes)
    except OSError as exc:
        print(f"modelfs: error: {exc}", file=sys.stderr)
        return 1
    summary = _summary(demo)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"demo store: {demo.root}")
    # Each tag as `modelfs ls` lists it: its ID, and its size in the same units.
    index = scan_store(demo.root)
    for entry in ollama_entries(index):
        chosen = entry.preferred()
        size = human_bytes(chosen.manifest.size) if chosen is not None else "-"
        print(f"  {entry.name.shortest:40} {listed_tag(index, entry).digest.short}  {size}")
    print(f"  model blob: {summary['model_blob']} ({human_bytes(summary['model_blob_size'])})")
    return 0
