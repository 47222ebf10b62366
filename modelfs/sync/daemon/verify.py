"""`modelfs verify`: every blob against its name, on every core, and repair from peers.

    await verify(layout, VerifyOptions(...)) -> Report
    run_verify(root, options) -> Report               under trio.run, for the CLI

1. Scan the store (manifests, what they name, strays, misnamed blobs) and load the verify cache.
2. Check every `blobs/sha256-<hex>`, one large blob (largest first) or a batch of small ones
   per worker thread (`trio.to_thread.run_sync` under a CapacityLimiter of `os.cpu_count()`;
   hashlib and xxhash release the GIL, so a full check runs sha256 on every core); the small
   batches one at a time, beside the large blobs from the start. Full:
   sha256 + xxh3 of every blob. Quick: xxh3 only for blobs whose inode, size and mtime match
   the cache (sha256 to confirm a mismatch), a full check for the others.
3. Move each corrupt blob to `.modelfs/quarantine/` by rename. Out of `blobs/`, it is no longer
   served: the mount rebuilds its tree when `blobs/` changes and lists no file whose blob is
   missing, and `modelfs serve` opens blobs only from `blobs/`.
4. Save the cache (atomically; a read-only store is verified all the same).
5. With `repair_from`: fetch every corrupt or missing blob that a manifest names from the peers,
   through `sync.pull.Puller` (hashed on arrival, fsynced, renamed into `blobs/`), under the
   repository of a manifest that names it. Once a verified copy is back, its quarantined copies
   are deleted (the bad bytes have no use: the report keeps their size and sha256).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from modelfs.store.collect.gc import GcPolicy
from modelfs.store.collect.reach import reachable
from modelfs.store.collect.verify import (
    BlobCheck,
    CacheEntry,
    Interrupted,
    VerifyCache,
    check_blob,
    drop_quarantined,
    quarantine_blob,
    quarantined,
)
from modelfs.store.collect.verify_report import Corrupt, Owner, Repair, Report, gc_keeps, survey
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.layout import Layout
from modelfs.store.scan import scan_store
from modelfs.store.units import counted, human_bytes
from modelfs.sync.client.credentials import Credentials
from modelfs.sync.client.threads import in_thread, run_unwrapped
from modelfs.sync.errors import SyncError

log = logging.getLogger(__name__)

PROGRESS_EVERY = 10.0  # seconds between progress lines on a long run


@dataclass(frozen=True)
class VerifyOptions:
    quick: bool = False
    repair_from: Sequence[str] = ()
    credentials: Credentials | None = None
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    read_timeout: float | None = None  # for --repair-from peers; None: pull's default


def _blobs_dir(layout: Layout) -> int:
    """blobs/, open: thousands of small blobs are each opened and stat'ed twice, and by
    name in an open directory the system need not walk the tree to it each time."""
    return os.open(layout.blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _list_blobs(layout: Layout) -> list[tuple[str, int]]:
    """(name, size) of every regular file under a canonical blob name, largest first."""
    out = []
    try:
        dir_fd = _blobs_dir(layout)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(dir_fd) as it:  # so each entry's stat is by name in blobs/, too
            for de in it:
                if is_blob_name(de.name) and de.is_file(follow_symlinks=False):
                    try:
                        out.append((de.name, de.stat(follow_symlinks=False).st_size))
                    except OSError:
                        out.append((de.name, 0))  # check_blob will say why
    finally:
        os.close(dir_fd)
    out.sort(key=lambda item: (-item[1], item[0]))
    return out


def _check_and_quarantine(
    layout: Layout,
    name: str,
    entry: CacheEntry | None,
    *,
    quick: bool,
    stop: Callable[[], bool],
    dir_fd: int | None,
) -> BlobCheck:
    """Check one blob; a corrupt one leaves blobs/ at once (not at the end of a run that may
    take hours, during which it would be served, and a good copy could be put in its place).
    By name in blobs/ open as `dir_fd`; by path without it."""
    path = name if dir_fd is not None else f"{layout.blobs}/{name}"
    check = check_blob(path, entry, quick=quick, stop=stop, dir_fd=dir_fd)
    if check.status == "corrupt":
        try:
            check.quarantined = quarantine_blob(layout, name, check.key)
        except OSError as exc:
            check.quarantine_error = f"not quarantined: {exc.strerror or exc}"
    return check


BATCH_BYTES = 8 << 20  # small blobs go to a thread together, up to this many bytes…
BATCH_BLOBS = 256  # …or this many: a thread hand-off costs as much as hashing a small blob


def _batches(blobs: list[tuple[str, int]]) -> tuple[list[list[str]], list[list[str]]]:
    """Blob names in work units, largest first: each large blob alone, and small ones
    together."""
    large: list[list[str]] = []
    small: list[list[str]] = []
    batch: list[str] = []
    size = 0
    for name, n in blobs:
        if n >= BATCH_BYTES:
            large.append([name])
            continue
        if batch and (size + n > BATCH_BYTES or len(batch) >= BATCH_BLOBS):
            small.append(batch)
            batch, size = [], 0
        batch.append(name)
        size += n
    if batch:
        small.append(batch)
    return large, small


def _check_batch(
    layout: Layout,
    names: list[str],
    entries: dict[str, CacheEntry],
    *,
    quick: bool,
    stop: Callable[[], bool],
) -> list[BlobCheck]:
    checks = []
    try:
        dir_fd: int | None = _blobs_dir(layout)
    except OSError:
        dir_fd = None  # each check then says what is wrong with its blob
    try:
        for name in names:
            if stop():
                raise Interrupted()
            entry = entries.get(name)
            checks.append(
                _check_and_quarantine(layout, name, entry, quick=quick, stop=stop, dir_fd=dir_fd)
            )
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return checks


async def _check_all(
    layout: Layout, blobs: list[tuple[str, int]], cache: VerifyCache, options: VerifyOptions
) -> dict[str, BlobCheck]:
    workers = max(1, options.workers)
    limiter = trio.CapacityLimiter(workers)
    results: dict[str, BlobCheck] = {}
    large, small = _batches(blobs)
    todo_large, todo_small = iter(large), iter(small)
    # Small blobs cost Python time (open, stat, a few objects), not hashing time, and two
    # threads checking them at once spend it fighting over the GIL: 2,000 of them took twice
    # as long on two threads as on one. So one thread at a time checks them, from the start,
    # beside the threads hashing large blobs (which hold the GIL only between chunks).
    small_lane = trio.Lock()
    total = sum(size for _, size in blobs)
    done = [0]

    async def check(names: list[str]) -> None:
        stop = threading.Event()  # set by in_thread when we are cancelled (Ctrl-C)
        async with limiter:
            checks = await in_thread(
                partial(_check_batch, layout, quick=options.quick, stop=stop.is_set),
                names,
                cache.entries,
                stop=stop,
            )
        for one in checks:
            results[one.name] = one
            done[0] += one.size

    async def worker(small_first: bool) -> None:
        for todo in (todo_small, todo_large) if small_first else (todo_large, todo_small):
            for names in todo:
                if todo is todo_small:
                    async with small_lane:
                        await check(names)
                else:
                    await check(names)

    async def progress() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY)
            log.info(
                "verified %.1f of %.1f GB (%d of %d blobs)",
                done[0] / 1e9,
                total / 1e9,
                len(results),
                len(blobs),
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress)
        async with trio.open_nursery() as lanes:
            for i in range(workers):
                lanes.start_soon(worker, i == 0)
        nursery.cancel_scope.cancel()
    return results


def _settle(
    layout: Layout,
    report: Report,
    checks: dict[str, BlobCheck],
    cache: VerifyCache,
    owners: dict[Digest, list[Owner]],
) -> None:
    """Quarantine the corrupt blobs, fill the report from the checks, update the cache."""
    entries = {}
    for name, check in sorted(checks.items()):
        report.blobs += 1
        report.bytes += check.size
        report.bytes_read += check.bytes_read
        report.sha256 += check.sha256_done
        report.xxh3_only += check.xxh3_only
        if check.entry is not None:
            entries[name] = check.entry
        if check.status == "unreadable":
            report.unreadable.append((name, check.error or "unreadable"))
        elif check.status == "changed":
            report.changed.append(name)
        elif check.status == "corrupt":
            digest = Digest(name.removeprefix("sha256-"))
            corrupt = Corrupt(name, check.size, check.actual or "", owners.get(digest, []))
            if check.quarantined is not None:
                corrupt.quarantined = str(check.quarantined.relative_to(layout.root))
                log.warning(
                    "blobs/%s is corrupt (sha256 %s); moved to %s",
                    name,
                    check.actual,
                    corrupt.quarantined,
                )
            else:
                corrupt.error = check.quarantine_error or "not quarantined"
                log.error("blobs/%s is corrupt; %s", name, corrupt.error)
            report.corrupt.append(corrupt)
    if entries != cache.entries:  # a quick run that found nothing new writes nothing
        cache.entries = entries
        report.cache_written = cache.save()


async def verify(layout: Layout, options: VerifyOptions | None = None) -> Report:
    options = options or VerifyOptions()
    t0 = time.monotonic()
    mode = "quick" if options.quick else "full"
    report = Report(layout.root, mode)

    index = await trio.to_thread.run_sync(scan_store, layout)
    reach = await trio.to_thread.run_sync(reachable, layout)
    found = survey(index, reach)
    blobs = await trio.to_thread.run_sync(_list_blobs, layout)
    cache = await trio.to_thread.run_sync(VerifyCache.load, layout)
    log.info(
        "verifying %d blobs (%s), %s, %d at a time",
        len(blobs),
        human_bytes(sum(s for _, s in blobs)),
        "quick (xxh3 where the cache allows)" if options.quick else "full sha256",
        options.workers,
    )
    checks = await _check_all(layout, blobs, cache, options)

    await trio.to_thread.run_sync(_settle, layout, report, checks, cache, found.owners)

    corrupt = {c.name for c in report.corrupt}
    # A corrupt blob of the wrong size (truncated, zero-length) is fetched at the size its
    # manifests give, not its own.
    declared = {m.digest: m.size for m in found.missing}
    report.missing = [m for m in found.missing if m.digest.blob_name not in corrupt]
    report.orphaned = [
        (name, size)
        for name, size in blobs
        if name not in corrupt and Digest(name.removeprefix("sha256-")) not in found.referenced
    ]
    # The default grace: a daemon's or `modelfs gc --grace` may differ.
    report.kept = await trio.to_thread.run_sync(
        gc_keeps, layout, report.orphaned, time.time(), GcPolicy().grace
    )
    report.stray = found.stray
    report.misnamed = found.misnamed
    report.bad_manifests = found.bad_manifests

    if options.repair_from:
        await _repair(layout, report, options, declared)
    report.quarantine = await trio.to_thread.run_sync(quarantined, layout)
    report.seconds = time.monotonic() - t0
    return report


async def _repair(
    layout: Layout, report: Report, options: VerifyOptions, declared: dict[Digest, int]
) -> None:
    """Fetch every corrupt or missing blob some manifest names, from the peers."""
    wanted: dict[Digest, tuple[int, Owner]] = {}
    for c in report.corrupt:
        digest = Digest(c.name.removeprefix("sha256-"))
        if c.owners and c.quarantined is not None:
            wanted.setdefault(digest, (declared.get(digest, c.size), c.owners[0]))
        elif not c.owners:
            log.info("blobs/%s: no manifest names it; nothing to fetch it for", c.name)
    for m in report.missing:
        wanted.setdefault(m.digest, (m.size, m.owner))
    if not wanted:
        return
    # Imported here: httpx and the pull machinery cost a tenth of a second at start.
    from modelfs.sync.pull.options import PullOptions
    from modelfs.sync.pull.puller import Puller, peer_clients, pull_lease

    log.info("fetching %s from %s", counted(len(wanted), "blob"), ", ".join(options.repair_from))
    pull = (
        PullOptions()
        if options.read_timeout is None
        else PullOptions(read_timeout=options.read_timeout)
    )
    repaired: set[Digest] = set()
    async with (
        peer_clients(options.repair_from, pull, options.credentials) as peers,
        pull_lease(layout) as lease,  # what is in flight, for a GC on any host to leave alone
    ):
        puller = Puller(layout, peers, pull, lease=lease)

        async def one(digest: Digest, size: int, owner: Owner) -> None:
            try:
                await puller.fetch_blob(owner.name, digest, size)
            except SyncError as exc:
                log.error("could not repair %s: %s", digest, exc)
                report.repairs.append(Repair(digest, size, False, str(exc)))
                return
            dropped = await trio.to_thread.run_sync(drop_quarantined, layout, digest.blob_name)
            log.info("repaired %s (%d bytes) for %s", digest, size, owner.label)
            report.repairs.append(Repair(digest, size, True, "fetched and verified", dropped))
            repaired.add(digest)

        async with trio.open_nursery() as nursery:
            for digest, (size, owner) in wanted.items():
                nursery.start_soon(one, digest, size, owner)
    report.repairs.sort(key=lambda r: r.digest)
    for c in report.corrupt:
        c.repaired = Digest(c.name.removeprefix("sha256-")) in repaired
    for m in report.missing:
        m.repaired = m.digest in repaired


def run_verify(root: Path, options: VerifyOptions | None = None) -> Report:
    async def main() -> Report:
        return await verify(Layout(root), options)

    return run_unwrapped(main)
