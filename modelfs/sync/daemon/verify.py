"""`modelfs verify`: every blob against its name, on every core, and repair from peers.

    await verify(layout, VerifyOptions(...)) -> Report
    run_verify(root, options) -> Report               under trio.run, for the CLI

1. Full: list `blobs/` with a stat of each blob. Quick: load the verify cache, and list
   `blobs/` unless it is as the cache's listing found it (store.collect.verify_plan).
2. Check the blobs in worker processes, one per core (`store.collect.workers`: a small blob
   costs Python time, not hashing time, and threads would take turns on the GIL); meanwhile
   this process surveys the store (manifests, what they name, strays, misnamed blobs; the last
   run's survey again while blobs/ and every tag file are as they were). Full: sha256 of every
   blob, each large one alone and small ones in batches, largest first. Quick: the workers
   stat the names in runs, and a blob whose stamp (inode, size, mtime, ctime) matches the
   cache passes, after the xxh3 of a sample of it matches too for one of 1 MiB or more; the
   others get a full check, in a second round.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from modelfs.store.collect.gc import GcPolicy
from modelfs.store.collect.reach import reachable
from modelfs.store.collect.verify import (
    BlobCheck,
    drop_quarantined,
    quarantined,
)
from modelfs.store.collect.verify_cache import VerifyCache
from modelfs.store.collect.verify_plan import (
    BATCH_BLOBS as BATCH_BLOBS,
)
from modelfs.store.collect.verify_plan import (
    QuickPlan,
    Tally,
    expected_blobs,
    full_units,
    list_blobs,
    list_names,
    quick_units,
    second_round,
    seen,
    settle_full,
    settle_quick,
)
from modelfs.store.collect.verify_report import (
    Corrupt,
    Owner,
    Repair,
    Report,
    Survey,
    gc_keeps,
    survey,
    survey_again,
    survey_mark,
    survey_text,
)
from modelfs.store.collect.workers import Result, Workers
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.index.indexfile import DirKey
from modelfs.store.index.reachcache import ReachCache
from modelfs.store.layout import Layout
from modelfs.store.scan import ScanCache, StoreIndex, scan_store
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


async def _run(pool: Workers, progress: tuple[int, int], total: tuple[int, int]) -> list[Result]:
    """Wait for the workers (in a thread, so a scan can run meanwhile); `progress`: the blobs
    and bytes done before them."""
    stop = threading.Event()  # set by in_thread when we are cancelled (Ctrl-C)

    async def progress_lines() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY)
            blobs, size = pool.progress()
            log.info(
                "verified %.1f of %.1f GB (%d of %d blobs)",
                (size + progress[1]) / 1e9,
                total[1] / 1e9,
                blobs + progress[0],
                total[0],
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress_lines)
        results = await in_thread(partial(pool.run, stop=stop.is_set), stop=stop)
        nursery.cancel_scope.cancel()
    return results


def _problems(layout: Layout, report: Report, problems: list[BlobCheck], found: Survey) -> None:
    """Fill the report from what the checks found (corrupt blobs already quarantined)."""
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


@dataclass(slots=True)
class _Found:
    survey: Survey
    kept: tuple[str, str] | None  # for the cache: its mark and text (None: not to be reused)
    unreferenced: set[str] = field(default_factory=set)  # of the names given, none names


def _look(
    layout: Layout,
    listed: DirKey | None,
    saved: tuple[str, str] | None,
    names: list[str] | None = None,
) -> _Found:
    """The store besides blob bytes: with the reach index, as a GC plan reads manifests, and
    with the scan index, as `ls` scans (which models own which blobs: this run checks every
    blob's bytes itself, so nothing it trusts goes unchecked). `saved`: the survey a run made
    before (a quick run's cache), taken again if what it was made of is as it was (blobs/ as
    listed then, every tag file's stamp): the scan would find the same. `names`: the listing,
    of which the names no manifest names are found here too, while the workers are busy."""
    cache = ReachCache.open(layout)
    reach = reachable(layout, cache=cache)
    cache.save(listed=False)
    unreferenced = set(names).difference(reach.blob_names) if names is not None else set()
    mark = survey_mark(listed, cache.files, reach)
    if mark is not None and saved is not None and saved[0] == mark:
        again = survey_again(saved[1], layout, reach, partial(_scan, layout))
        if again is not None:
            return _Found(again, saved, unreferenced)
    found = survey(_scan(layout), reach)
    return _Found(found, None if mark is None else (mark, survey_text(found)), unreferenced)


def _scan(layout: Layout) -> StoreIndex:
    return scan_store(layout, ScanCache.open(layout))


@dataclass(slots=True)
class _Checked:
    tally: Tally
    cache: VerifyCache | None  # to save (None: the cache on disk says it all)
    # The blobs (regular files under blob names) this run saw that no manifest names and
    # that are not in the set given, with their sizes.
    orphans: Callable[[set[str]], list[tuple[str, int]]]


async def _check_full(layout: Layout, options: VerifyOptions, found: list[_Found]) -> _Checked:
    listing = await trio.to_thread.run_sync(list_blobs, layout)
    total = (len(listing.blobs), sum(stamp[1] for _, stamp in listing.blobs))
    _starting(total, "full sha256", options)
    units = full_units(listing.blobs)
    # Forked here, before the scan's thread starts (a fork copies no other thread, and a lock
    # one held would stay held in the child), and they start at once; the scan runs meanwhile.
    with Workers(layout, units, options.workers) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_survey, layout, found, listing.key, None)
            results = await _run(pool, (0, 0), total)
    tally, cache = await trio.to_thread.run_sync(settle_full, layout, listing, units, results)

    def orphans(corrupt: set[str]) -> list[tuple[str, int]]:
        named = found[0].survey.referenced
        return [(n, s[1]) for n, s in listing.blobs if n not in named and n not in corrupt]

    cache.survey = found[0].kept
    return _Checked(tally, cache, orphans)


def _quick_plan(layout: Layout) -> tuple[VerifyCache, QuickPlan]:
    old = VerifyCache.load(layout)
    names, key = list_names(layout, old)
    return old, quick_units(names, key, old)


async def _check_quick(layout: Layout, options: VerifyOptions, found: list[_Found]) -> _Checked:
    old, plan = await trio.to_thread.run_sync(_quick_plan, layout)
    names, key = plan.names, plan.key
    # The workers stat the blobs: until then, what the cache knows of them says what to expect
    # (a new blob counts, its size not yet).
    total = (expected_blobs(plan), sum(plan.flat[1::4]))
    _starting(total, "quick (stat stamps and samples against the last full check)", options)
    with Workers(layout, plan.looks, options.workers) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_survey, layout, found, key, old.survey, names)
            looked = await _run(pool, (0, 0), total)
    first = seen(plan, looked)
    units = second_round(plan, first)
    results: list[Result] = []
    if units:
        log.debug("%s new or changed since the last full check", counted(len(units), "unit"))
        with Workers(layout, units, options.workers) as pool:
            results = await _run(pool, (len(names) - len(first.changed), 0), total)
    # A few columns, copied and patched: no thread for that.
    tally, cache = settle_quick(layout, plan, old, looked, first, units, results)

    def orphans(corrupt: set[str]) -> list[tuple[str, int]]:
        left = found[0].unreferenced.difference(corrupt)
        if not left:
            return []
        stamps, out = first.stamps, []
        for i, name in enumerate(names):
            if name in left and i not in first.left and is_blob_name(name):
                out.append((name, stamps[4 * i + 1]))
        return out

    cache.survey = found[0].kept
    return _Checked(tally, None if cache.same(old) else cache, orphans)


def _starting(total: tuple[int, int], how: str, options: VerifyOptions) -> None:
    log.info(
        "verifying %d blobs (%s), %s, %d at a time",
        total[0],
        human_bytes(total[1]),
        how,
        options.workers,
    )


async def _survey(
    layout: Layout,
    found: list[_Found],
    listed: DirKey | None,
    saved: tuple[str, str] | None,
    names: list[str] | None = None,
) -> None:
    found.append(await trio.to_thread.run_sync(_look, layout, listed, saved, names))


async def verify(layout: Layout, options: VerifyOptions | None = None) -> Report:
    options = options or VerifyOptions()
    t0 = time.monotonic()
    report = Report(layout.root, "quick" if options.quick else "full")
    found: list[_Found] = []
    # A full run trusts nothing of the cache: it writes a new one.
    checked = await (_check_quick if options.quick else _check_full)(layout, options, found)
    survey_ = found[0].survey
    tally = checked.tally
    report.blobs, report.bytes, report.bytes_read = tally.blobs, tally.bytes, tally.bytes_read
    report.sha256, report.xxh3_only = tally.sha256, tally.xxh3_only
    _problems(layout, report, tally.problems, survey_)
    if checked.cache is not None:  # a quick run that found nothing new writes nothing
        report.cache_written = await trio.to_thread.run_sync(checked.cache.save)

    corrupt = {c.name for c in report.corrupt}
    # A corrupt blob of the wrong size (truncated, zero-length) is fetched at the size its
    # manifests give, not its own.
    declared = {m.digest: m.size for m in survey_.missing}
    report.missing = [m for m in survey_.missing if m.digest.blob_name not in corrupt]
    # Largest first, as GC and `ls` show them.
    report.orphaned = sorted(checked.orphans(corrupt), key=lambda item: (-item[1], item[0]))
    if report.orphaned:
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
