"""Tag history: what each name pointed at before, kept for `history_retention` (README,
"Tag history").

A built-in version of the watcher users write by hand ("copy each model before a re-pull and
delete the copy after a week"): every time a name's manifest digest changes here, the change
is recorded, the previous manifest is saved, and the previous version's blobs are GC roots for
the retention, so `modelfs diff NAME` can say what changed and `modelfs gc` (any host's) leaves
the old version alone meanwhile.

Files, all under `<store>/.modelfs/history/` (ours; Ollama never looks there):

    log.jsonl                  one JSON object a line, appended:
                               {"name": "<host>/<ns>/<model>:<tag>", "old": "sha256:…"|null,
                                "new": "sha256:…"|null, "time": <unix seconds>, "host": "…"}
                               old=null: the name appeared; new=null: it was removed
    manifests/sha256-<hex>     manifest bytes by digest: the current manifest of every tag (and
                               the present children of a list), so that when a tag moves the old
                               bytes are here even if the tag was a legacy file that was
                               overwritten; pruned when neither current nor within retention
    configs/sha256-<hex>       the config blobs of those manifests (a few hundred bytes each), so
                               a diff still knows the old version's format and file type after
                               Ollama pruned its blobs; pruned with them
    lock                       a store.lockfile.LockFile held while writing (several hosts may
                               share one store; O_APPEND is not atomic across NFS clients)

The log is the only state: the digest a name had "last time" is the `new` of its latest
record, so a change made while no daemon ran is seen at the next `observe`. The first
`observe` of a store records every tag as added. Crash safety: manifests are written to a temp
file, fsynced and renamed before the records that name them are appended; records are
appended with O_APPEND in one write and fsynced; a torn last line (a crash mid-write) is
ignored when read and fenced off by a newline before the next append; a record that repeats
the state (the same change seen twice, by two hosts or after a crash) is ignored when read.
`prune` rewrites the log through a temp file and a rename.

What history cannot do: when Ollama itself re-pulls a tag it deletes the old version's blobs
that no other manifest uses (unless `OLLAMA_NOPRUNE` is set), and `ollama rm` deletes them
always. Our roots cannot stop Ollama's own deletion; they keep old blobs from *our* GC (the
daemon's and `modelfs gc`, on every host sharing the store), which covers changes made by
`modelfs pull`/`sync` and by Ollama with `OLLAMA_NOPRUNE=1`. After Ollama has pruned, the
history still has the old manifest (so `modelfs diff` can compare layers, sizes and media
types, and a peer can be asked for the old blobs by digest), but not its bytes.

Every method is synchronous and does blocking I/O: call it from a trio task through
`trio.to_thread.run_sync`. One TagHistory may be shared by threads (calls are serialized).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfs.store.blobs import fsync_dir
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.disk.fileio import open_binary
from modelfs.store.disk.owner import adopt, make_dirs, write_atomic
from modelfs.store.errors import InvalidDigestError, InvalidNameError, LockBusyError, StoreError
from modelfs.store.layout import Layout
from modelfs.store.lockfile import LockFile, host_id
from modelfs.store.manifest import (
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestList,
    ModelConfig,
    parse_config,
    parse_manifest,
)
from modelfs.store.names import Name, name_from_path_parts, parse_name
from modelfs.store.scan import Entry, StoreIndex, read_limited

log = logging.getLogger(__name__)

LOG_NAME = "log.jsonl"
RETENTION_NAME = "retention.json"  # {"seconds": N}: what the daemon keeps, for every GC to read
DEFAULT_RETENTION = 7 * 86400.0
LOCK_STALE = 60.0  # a writer holds the lock for milliseconds; a minute without it is dead
TEMP_GRACE = 3600.0  # our own temp files older than this are leftovers of a crash


@dataclass(frozen=True, slots=True)
class Change:
    """One record of the log: `name` went from `old` to `new` at `time` (seen by `host`)."""

    name: Name
    old: Digest | None
    new: Digest | None
    time: float
    host: str = ""

    @property
    def kind(self) -> str:
        """`added`, `removed` or `changed`."""
        if self.old is None:
            return "added"
        if self.new is None:
            return "removed"
        return "changed"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name.full,
            "old": str(self.old) if self.old else None,
            "new": str(self.new) if self.new else None,
            "time": self.time,
            "host": self.host,
        }


@dataclass(frozen=True, slots=True)
class PruneResult:
    records_dropped: int
    manifests_removed: int


def _optional_digest(value: Any) -> Digest | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidDigestError(f"not a digest: {value!r}")
    return Digest.parse(value)


def parse_record(line: bytes) -> Change:
    """One log line; StoreError (or ValueError) when it is not a record."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise StoreError("not a history record")
    when = obj.get("time")
    if isinstance(when, bool) or not isinstance(when, int | float):
        raise StoreError("history record without a time")
    old, new = _optional_digest(obj.get("old")), _optional_digest(obj.get("new"))
    if old is None and new is None:
        raise StoreError("history record without a digest")
    host = obj.get("host")
    return Change(
        parse_name(obj["name"]), old, new, float(when), host if isinstance(host, str) else ""
    )


def _replay(records: Iterable[Change]) -> tuple[list[Change], dict[tuple[str, ...], Change]]:
    """The records that change something, in order, and the latest such record per name."""
    kept: list[Change] = []
    latest: dict[tuple[str, ...], Change] = {}
    for record in records:
        key = record.name.key
        last = latest.get(key)
        # What the name pointed at before this record: the previous record's word, or (its
        # earlier records pruned) this record's own `old`.
        before = last.new if last is not None else record.old
        if before == record.new:
            continue  # the state already says so: a repeat
        kept.append(record)
        latest[key] = record
    return kept, latest


def _entry_manifests(entry: Entry) -> Iterator[tuple[Digest, bytes]]:
    """The bytes a tag names: its manifest or list, and each present child of a list."""
    yield entry.top.digest, entry.top.raw
    for variant in entry.variants:
        if variant.from_list:
            yield variant.manifest.digest, variant.manifest.raw


def _unreadable_names(index: StoreIndex) -> tuple[set[tuple[str, ...]], bool]:
    """Names whose tag file exists but could not be read this time (not removed: perhaps
    half-written by Ollama or another host), and whether a manifests tree could not be listed
    at all (then nothing counts as removed)."""
    keys: set[tuple[str, ...]] = set()
    blind = False
    for problem in index.problems:
        parts = problem.path.split("/")
        if problem.message.startswith("cannot list") and parts[0] != "blobs":
            blind = True
        if problem.kind != "bad-manifest" or len(parts) != 5:
            continue
        if parts[0] not in ("manifests", "manifests-v2"):
            continue
        with contextlib.suppress(InvalidNameError):
            keys.add(name_from_path_parts(parts[1:], v2=parts[0] == "manifests-v2").key)
    return keys, blind


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class TagHistory:
    """The tag history of one store. See the module docstring for files and guarantees."""

    def __init__(
        self,
        store: Layout | str | os.PathLike[str],
        *,
        host: str | None = None,
        lock_wait: float = 5.0,
    ) -> None:
        self.layout = store if isinstance(store, Layout) else Layout(store)
        self.dir = self.layout.history
        self.log_path = self.dir / LOG_NAME
        self.manifests_dir = self.dir / "manifests"
        self.configs_dir = self.dir / "configs"
        self.host = host or host_id()
        self._lock: LockFile | None = None  # held by this thread, inside `_locked`
        self._lock_beat = 0.0
        self.lock_wait = lock_wait
        self._mutex = threading.Lock()
        self._parsed: dict[Digest, Manifest | ManifestList | None] = {}

    # -- the daemon's calls ------------------------------------------------------------------
    def observe(self, index: StoreIndex, now: float) -> list[Change]:
        """Compare every tag of `index` with the log; record and return what changed since
        the last observation (by anyone, on any host), saving the manifests it names."""
        with self._mutex, self._locked():
            _, latest = _replay(self.read_log())
            unreadable, blind = _unreadable_names(index)
            changes: list[Change] = []
            wanted: dict[Digest, bytes] = {}
            configs: set[Digest] = set()
            seen: set[tuple[str, ...]] = set()
            for entry in index:
                key = entry.name.key
                seen.add(key)
                wanted.update(_entry_manifests(entry))
                configs.update(
                    v.manifest.config.digest for v in entry.variants if v.manifest.config
                )
                last = latest.get(key)
                before = last.new if last else None
                if before != entry.digest:
                    changes.append(Change(entry.name, before, entry.digest, now, self.host))
            if not blind:
                for old_key, last in latest.items():
                    if last.new is not None and old_key not in seen and old_key not in unreadable:
                        changes.append(Change(last.name, last.new, None, now, self.host))
            # The manifests first, then the records naming them: a crash between the two
            # leaves files that the next observe or prune accounts for, never a dangling record.
            self._save(wanted)
            self._save_configs(configs)
            if changes:
                self._keep_lock(now=True)
                self._append(changes)
            return changes

    def exists(self) -> bool:
        return self.log_path.exists()

    def set_retention(self, seconds: float) -> None:
        """Record the retention, so a GC that does not know the daemon's config (`modelfs
        gc`, another host's timer) keeps the same versions."""
        path = self.dir / RETENTION_NAME
        body = json.dumps({"seconds": seconds}).encode()
        with contextlib.suppress(OSError):
            if path.read_bytes() == body:
                return
        make_dirs(self.dir, self.layout.root)
        self._write_file(path, body)

    def retention(self) -> float:
        """The recorded retention; the default when none is (ValueError when unreadable)."""
        try:
            seconds = json.loads((self.dir / RETENTION_NAME).read_bytes())["seconds"]
        except FileNotFoundError:
            return DEFAULT_RETENTION
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.dir / RETENTION_NAME}: unreadable ({exc})") from None
        if not isinstance(seconds, int | float) or seconds < 0:
            raise ValueError(f"{self.dir / RETENTION_NAME}: not a duration")
        return float(seconds)

    def roots(self, now: float, retention: float) -> set[Digest]:
        """Every digest a version superseded (changed or removed) less than `retention` ago
        needs: its manifest, config and layers, and for a list each child and its blobs.
        Put them in the daemon's lease (`LeaseKeeper.hold(digests=…)`)."""
        with self._mutex:
            records, _ = _replay(self.read_log())
            out: set[Digest] = set()
            for record in records:
                if record.old is not None and now - record.time < retention:
                    out.update(self._closure(record.old))
            return out

    def prune(self, now: float, retention: float) -> PruneResult:
        """Drop records older than `retention` (the latest record of a name that still
        exists stays: it is what the next observe compares with) and saved manifests that
        are neither current nor a version superseded within the retention."""
        with self._mutex, self._locked():
            lines = self._read_lines()
            records, latest = _replay(self._parse(lines))
            anchors = {id(r) for r in latest.values() if r.new is not None}
            keep = [r for r in records if now - r.time < retention or id(r) in anchors]
            if len(keep) != len(lines):
                self._keep_lock(now=True)
                self._rewrite(keep)
            wanted: set[Digest] = set()
            for record in latest.values():
                if record.new is not None:
                    wanted.update(self._closure(record.new))
            for record in keep:
                if record.old is not None and now - record.time < retention:
                    wanted.update(self._closure(record.old))
            removed = self._remove_saved_except(wanted, now)
            return PruneResult(len(lines) - len(keep), removed)

    # -- lookups (for `modelfs diff`) ------------------------------------------------------
    def read_log(self) -> list[Change]:
        """Every readable record, in the order written (repeats included)."""
        return self._parse(self._read_lines())

    def records(self, name: Name | str | None = None) -> list[Change]:
        """The records that changed something, oldest first; only `name`'s when given."""
        records, _ = _replay(self.read_log())
        if name is None:
            return records
        key = (parse_name(name) if isinstance(name, str) else name).key
        return [r for r in records if r.name.key == key]

    def previous(
        self, name: Name | str, current: Digest | None = None
    ) -> tuple[Digest, bytes] | None:
        """The version `name` had before `current` (default: before its latest record), with
        its manifest bytes; None when history knows none whose bytes are still kept.

        When the tag has moved since the last observation (`current` is not what the log says
        it is), the previous version is the one the log says."""
        records = self.records(name)
        candidates = [r.old for r in reversed(records)]
        if records and current is not None and records[-1].new != current:
            candidates.insert(0, records[-1].new)
        return self._first_loadable(d for d in candidates if d is not None and d != current)

    def before(self, digest: Digest) -> tuple[Digest, bytes] | None:
        """The version any name had before it became `digest`, with its bytes."""
        olds = [r.old for r in reversed(self.records()) if r.new == digest and r.old is not None]
        return self._first_loadable(olds)

    def manifest_bytes(self, digest: Digest) -> bytes | None:
        """A manifest's bytes from our saved copies, else from `blobs/`; checked against the
        digest. None when neither has it."""
        return self._small_file(digest, self.manifests_dir, MAX_MANIFEST_BYTES)

    def config(self, digest: Digest) -> ModelConfig | None:
        """A model config from `blobs/`, else from our saved copies; None if neither has it."""
        raw = self._small_file(digest, self.configs_dir, MAX_CONFIG_BYTES, blobs_first=True)
        if raw is None:
            return None
        try:
            return parse_config(raw, f"config {digest}")
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    def _small_file(
        self, digest: Digest, saved: Path, limit: int, *, blobs_first: bool = False
    ) -> bytes | None:
        paths = [saved / digest.blob_name, self.layout.blob(digest)]
        for path in reversed(paths) if blobs_first else paths:
            try:
                if os.stat(path).st_size > limit:
                    continue
                raw = read_limited(path, limit)
            except OSError:
                continue
            if Digest.of_bytes(raw) == digest:
                return raw
            log.warning("%s: bytes do not match the name", path)
        return None

    def saved(self) -> list[Digest]:
        """The digests of every saved manifest."""
        try:
            names = os.listdir(self.manifests_dir)
        except OSError:
            return []
        return [Digest(n[7:]) for n in names if is_blob_name(n)]

    # -- internals -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        make_dirs(self.dir, self.layout.root)
        lock = LockFile(
            self.dir / "lock", stale_after=LOCK_STALE, host=self.host, store=self.layout.root
        )
        deadline = time.monotonic() + self.lock_wait
        while True:
            try:
                lock.acquire()
                break
            except LockBusyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        self._lock, self._lock_beat = lock, time.monotonic()
        try:
            yield
        finally:
            self._lock = None
            lock.release()

    def _keep_lock(self, *, now: bool = False) -> None:
        """Refresh the lock during long writes (thousands of tags on NFS); LockLostError when
        another host judged us dead and took it, before we write anything more."""
        if self._lock is None:
            return
        if now or time.monotonic() - self._lock_beat > LOCK_STALE / 4:
            self._lock.refresh()
            self._lock_beat = time.monotonic()

    def _read_lines(self) -> list[bytes]:
        try:
            with open_binary(self.log_path) as f:
                data = f.read()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        # The last piece is empty after a complete line, or a record torn by a crash.
        return [line for line in lines[:-1] if line.strip()]

    def _parse(self, lines: list[bytes]) -> list[Change]:
        records = []
        for n, line in enumerate(lines, 1):
            try:
                records.append(parse_record(line))
            except (ValueError, StoreError) as exc:
                log.warning("%s line %d: skipped (%s)", self.log_path, n, exc)
        return records

    def _append(self, changes: list[Change]) -> None:
        body = b"".join(json.dumps(c.as_json()).encode() + b"\n" for c in changes)
        created = not self.log_path.exists()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                with open_binary(self.log_path) as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        body = b"\n" + body  # fence off a line torn by a crash
            _write_all(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            adopt(self.log_path, self.layout.root)  # appended to by whichever user runs next
            fsync_dir(self.dir)

    def _rewrite(self, records: list[Change]) -> None:
        body = b"".join(json.dumps(c.as_json()).encode() + b"\n" for c in records)
        self._write_file(self.log_path, body)

    def _write_file(self, target: Path, data: bytes) -> None:
        self._keep_lock()
        write_atomic(target, data, self.layout.root, sync_dir=True)

    def _save(self, manifests: dict[Digest, bytes]) -> None:
        """Write each manifest not saved yet (a stat each: another host may have pruned)."""
        make_dirs(self.manifests_dir, self.layout.root)
        for digest, raw in manifests.items():
            path = self.manifests_dir / digest.blob_name
            if not path.exists():
                self._write_file(path, raw)

    def _save_configs(self, digests: set[Digest]) -> None:
        """Copy the config blobs not saved yet (absent or oversized ones are skipped)."""
        for digest in digests:
            path = self.configs_dir / digest.blob_name
            if path.exists():
                continue
            try:
                raw = read_limited(self.layout.blob(digest), MAX_CONFIG_BYTES)
            except OSError:
                continue
            if len(raw) <= MAX_CONFIG_BYTES and Digest.of_bytes(raw) == digest:
                make_dirs(self.configs_dir, self.layout.root)
                self._write_file(path, raw)

    def _load(self, digest: Digest) -> Manifest | ManifestList | None:
        if digest in self._parsed:
            return self._parsed[digest]
        raw = self.manifest_bytes(digest)
        if raw is None:
            return None  # not cached: it may be saved or pulled later
        try:
            parsed: Manifest | ManifestList | None = parse_manifest(raw, f"history {digest}")
        except StoreError as exc:
            log.warning("%s", exc)
            parsed = None
        self._parsed[digest] = parsed
        return parsed

    def _closure(self, digest: Digest) -> set[Digest]:
        """The digest, and what its manifest names (children of a list and their blobs)."""
        out = {digest}
        parsed = self._load(digest)
        if isinstance(parsed, ManifestList):
            for child in parsed.children:
                out.add(child.digest)
                manifest = child.inline or self._load(child.digest)
                if isinstance(manifest, Manifest):
                    out.update(manifest.blob_digests())
        elif parsed is not None:
            out.update(parsed.blob_digests())
        return out

    def _remove_saved_except(self, wanted: set[Digest], now: float) -> int:
        """Remove saved manifests and configs not in `wanted`; the number of manifests."""
        removed = self._remove_in(self.manifests_dir, wanted, now)
        self._remove_in(self.configs_dir, wanted, now)
        return removed

    def _remove_in(self, directory: Path, wanted: set[Digest], now: float) -> int:
        removed = 0
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return 0
        for name in names:
            path = directory / name
            if is_blob_name(name):
                digest = Digest(name[7:])
                if digest in wanted:
                    continue
                self._parsed.pop(digest, None)
            else:
                # A temp file of a writer that crashed (live writers hold the lock we hold).
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime < TEMP_GRACE:
                        continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += is_blob_name(name)
        return removed

    def _first_loadable(self, digests: Iterable[Digest]) -> tuple[Digest, bytes] | None:
        for digest in digests:
            raw = self.manifest_bytes(digest)
            if raw is not None:
                return digest, raw
        return None
