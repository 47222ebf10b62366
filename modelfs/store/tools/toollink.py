"""`modelfs link`: a tool's layout (store.toolviews) written into a directory as symlinks into
the store's `blobs/`, for a machine without FUSE.

A second run brings the directory up to date: new files are linked, changed ones re-pointed,
files of models gone from the store removed (and the folders that leaves empty), and nothing
else touched. What this command wrote is recorded in `RECORD` in the directory; a path that
holds something else (a real download, a user's file) is never replaced or removed, only
reported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from modelfs.store.disk.fileio import read_file
from modelfs.store.errors import StoreError
from modelfs.store.tools.toolviews import ToolFile

RECORD = ".modelfs-link.json"
_MAX_RECORD = 64 << 20
_LINK = "link"


@dataclass(slots=True)
class LinkReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    skipped: list[str] = field(default_factory=list)  # paths holding something not ours


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_record(dest: Path, layout: str) -> dict[str, str]:
    path = dest / RECORD
    try:
        raw = read_file(path, _MAX_RECORD)
    except FileNotFoundError:
        return {}
    try:
        record = json.loads(raw)
        files = record["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"{path}: not a record modelfs link wrote; move it away") from None
    if record.get("layout") != layout:
        raise StoreError(
            f"{dest} holds the {record.get('layout')!r} layout, not {layout!r}: "
            "give each layout a directory of its own"
        )
    return files


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.modelfs-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _symlink_atomic(path: Path, target: str) -> None:
    tmp = path.with_name(f".{path.name}.modelfs-tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def _is_ours(path: Path, kind: str, blobs: str) -> bool:
    """Whether `path` still holds what this command put there (`kind` from the record)."""
    try:
        if kind == _LINK:
            return path.is_symlink() and os.path.dirname(os.readlink(path)) == blobs
        return not path.is_symlink() and path.is_file() and _sha(path.read_bytes()) == kind
    except OSError:
        return False


def write_links(blobs_dir: Path, files: Sequence[ToolFile], dest: Path, layout: str) -> LinkReport:
    """Make `dest` hold `files` of `layout`; see the module's docstring."""
    blobs = os.path.realpath(blobs_dir)
    if dest.exists() and not dest.is_dir():
        raise StoreError(f"{dest}: not a directory; give modelfs link a directory of its own")
    dest.mkdir(parents=True, exist_ok=True)
    previous = _read_record(dest, layout)
    report = LinkReport()
    now: dict[str, str] = {}
    for f in files:
        path = dest / f.path
        kind = _LINK if f.source is not None else _sha(f.data)
        mine = f.path in previous and _is_ours(path, previous[f.path], blobs)
        if f.source is not None:
            target = os.path.join(blobs, f.source.layer.digest.blob_name)
            same = path.is_symlink() and os.readlink(path) == target
            # A link into these blobs is ours even when the record was lost.
            mine = mine or (path.is_symlink() and os.path.dirname(os.readlink(path)) == blobs)
            put = partial(_symlink_atomic, path, target)
        else:
            same = not path.is_symlink() and path.is_file() and _sha(path.read_bytes()) == kind
            put = partial(_write_atomic, path, f.data)
        if same:
            report.unchanged += 1
        elif mine:
            put()
            report.updated.append(f.path)
        elif os.path.lexists(path):
            report.skipped.append(f.path)
            continue
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            put()
            report.added.append(f.path)
        now[f.path] = kind
    for rel in sorted(set(previous) - set(now)):
        path = dest / rel
        if _is_ours(path, previous[rel], blobs):
            path.unlink()
            report.removed.append(rel)
            _prune(path.parent, dest)
    record = {"layout": layout, "store_blobs": blobs, "files": dict(sorted(now.items()))}
    _write_atomic(dest / RECORD, json.dumps(record, indent=1).encode() + b"\n")
    return report


def _prune(folder: Path, dest: Path) -> None:
    """Remove `folder` and its parents below `dest` while they are empty."""
    while folder != dest and dest in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
