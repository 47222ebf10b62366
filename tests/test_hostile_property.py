"""Random hostile stores: valid models mixed with everything a shared directory collects
(broken manifests, manifests naming absent blobs, FIFOs, sockets, devices, links that dangle,
loop or leave the store, directories where files should be and files where directories
should be, names no tag can have, Mac droppings, short blobs, mode 000 files).

For every store `ls`, `gc --dry-run`, `verify` and a scan end on their own within a bound
and answer with a report or one error line, never a traceback; GC never plans to take a blob
that a readable manifest names, and real GC runs leave every blob of every intact model
byte for byte. `ls` and `gc --dry-run` run a second time without root's right to read any
file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), for which the mode 000 files are unreadable.
MODELFS_PROPERTY_EXAMPLES sets the number of stores (default 8: ~40 s on two shared cores)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.scan import scan_store
from tests.builders import TinyStore
from tests.test_gc import MODELFS

BOUND = 30.0  # seconds any one command may take on a store of a dozen entries
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
PAYLOADS = [f"weights {i} ".encode() * (i + 1) for i in range(4)]

# What a tag's path may hold. "model", "v2", "odd-manifest", "outside-manifest" and
# "mode000" hold readable manifests (root reads a mode 000 file).
TAG_KINDS = [
    "model",
    "model",
    "v2",
    "absent-blob",
    "truncated",
    "empty",
    "junk",
    "fifo",
    "socket",
    "dev-zero",
    "link-loop",
    "dangling",
    "outside",
    "outside-manifest",
    "directory",
    "mode000",
]
DIR_KINDS = [".DS_Store", "._t0", "t0~", "odd-manifest", "file-as-model-dir", "file-as-namespace"]
BLOB_KINDS = [
    "truncated-blob",
    "empty-blob",
    "fifo-blob",
    "directory-blob",
    "outside-blob",
    "dangling-blob",
    "stray-blob",
]
KINDS = TAG_KINDS + DIR_KINDS + BLOB_KINDS


@dataclass
class Built:
    """A store and what a correct GC must keep in it."""

    tiny: TinyStore
    kept: dict[str, set[Digest]] = field(default_factory=dict)  # manifest path -> digests
    broken: set[Digest] = field(default_factory=set)  # blobs made short on purpose

    def protected(self) -> set[Digest]:
        return set().union(*self.kept.values()) if self.kept else set()

    def intact(self) -> dict[Digest, str]:
        """sha256 of every present blob of every model none of whose blobs was broken."""
        out = {}
        for digests in self.kept.values():
            if digests & self.broken:
                continue
            for d in digests:
                p = self.tiny.layout.blob(d)
                if p.is_file() and not p.is_symlink():
                    out[d] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out


def _clear(p: Path) -> None:
    """Make room at `p` for a new entry, whatever is there."""
    if p.is_symlink() or p.exists() or os.path.lexists(p):
        if p.is_dir() and not p.is_symlink():
            for sub in sorted(p.rglob("*"), reverse=True):
                sub.unlink() if not sub.is_dir() or sub.is_symlink() else sub.rmdir()
            p.rmdir()
        else:
            p.unlink()


def _manifest(tiny: TinyStore, p: int) -> tuple[bytes, set[Digest]]:
    raw = tiny.manifest(
        [tiny.layer("model", PAYLOADS[p]), tiny.layer("template", PAYLOADS[(p + 1) % 4])]
    )
    obj = json.loads(raw)
    digests = {Digest.parse(x["digest"]) for x in [obj["config"], *obj["layers"]]}
    return raw, digests | {Digest.of_bytes(raw)}


def build(root: Path, outside: Path, entries: list[tuple[str, int, int]]) -> Built:
    tiny = TinyStore(root)
    built = Built(tiny)
    lib = tiny.layout.manifests / "registry.ollama.ai" / "library"
    breaks: list[Callable[[], None]] = []
    for n, (kind, slot, p) in enumerate(entries):
        tag = lib / f"m{slot}" / f"t{p % 2}"
        if kind == "v2":
            tag = tiny.layout.manifests_v2 / "ollama.com" / "library" / f"m{slot}" / f"t{p % 2}"
        if kind in TAG_KINDS:
            rel = str(tag.relative_to(root))
            built.kept.pop(rel, None)
            tag.parent.mkdir(parents=True, exist_ok=True)
            _clear(tag)
            raw, digests = _manifest(tiny, p)
            if kind == "model":
                tag.write_bytes(raw)
                built.kept[rel] = digests
            elif kind == "v2":
                tiny.v2(f"m{slot}:t{p % 2}", raw)
                built.kept[rel] = digests
            elif kind == "mode000":
                tag.write_bytes(raw)
                tag.chmod(0)
                built.kept[rel] = digests
            elif kind == "absent-blob":
                obj = json.loads(raw)
                obj["layers"].append(
                    {"mediaType": "application/vnd.ollama.image.model",
                     "digest": str(Digest.of_bytes(b"absent %d" % n)), "size": 9}
                )  # fmt: skip
                raw = json.dumps(obj).encode()
                tag.write_bytes(raw)
                built.kept[rel] = {Digest.parse(x["digest"]) for x in obj["layers"]}
            elif kind == "truncated":
                tag.write_bytes(raw[: 1 + n * 7 % (len(raw) - 2)])
            elif kind == "empty":
                tag.write_bytes(b"")
            elif kind == "junk":
                tag.write_bytes(b"\x00\x01 not json \xff")
            elif kind == "fifo":
                os.mkfifo(tag)
            elif kind == "socket":
                os.mknod(tag, 0o600 | stat.S_IFSOCK)
            elif kind == "dev-zero":
                tag.symlink_to("/dev/zero")
            elif kind == "link-loop":
                tag.symlink_to(tag.name)
            elif kind == "dangling":
                tag.symlink_to(root / "nowhere" / "at-all")
            elif kind == "outside":
                (outside / f"junk{n}").write_bytes(b"not a manifest")
                tag.symlink_to(outside / f"junk{n}")
            elif kind == "outside-manifest":
                (outside / f"m{n}").write_bytes(raw)
                tag.symlink_to(outside / f"m{n}")
                built.kept[rel] = digests
            elif kind == "directory":
                tag.mkdir()
                (tag / "latest").write_bytes(raw)  # below tag depth: names nothing
        elif kind in DIR_KINDS:
            d = lib / f"m{slot}"
            if kind == "file-as-model-dir":
                d = lib / f"f{slot}"
            elif kind == "file-as-namespace":
                d = tiny.layout.manifests / "registry.ollama.ai" / f"ns{slot}"
            if kind.startswith("file-as"):
                if not d.is_dir():
                    _clear(d)
                    d.parent.mkdir(parents=True, exist_ok=True)
                    d.write_bytes(_manifest(tiny, p)[0])
                continue
            d.mkdir(parents=True, exist_ok=True)
            if kind == "odd-manifest":
                raw, digests = _manifest(tiny, p)
                _clear(d / "t0~")
                (d / "t0~").write_bytes(raw)
                built.kept[str((d / "t0~").relative_to(root))] = digests
            else:
                _clear(d / kind)
                (d / kind).write_bytes(b"\x00\x00\x00\x01Bud1 junk")
                built.kept.pop(str((d / kind).relative_to(root)), None)
        else:
            target = Digest.of_bytes(PAYLOADS[p])
            other = tiny.layout.blob(Digest.of_bytes(b"hostile blob %d" % n))
            if kind in ("truncated-blob", "empty-blob"):
                path = tiny.layout.blob(target)

                def cut(path: Path = path, keep: int = 0 if kind == "empty-blob" else 3) -> None:
                    if path.is_file():
                        with path.open("r+b") as f:
                            f.truncate(keep)

                breaks.append(cut)
                built.broken.add(target)
            elif kind == "fifo-blob":
                _clear(other)
                os.mkfifo(other)
            elif kind == "directory-blob":
                _clear(other)
                other.mkdir()
            elif kind == "outside-blob":
                (outside / f"b{n}").write_bytes(b"hostile blob %d" % n)
                _clear(other)
                other.symlink_to(outside / f"b{n}")
            elif kind == "dangling-blob":
                _clear(other)
                other.symlink_to("sha256-" + "0" * 64)
            else:
                (tiny.layout.blobs / f"sha256-{target.hex}-partial-{n}").write_bytes(b"part")
                (tiny.layout.blobs / ".DS_Store").write_bytes(b"Bud1")
    for cut in breaks:
        cut()
    old = time.time() - 7200  # older than any grace: only a reference keeps a blob
    for p in tiny.layout.blobs.iterdir():
        os.utime(p, (old, old), follow_symlinks=False)
    return built


def run(*argv: str, no_dac: bool = False) -> subprocess.CompletedProcess[str]:
    """A command that must end within BOUND with a report or one error line."""
    prefix = NO_DAC if no_dac else []
    r = subprocess.run([*prefix, MODELFS, *argv], capture_output=True, text=True, timeout=BOUND)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    assert r.returncode in (0, 1), out
    if r.returncode == 1:
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("modelfs: error:")]
        assert len(errors) <= 1, out
        assert errors or r.stdout.strip(), out  # an error line, or a report that says why
    return r


def gc_report(*argv: str, no_dac: bool = False) -> dict[str, Any]:
    r = run("gc", "--json", *argv, no_dac=no_dac)
    report: dict[str, Any] = json.loads(r.stdout) if r.stdout.strip() else {}
    return report


def planned(report: dict[str, Any]) -> set[Digest]:
    return {
        Digest.parse(item["digest"])
        for key in ("pending", "trashed")
        for item in report.get(key, [])
    }


entries = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(0, 3)),
    min_size=1,
    max_size=12,
)


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("MODELFS_PROPERTY_EXAMPLES", "8")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(entries)
def test_hostile_stores(entries: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory(prefix="modelfs-hostile-") as tmp:
        (Path(tmp) / "outside").mkdir()
        built = build(Path(tmp) / "s", Path(tmp) / "outside", entries)
        store = str(built.tiny.root)
        protected = built.protected()
        intact = built.intact()
        fast = ("--grace", "0", "--grace-below-floor", "--trash-retention", "0")

        started = time.monotonic()
        scan_store(Layout(Path(store)))
        assert time.monotonic() - started < BOUND
        run("ls", "--store", store)
        run("ls", "--store", store, no_dac=True)
        for no_dac in (False, True):
            report = gc_report("--store", store, "--dry-run", *fast, no_dac=no_dac)
            assert not planned(report) & protected, (report, protected)
        for _ in range(2):  # a first sighting, then the moves and the purge
            report = gc_report("--store", store, *fast)
            assert not planned(report) & protected, (report, protected)
        for d, digest in intact.items():
            p = built.tiny.layout.blob(d)
            assert hashlib.sha256(p.read_bytes()).hexdigest() == digest, f"{d} lost or changed"
        for rel in built.kept:
            assert os.path.lexists(Path(store) / rel), f"{rel} removed"
        run("verify", "--store", store)
