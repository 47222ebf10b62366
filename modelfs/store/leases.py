"""Leases: what a live process on some host needs kept, so GC anywhere leaves it alone.

Each process that needs blobs kept (a mount, a pull, the daemon) owns one file,
`<store>/.modelfs/leases/<host>.<pid>.<purpose>.json`:

    {"version": 1, "host", "pid", "purpose", "ttl",
     "digests": ["sha256:…"],      blobs kept as they are (open files, transfers in flight)
     "manifests": ["sha256:…"]}    manifest blobs kept together with every blob they name

The file's mtime is its heartbeat; it is rewritten (temp file + rename, so a reader never
sees half of one) whenever its contents change and touched between changes. A lease is live
until its heartbeat is older than its own `ttl`. Whether its process still runs is not asked,
not even on the same host name: two containers can share a hostname and not a pid space, and
an error here costs a blob. A lease that cannot be read stops GC (GC invariant 2,
docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_binary
from modelfs.store.disk.owner import write_atomic
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout
from modelfs.store.lockfile import host_id
from modelfs.store.scan import Problem

LEASE_VERSION = 1
DEFAULT_TTL = 24 * 3600.0  # a crashed host's blobs are kept this long
HEARTBEAT = 60.0  # seconds between touches of an unchanged lease
MAX_LEASE_BYTES = 64 << 20
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class Lease:
    path: Path
    host: str
    pid: int
    purpose: str
    ttl: float
    heartbeat: float
    digests: frozenset[Digest]
    manifests: frozenset[Digest]

    def expired(self, now: float) -> bool:
        return now - self.heartbeat > self.ttl


@dataclass
class LeaseSet:
    """Every lease of a store, read at one moment."""

    live: list[Lease] = field(default_factory=list)
    expired: list[Lease] = field(default_factory=list)
    unreadable: list[Problem] = field(default_factory=list)

    @property
    def digests(self) -> set[Digest]:
        return {d for lease in self.live for d in lease.digests}

    @property
    def manifests(self) -> set[Digest]:
        return {d for lease in self.live for d in lease.manifests}


def _digests(value: object, key: str) -> frozenset[Digest]:
    if not isinstance(value, list):
        raise StoreError(f"{key!r} is not a list")
    if not all(isinstance(v, str) for v in value):
        raise StoreError(f"{key!r} holds a non-string")
    return frozenset(Digest.parse(v) for v in value)


def parse_lease(raw: bytes, path: Path, mtime: float) -> Lease:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise StoreError(f"not JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("version") != LEASE_VERSION:
        raise StoreError(f"not a version {LEASE_VERSION} lease")
    host, pid, purpose, ttl = obj.get("host"), obj.get("pid"), obj.get("purpose"), obj.get("ttl")
    if not isinstance(host, str) or not isinstance(pid, int) or not isinstance(purpose, str):
        raise StoreError("host, pid or purpose missing")
    if not isinstance(ttl, int | float) or ttl <= 0:
        raise StoreError("ttl missing or not positive")
    return Lease(
        path,
        host,
        pid,
        purpose,
        float(ttl),
        mtime,
        _digests(obj.get("digests", []), "digests"),
        _digests(obj.get("manifests", []), "manifests"),
    )


def read_leases(layout: Layout, now: float | None = None) -> LeaseSet:
    now = now if now is not None else time.time()
    result = LeaseSet()
    try:
        names = sorted(os.listdir(layout.leases))
    except FileNotFoundError:
        return result
    except OSError as exc:
        result.unreadable.append(Problem("bad-lease", ".modelfs/leases", exc.strerror or ""))
        return result
    for name in names:
        if name.startswith("."):
            continue  # a lease being written; it is renamed into place whole
        path = layout.leases / name
        rel = f".modelfs/leases/{name}"
        try:
            with open_binary(path) as f:
                mtime = os.fstat(f.fileno()).st_mtime
                raw = f.read(MAX_LEASE_BYTES + 1)
            if len(raw) > MAX_LEASE_BYTES:
                raise StoreError("larger than any lease")
            lease = parse_lease(raw, path, mtime)
        except FileNotFoundError:
            continue  # released while we looked
        except IsADirectoryError:
            result.unreadable.append(Problem("bad-lease", rel, "a directory"))
            continue
        except OSError as exc:
            result.unreadable.append(Problem("bad-lease", rel, exc.strerror or str(exc)))
            continue
        except StoreError as exc:
            result.unreadable.append(Problem("bad-lease", rel, str(exc)))
            continue
        (result.expired if lease.expired(now) else result.live).append(lease)
    return result


class LeaseKeeper:
    """This process's lease. Callers `hold`/`drop` digests (counted: two open files of one blob
    hold it twice) and call `write` when `dirty`, `touch` between changes, `remove` at exit.
    Not thread-safe: one owner (a trio task) calls it, writes going through a worker thread."""

    def __init__(
        self, layout: Layout, purpose: str, *, ttl: float = DEFAULT_TTL, host: str | None = None
    ) -> None:
        self.layout = layout
        self.purpose = purpose
        self.ttl = ttl
        self.host = host or host_id()
        self.pid = os.getpid()
        stem = _SAFE.sub("_", f"{self.host}.{self.pid}.{purpose}")
        self.path = layout.leases / f"{stem}.json"
        self._digests: Counter[Digest] = Counter()
        self._manifests: Counter[Digest] = Counter()
        self.version = 0  # bumped on every change
        self.written = -1  # the version on disk

    @property
    def dirty(self) -> bool:
        return self.version != self.written

    def hold(self, digests: Iterable[Digest] = (), manifests: Iterable[Digest] = ()) -> None:
        before = (len(self._digests), len(self._manifests))
        # Each digest counts one hold, whatever `digests` is: Counter.update would add a
        # mapping's values (a {digest: size} dict held each blob size times, never let go).
        self._digests.update(iter(digests))
        self._manifests.update(iter(manifests))
        if (len(self._digests), len(self._manifests)) != before:
            self.version += 1

    def drop(self, digests: Iterable[Digest] = (), manifests: Iterable[Digest] = ()) -> None:
        before = (len(self._digests), len(self._manifests))
        for counter, items in ((self._digests, digests), (self._manifests, manifests)):
            for d in items:
                counter[d] -= 1
                if counter[d] <= 0:
                    del counter[d]
        if (len(self._digests), len(self._manifests)) != before:
            self.version += 1

    @property
    def digests(self) -> frozenset[Digest]:
        return frozenset(self._digests)

    def holds(self, digest: Digest) -> int:
        """How many holds of this process's callers are on `digest`."""
        return self._digests[digest]

    def mine(self, lease: Lease) -> bool:
        """Whether `lease` (as read from disk) is this one."""
        return lease.path == self.path

    def snapshot(self) -> tuple[int, bytes]:
        """The version and the bytes to write; take them on the owner's side of a thread hop."""
        body = {
            "version": LEASE_VERSION,
            "host": self.host,
            "pid": self.pid,
            "purpose": self.purpose,
            "ttl": self.ttl,
            "digests": sorted(str(d) for d in self._digests),
            "manifests": sorted(str(d) for d in self._manifests),
        }
        return self.version, json.dumps(body, indent=0).encode()

    def write(self, snapshot: tuple[int, bytes] | None = None) -> None:
        """Put the lease on disk whole (temp file + rename): a reader sees the old or the new."""
        version, body = snapshot or self.snapshot()
        # Fsynced: a lease zeroed by a power cut would stop every host's GC until removed.
        write_atomic(self.path, body, self.layout.root)
        self.written = max(self.written, version)

    def touch(self, snapshot: tuple[int, bytes] | None = None) -> None:
        """Heartbeat: the mtime says "alive". A lease removed under us is written again (from
        `snapshot` when called in a worker thread: the counts may change meanwhile)."""
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.write(snapshot)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.written = -1
