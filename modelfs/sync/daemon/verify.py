"""`modelfs verify`: every blob against its name, on every core, and repair from peers.

    await verify(layout, VerifyOptions(...)) -> Report
    run_verify(root, options) -> Report               under trio.run, for the CLI

1. List `blobs/` (name and stat stamp of each) and, for --quick, load the verify cache.
2. Check the blobs in worker processes, one per core (`store.collect.workers`: a small blob
   costs Python time, not hashing time, and threads would take turns on the GIL), each large
   blob alone and small ones in batches, largest first; meanwhile this process scans the
   store (manifests, what they name, strays, misnamed blobs). Full: sha256 of every blob.
   Quick: a blob whose stamp (inode, size, mtime, ctime) matches the cache passes, after the
   xxh3 of a sample of it matches too for one of 1 MiB or more; the others get a full check.
3. The worker that finds a blob corrupt moves it to `.modelfs/quarantine/` by rename at once.
   Out of `blobs/`, it is no longer served: the mount rebuilds its tree when `blobs/` changes
   and lists no file whose blob is missing, and `modelfs serve` opens blobs only from `blobs/`.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from modelfs.store.collect.gc import GcPolicy
from modelfs.store.collect.reach import reachable
from modelfs.store.collect.verify import (
    SAMPLE_PIECE,
    SAMPLE_PIECES,
    Batch,
    BlobCheck,
    CacheEntry,
    Stamp,
    VerifyCache,
    drop_quarantined,
    quarantined,
    stamp_of,
)
from modelfs.store.collect.verify_report import (
    Corrupt,
    Owner,
    Repair,
    Report,
    Survey,
    gc_keeps,
    survey,
)
from modelfs.store.collect.workers import Unit, Workers
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.layout import Layout
from modelfs.store.scan import ScanCache, scan_store
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


def _list_blobs(layout: Layout) -> list[tuple[str, Stamp]]:
    """(name, stat stamp) of every regular file under a canonical blob name, largest first."""
    out = []
    try:
        # Open, so that each entry's stat is by name in it, not a walk from the root.
        dir_fd = os.open(layout.blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(dir_fd) as it:
            for de in it:
                if is_blob_name(de.name) and de.is_file(follow_symlinks=False):
                    try:
                        out.append((de.name, stamp_of(de.stat(follow_symlinks=False))))
                    except OSError:
                        out.append((de.name, (0, 0, 0, 0)))  # its check will say why
    finally:
        os.close(dir_fd)
    out.sort(key=lambda item: -item[1][1])
    return out


BATCH_BYTES = 8 << 20  # small blobs go to a worker together, up to this many bytes…
BATCH_BLOBS = 512  # …or this many: a hand-off costs as much as checking a few small blobs


@dataclass(slots=True)
class Plan:
    """What to check: units for the workers (largest first), and the blobs a quick run
    passes on their stat stamp alone, with no read (their cache entries kept)."""

    units: list[Unit] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    kept_bytes: int = 0


def _plan(blobs: list[tuple[str, Stamp]], cache: VerifyCache, quick: bool) -> Plan:
    plan = Plan()
    stamps = cache.stamps if quick else {}
    names: list[str] = []
    cached: list[CacheEntry | None] = []
    size = 0

    def cut() -> None:
        nonlocal names, cached, size
        if names:
            plan.units.append((names, cached if quick else None))
            names, cached, size = [], [], 0

    for name, stamp in blobs:
        cost = stamp[1]
        entry = None
        if stamps.get(name) == stamp:
            entry = cache.get(name)
            if entry is None or entry.sample is None:
                plan.kept.append(name)
                plan.kept_bytes += cost
                continue
            cost = SAMPLE_PIECE * SAMPLE_PIECES
        if cost >= BATCH_BYTES:
            plan.units.append(([name], [entry] if quick else None))
            continue
        if names and (size + cost > BATCH_BYTES or len(names) >= BATCH_BLOBS):
            cut()
        names.append(name)
        cached.append(entry)
        size += cost
    cut()
    return plan


async def _check_all(pool: Workers, plan: Plan, total: tuple[int, int]) -> list[Batch]:
    """Wait for the workers (in a thread, so a scan can run meanwhile)."""
    stop = threading.Event()  # set by in_thread when we are cancelled (Ctrl-C)

    async def progress() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY)
            blobs, size = pool.progress()
            log.info(
                "verified %.1f of %.1f GB (%d of %d blobs)",
                (size + plan.kept_bytes) / 1e9,
                total[1] / 1e9,
                blobs + len(plan.kept),
                total[0],
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress)
        results = await in_thread(partial(pool.run, stop=stop.is_set), stop=stop)
        nursery.cancel_scope.cancel()
    return results


def _settle(
    layout: Layout,
    report: Report,
    plan: Plan,
    batches: list[Batch],
    cache: VerifyCache,
    found: Survey,
) -> None:
    """Fill the report from the checks (corrupt blobs already quarantined), update the cache."""
    new = VerifyCache(layout)
    for name in plan.kept:
        new.stamps[name] = cache.stamps[name]
        new.times[name] = cache.times[name]
    report.blobs = len(plan.kept) + sum(len(names) for names, _ in plan.units)
    report.xxh3_only = len(plan.kept)
    report.bytes = plan.kept_bytes
    problems: list[BlobCheck] = []
    for (names, _), batch in zip(plan.units, batches, strict=True):
        report.bytes += batch.bytes
        report.bytes_read += batch.bytes_read
        report.sha256 += batch.sha256
        report.xxh3_only += batch.xxh3_only
        passed = [(n, s) for n, s in zip(names, batch.stamps, strict=True) if s is not None]
        new.stamps.update(passed)
        new.times.update((n, batch.verified_at) for n, _ in passed)
        new.samples.update((names[i], sample) for i, sample in batch.samples.items())
        for i in batch.kept:
            name = names[i]
            new.times[name] = cache.times[name]
            if name in cache.samples:
                new.samples[name] = cache.samples[name]
        problems += batch.problems
    owners = found.owners(
        {Digest(c.name.removeprefix("sha256-")) for c in problems if c.status == "corrupt"}
    )
    for check in sorted(problems, key=lambda c: c.name):
        name = check.name
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
    if not new.same(cache):  # a quick run that found nothing new writes nothing
        report.cache_written = new.save()


async def verify(layout: Layout, options: VerifyOptions | None = None) -> Report:
    options = options or VerifyOptions()
    t0 = time.monotonic()
    mode = "quick" if options.quick else "full"
    report = Report(layout.root, mode)

    blobs = await trio.to_thread.run_sync(_list_blobs, layout)
    # A full run trusts nothing of the cache: it writes a new one.
    cache = (
        await trio.to_thread.run_sync(VerifyCache.load, layout)
        if options.quick
        else VerifyCache(layout)
    )
    total = (len(blobs), sum(stamp[1] for _, stamp in blobs))
    log.info(
        "verifying %d blobs (%s), %s, %d at a time",
        len(blobs),
        human_bytes(total[1]),
        "quick (stat stamps and samples against the last full check)"
        if options.quick
        else "full sha256",
        options.workers,
    )
    plan = _plan(blobs, cache, options.quick)
    found: list[Survey] = []

    async def look() -> None:
        # With the scan index, as `ls` scans: it says which models own which blobs, and this
        # run checks every blob's bytes itself, so nothing it trusts goes unchecked.
        index = await trio.to_thread.run_sync(lambda: scan_store(layout, ScanCache.open(layout)))
        reach = await trio.to_thread.run_sync(reachable, layout)
        found.append(survey(index, reach))

    # Forked here, before the scan's thread starts (a fork copies no other thread, and a lock
    # one held would stay held in the child), and they start at once; the scan runs meanwhile.
    with Workers(layout, plan.units, options.workers) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            batches = await _check_all(pool, plan, total)
    [survey_] = found
    await trio.to_thread.run_sync(_settle, layout, report, plan, batches, cache, survey_)

    corrupt = {c.name for c in report.corrupt}
    # A corrupt blob of the wrong size (truncated, zero-length) is fetched at the size its
    # manifests give, not its own.
    declared = {m.digest: m.size for m in survey_.missing}
    report.missing = [m for m in survey_.missing if m.digest.blob_name not in corrupt]
    referenced = survey_.referenced
    report.orphaned = [
        (name, stamp[1]) for name, stamp in blobs if name not in corrupt and name not in referenced
    ]
    # The default grace: a daemon's or `modelfs gc --grace` may differ.
    report.kept = await trio.to_thread.run_sync(
        gc_keeps, layout, report.orphaned, time.time(), GcPolicy().grace
    )
    report.stray = survey_.stray
    report.misnamed = survey_.misnamed
    report.bad_manifests = survey_.bad_manifests

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
