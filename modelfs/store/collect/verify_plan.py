"""What `modelfs verify` gives its workers, and what it makes of their answers.

    list_blobs(layout) -> Listing                  full: every name, and a stat of each blob
    full_units(blobs) -> list[Unit]                 every blob to hash, largest first
    list_names(layout, cache) -> (names, key)       quick: every name, listed or the cache's
    quick_units(names, key, cache) -> QuickPlan     runs of names to stat against the cache
    settle_full(...) / settle_quick(...)            the report's counts, and the cache to save

A full run stats every blob as it lists them (a unit's cost is its size: large blobs alone,
small ones in batches, largest first) and hashes each. A quick run only lists `blobs/`, and not
even that while the directory is as the cache's names were listed from: the workers stat the
names in runs (`Look`), compare each run's stamps with the cache's in one go, check the samples
of large blobs whose stamp matched, and return the blobs whose stamp did not; those get a full
check in a second round, planned as a full run's (by the sizes the stat gave). The cache keeps
its names in the order the listing gave them, so a directory not changed since lists the same,
and the cache's stamps line up with it as they are.

The cache written is in that order too, one column entry per name listed (0s for a name with
no entry: a stray, a blob that failed, or one changed within the racy margin).
"""

from __future__ import annotations

import array
import itertools
import os
import time
from dataclasses import dataclass, field

from modelfs.store.collect.verify import (
    NO_STAMP,
    Batch,
    BlobCheck,
    Look,
    Looked,
    Stamp,
    stamp_of,
)
from modelfs.store.collect.verify_cache import VerifyCache
from modelfs.store.collect.workers import Result, Unit
from modelfs.store.digest import is_blob_name
from modelfs.store.index.indexfile import DirKey, dir_key
from modelfs.store.layout import Layout

BATCH_BYTES = 8 << 20  # small blobs go to a worker together, up to this many bytes…
BATCH_BLOBS = 512  # …or this many: a hand-off costs as much as checking a few small blobs
# A quick run's runs of names: a stat costs ~2 us, so a run is a few ms of work, and a run
# holds at most LOOK_SAMPLES large blobs (each a sample read of up to 1 MiB).
LOOK_BLOBS = 1024
LOOK_SAMPLES = 8


@dataclass(slots=True)
class Listing:
    names: list[str]  # every name in blobs/, as listed (the cache's order)
    blobs: list[tuple[str, Stamp]]  # (name, lstat stamp) of each regular file under a blob name
    key: DirKey | None = None  # blobs/ when listed, out of the racy margin


def list_names(layout: Layout, cache: VerifyCache) -> tuple[list[str], DirKey | None]:
    """Every name in blobs/, as the directory lists them (none when there is no blobs/): the
    cache's names while blobs/ is as it was when they were listed, else a listing; and the key
    to know it by."""
    since = time.time_ns()
    try:
        st = os.stat(layout.blobs)
    except FileNotFoundError:
        return [], None
    key = dir_key(st, since)
    if key is not None and key == cache.listed:
        return cache.names, key
    return os.listdir(layout.blobs), key


def list_blobs(layout: Layout) -> Listing:
    """Every name in blobs/, and (name, stat stamp) of every regular file under a blob name."""
    out = Listing([], [])
    since = time.time_ns()
    try:
        # Open, so that each entry's stat is by name in it, not a walk from the root.
        dir_fd = os.open(layout.blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    try:
        out.key = dir_key(os.fstat(dir_fd), since)
        with os.scandir(dir_fd) as it:
            for de in it:
                out.names.append(de.name)
                if is_blob_name(de.name) and de.is_file(follow_symlinks=False):
                    try:
                        out.blobs.append((de.name, stamp_of(de.stat(follow_symlinks=False))))
                    except OSError:
                        out.blobs.append((de.name, NO_STAMP))  # its check will say why
    finally:
        os.close(dir_fd)
    return out


def full_units(blobs: list[tuple[str, Stamp]]) -> list[Unit]:
    """Every blob for a full check: a large one alone, small ones together, largest first."""
    units: list[Unit] = []
    names: list[str] = []
    size = 0
    for name, stamp in sorted(blobs, key=lambda item: -item[1][1]):
        cost = stamp[1]
        if cost >= BATCH_BYTES:
            units.append(([name], None))
            continue
        if names and (size + cost > BATCH_BYTES or len(names) >= BATCH_BLOBS):
            units.append((names, None))
            names, size = [], 0
        names.append(name)
        size += cost
    if names:
        units.append((names, None))
    return units


@dataclass(slots=True)
class QuickPlan:
    names: list[str]  # the listing
    key: DirKey | None  # blobs/ then
    flat: array.array[int]  # the cache's stamps by position in it (0s: no entry)
    at: array.array[int]  # the cache's check times, likewise
    looks: list[Look] = field(default_factory=list)  # runs of it, in order, covering it all
    starts: list[int] = field(default_factory=list)  # where each starts


def quick_units(names: list[str], key: DirKey | None, cache: VerifyCache) -> QuickPlan:
    flat, at = cache.aligned(names)
    plan = QuickPlan(names, key, flat, at)
    samples = cache.samples
    sampled: dict[int, str] = {}
    if samples:
        sampled = {i: samples[n] for i, n in enumerate(names) if n in samples}
    start, n = 0, len(names)
    while start < n:
        end = min(start + LOOK_BLOBS, n)
        these: dict[int, str] = {}
        if sampled:
            for i in range(start, end):
                if i in sampled:
                    these[i - start] = sampled[i]
                    if len(these) == LOOK_SAMPLES:
                        end = i + 1
                        break
        plan.looks.append(Look(names[start:end], flat[4 * start : 4 * end], these))
        plan.starts.append(start)
        start = end
    return plan


def expected_blobs(plan: QuickPlan) -> int:
    """The blobs among the names listed: those with a cache entry, and those without one
    under a blob name (the strays among them are not)."""
    inodes = plan.flat[0::4]
    none = inodes.count(0)
    if not none:
        return len(inodes)
    names = plan.names
    return (
        len(inodes)
        - none
        + sum(1 for i, ino in enumerate(inodes) if not ino and is_blob_name(names[i]))
    )


@dataclass(slots=True)
class Tally:
    """The counts of a run, and the checks that found something."""

    blobs: int = 0
    bytes: int = 0
    bytes_read: int = 0
    sha256: int = 0
    xxh3_only: int = 0
    problems: list[BlobCheck] = field(default_factory=list)

    def add(self, batch: Batch) -> None:
        self.bytes_read += batch.bytes_read
        self.sha256 += batch.sha256
        self.xxh3_only += batch.xxh3_only
        self.problems += batch.problems


def settle_full(
    layout: Layout, listing: Listing, units: list[Unit], results: list[Result]
) -> tuple[Tally, VerifyCache]:
    """The counts of a full run, and the cache it leaves: an entry for each blob that passed."""
    tally = Tally(blobs=len(listing.blobs))
    passed: dict[str, tuple[Stamp, int]] = {}
    samples: dict[str, str] = {}
    for unit, batch in zip(units, results, strict=True):
        assert isinstance(batch, Batch) and not isinstance(unit, Look)
        names = unit[0]
        tally.bytes += batch.bytes
        tally.add(batch)
        passed.update(
            (n, (s, batch.verified_at))
            for n, s in zip(names, batch.stamps, strict=True)
            if s is not None
        )
        samples.update((names[i], sample) for i, sample in batch.samples.items())
    none = (NO_STAMP, 0)
    rows = list(map(passed.get, listing.names, itertools.repeat(none)))
    flat = array.array("q", itertools.chain.from_iterable([stamp for stamp, _ in rows]))
    at = array.array("q", [when for _, when in rows])
    return tally, VerifyCache.of_columns(layout, listing.names, flat, at, samples, listing.key)


@dataclass(slots=True)
class Seen:
    """What a quick run's first round found: the stamps of every name listed, by position
    (0s where not a blob), and the blobs to check in full (position, stamp)."""

    stamps: array.array[int]
    changed: list[tuple[int, Stamp]] = field(default_factory=list)
    left: set[int] = field(default_factory=set)  # not regular files under blob names


def seen(plan: QuickPlan, looked: list[Result]) -> Seen:
    stamps: array.array[int] = array.array("q")
    out = Seen(stamps)
    for start, result in zip(plan.starts, looked, strict=True):
        assert isinstance(result, Looked)
        for i in result.changed:
            j = 4 * i
            a, b, c, d = result.stamps[j : j + 4]
            out.changed.append((start + i, (a, b, c, d)))
        out.left.update(start + i for i in result.left)
        stamps += result.stamps
    return out


def second_round(plan: QuickPlan, first: Seen) -> list[Unit]:
    """The blobs whose stamp differs from the cache's (or that have none), for a full check."""
    return full_units([(plan.names[i], stamp) for i, stamp in first.changed])


def settle_quick(
    layout: Layout,
    plan: QuickPlan,
    cache: VerifyCache,
    looked: list[Result],
    first: Seen,
    units: list[Unit],
    results: list[Result],
) -> tuple[Tally, VerifyCache]:
    """The counts of a quick run, and the cache it leaves: the entries of blobs whose stamp
    (and sample) matched as they were, new ones for the blobs checked in full that passed."""
    tally = Tally()
    flat = array.array("q", first.stamps)  # kept blobs: their stamps, as the cache's
    at = array.array("q", plan.at)
    samples: dict[str, str] = {}
    zero = array.array("q", NO_STAMP)
    for start, result in zip(plan.starts, looked, strict=True):
        assert isinstance(result, Looked)
        tally.blobs += result.blobs
        tally.bytes += result.bytes
        tally.xxh3_only += result.blobs - len(result.changed) - len(result.sampled_at)
        batch = result.sampled
        if batch is None:
            continue
        tally.add(batch)
        kept = set(batch.kept)
        for k, i in enumerate(result.sampled_at):
            pos = start + i
            name = plan.names[pos]
            if k in kept:
                samples[name] = cache.samples[name]
                continue
            stamp = batch.stamps[k]
            if stamp is None:
                flat[4 * pos : 4 * pos + 4] = zero
                at[pos] = 0
            else:
                flat[4 * pos : 4 * pos + 4] = array.array("q", stamp)
                at[pos] = batch.verified_at
                if k in batch.samples:
                    samples[name] = batch.samples[k]
    where: dict[str, int] = {}
    for pos, _ in first.changed:
        flat[4 * pos : 4 * pos + 4] = zero
        at[pos] = 0
        where[plan.names[pos]] = pos
    for unit, checked in zip(units, results, strict=True):
        assert isinstance(checked, Batch) and not isinstance(unit, Look)
        tally.add(checked)
        names = unit[0]
        for k, stamp in enumerate(checked.stamps):
            if stamp is not None:
                pos = where[names[k]]
                flat[4 * pos : 4 * pos + 4] = array.array("q", stamp)
                at[pos] = checked.verified_at
                if k in checked.samples:
                    samples[names[k]] = checked.samples[k]
    return tally, VerifyCache.of_columns(layout, plan.names, flat, at, samples, plan.key)
