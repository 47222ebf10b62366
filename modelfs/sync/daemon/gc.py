"""The GC runner: one pass of `store.gc` under the cross-host GC lock, for `modelfs gc` and
the daemon's schedule.

The lock's heartbeat runs beside the work; if it cannot be refreshed (the file vanished, another
host took it over, the store went read-only), the work is cancelled at the next batch boundary
and the run reports itself aborted. Steps run in small batches in a worker thread, and the lock
is re-checked before each batch, so no batch starts under a lock we no longer hold.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from modelfs.runtime.groups import unwrapped
from modelfs.store.collect.gc import (
    FileItem,
    GcPlan,
    GcPolicy,
    delete_file,
    leases_and_reach,
    move_to_trash,
    plan_gc,
    put_back,
    remove_empty_dirs,
    save_first_seen,
    trash_stamp,
)
from modelfs.store.layout import Layout
from modelfs.store.lockfile import LockFile, host_id
from modelfs.store.scan import Problem
from modelfs.store.units import counted

log = logging.getLogger(__name__)

BATCH = 64  # steps between two checks of the lock
# Seconds a fresh look at manifests and leases stays fresh enough for the next batch of moves:
# a look costs a read of every manifest, a batch of renames far less.
LOOK_EVERY = 1.0


def lock_file(layout: Layout, policy: GcPolicy, host: str | None = None) -> LockFile:
    return LockFile(
        layout.state / "gc.lock",
        stale_after=policy.lock_ttl,
        host=host,
        store=layout.root,
        purpose="gc",
    )


def _named(item: FileItem, names: set[str]) -> bool:
    """Whether `names` (blob file names) holds the blob `item` is."""
    return item.digest is not None and item.digest.blob_name in names


@dataclass
class GcReport:
    store: str
    host: str
    dry_run: bool
    policy: GcPolicy
    started: float = field(default_factory=time.time)
    finished: float = 0.0
    plan: GcPlan | None = None
    refused: list[Problem] = field(default_factory=list)
    aborted: str | None = None
    errors: list[str] = field(default_factory=list)  # steps the filesystem refused
    # What was done (in a dry run: what would be).
    trashed: list[FileItem] = field(default_factory=list)
    changed: list[FileItem] = field(default_factory=list)  # wanted again between plan and step
    temps: list[FileItem] = field(default_factory=list)
    purged: list[FileItem] = field(default_factory=list)
    restored: list[FileItem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused and self.aborted is None and not self.errors

    @property
    def bytes_trashed(self) -> int:
        return sum(i.size for i in self.trashed)

    @property
    def bytes_freed(self) -> int:
        return sum(i.size for i in (*self.temps, *self.purged))

    def take_plan(self, plan: GcPlan) -> None:
        self.plan = plan
        self.refused = list(plan.refused)
        if self.dry_run:  # what a real run would do, had it the lock now
            self.trashed, self.temps = plan.trash, plan.temps
            self.purged, self.restored = plan.purge, plan.restore

    def as_json(self) -> dict[str, Any]:
        def items(xs: Sequence[FileItem]) -> list[dict[str, Any]]:
            return [
                {"path": i.rel, "digest": str(i.digest) if i.digest else None, "size": i.size}
                for i in xs
            ]

        plan = self.plan or GcPlan(self.started, self.policy)
        return {
            "store": self.store,
            "host": self.host,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "refused": [{"path": p.path, "message": p.message} for p in self.refused],
            "strays": [{"path": p.path, "message": p.message} for p in plan.strays],
            "aborted": self.aborted,
            "errors": self.errors,
            "manifests": plan.manifests,
            "blobs": plan.blobs,
            "referenced": plan.referenced,
            "leases": {"live": plan.leases_live, "expired": plan.leases_expired},
            "trashed": items(self.trashed),
            "pending": items(plan.pending),
            "young": items(plan.young),
            "leased": items(plan.leased),
            "changed": items(self.changed),
            "temps_deleted": items(self.temps),
            "purged": items(self.purged),
            "restored": items(self.restored),
            "bytes_trashed": self.bytes_trashed,
            "bytes_freed": self.bytes_freed,
            "grace": self.policy.grace,
            "trash_retention": self.policy.trash_retention,
            "seconds": round(max(self.finished - self.started, 0.0), 3),
        }


class _Run:
    def __init__(self, layout: Layout, policy: GcPolicy, report: GcReport, lock: LockFile) -> None:
        self.layout = layout
        self.policy = policy
        self.report = report
        self.lock = lock
        self.trash_dir = layout.trash / f"{trash_stamp(time.time())}-{secrets.token_hex(4)}"
        self.work = trio.CancelScope()

    async def heartbeat(self) -> None:
        interval = max(min(self.policy.lock_ttl / 4, 30.0), 0.01)
        while True:
            await trio.sleep(interval)
            try:
                await trio.to_thread.run_sync(self.lock.refresh)
            except Exception as exc:
                self.lose(exc)
                return

    def lose(self, exc: BaseException) -> None:
        """Stop the work: nothing more may be deleted under a lock we may not hold."""
        if self.report.aborted is None:
            self.report.aborted = f"lost the GC lock ({exc}); stopped"
            log.error("gc: %s", self.report.aborted)
        self.work.cancel()

    async def collect(self) -> None:
        layout, policy, report = self.layout, self.policy, self.report
        plan = await trio.to_thread.run_sync(plan_gc, layout, policy)
        report.take_plan(plan)
        # Put-backs first, even when the plan is refused: a blob that something names must
        # be where it looks, and bringing it back can only keep more.
        await self.steps(plan.restore, lambda i: put_back(layout, i), report.restored)
        if plan.refused:
            await self.remove_emptied(report.restored)
            return
        # Then what needs no state and frees space (on a full disk, the state below may not
        # be writable): the trash past its retention, old temp files. A purge cannot be
        # undone, and the plan may have read reach from the reach index: it gets the same
        # fresh look as a move to trash (a blob named now is skipped, put back next run).
        await self.steps(plan.purge, delete_file, report.purged, look_first=True)
        if report.refused:  # the purge's look could not read a manifest or lease: stop here
            await self.remove_emptied(report.restored)
            return
        await self.steps(plan.temps, delete_file, report.temps)
        await self.remove_emptied([*report.purged, *report.restored])
        try:
            await trio.to_thread.run_sync(save_first_seen, layout, plan.first_seen)
        except OSError as exc:
            # Without the record, no second sighting can be trusted: move nothing this run.
            self.error(f"{layout.state / 'gc'}: {exc.strerror or exc}; nothing moved to trash")
            return
        grace = policy.grace
        await self.steps(
            plan.trash,
            lambda i: move_to_trash(layout, i, self.trash_dir, grace),
            report.trashed,
            look_first=True,
        )
        if report.trashed:
            await self.put_back_wanted()
            first_seen = dict(plan.first_seen)
            for item in report.trashed:
                first_seen.pop(item.path.name, None)
            try:
                await trio.to_thread.run_sync(save_first_seen, layout, first_seen)
            except OSError as exc:
                self.error(f"{layout.state / 'gc'}: {exc.strerror or exc}")

    async def wanted(self) -> set[str] | None:
        """The blob names manifests and live leases name now (a large store's 100,000, so
        names rather than Digests); None (and the run refused) when one of them cannot be
        read."""
        leases, reach = await trio.to_thread.run_sync(leases_and_reach, self.layout)
        if reach.unreadable or leases.unreadable:
            self.report.refused = [*reach.unreadable, *leases.unreadable]
            return None
        return reach.blob_names | {d.blob_name for d in leases.digests}

    async def put_back_wanted(self) -> None:
        """A pull or an open that wrote its lease after our look, and found the blob still
        there, must find it there: after moving, look again and put back what is wanted (or
        everything moved, if the look fails)."""
        wanted = await self.wanted()
        moved = self.report.trashed
        back = [i for i in moved if wanted is None or _named(i, wanted)]
        if not back:
            return
        in_trash = [replace(i, path=self.trash_dir / i.path.name) for i in back]
        done = await trio.to_thread.run_sync(lambda: [put_back(self.layout, i) for i in in_trash])
        returned = {i.digest for i, ok in zip(back, done, strict=True) if ok}
        self.report.trashed = [i for i in moved if i.digest not in returned]
        self.report.changed += [i for i in back if i.digest in returned]
        log.info("gc: %s wanted again while moving; put back", counted(len(returned), "blob"))

    async def remove_emptied(self, items: Sequence[FileItem]) -> None:
        emptied = {i.path.parent for i in items}
        await trio.to_thread.run_sync(remove_empty_dirs, sorted(emptied))

    def error(self, message: str) -> None:
        self.report.errors.append(message)
        log.error("gc: %s", message)

    def attempt_all(
        self, step: Callable[[FileItem], bool], items: Sequence[FileItem]
    ) -> list[bool | None]:
        return [self.attempt(step, i) for i in items]

    def attempt(self, step: Callable[[FileItem], bool], item: FileItem) -> bool | None:
        """One step: done, not done (it changed since the plan), or None (an error)."""
        try:
            return step(item)
        except OSError as exc:
            self.error(f"{item.rel}: {exc.strerror or exc}")
            return None

    async def steps(
        self,
        items: Sequence[FileItem],
        step: Callable[[FileItem], bool],
        done: list[FileItem],
        *,
        look_first: bool = False,
    ) -> None:
        """`step` on each item, in batches under a refreshed lock. With `look_first`, each
        batch starts with a fresh look at what manifests and leases name (another host may
        have written one since the plan, or since the last batch), and skips what they name;
        a look that cannot read them all ends the steps (the run is refused)."""
        wanted: set[str] | None = None
        looked = 0.0
        for start in range(0, len(items), BATCH):
            batch = items[start : start + BATCH]
            try:
                await trio.to_thread.run_sync(self.lock.refresh)
            except Exception as exc:
                self.lose(exc)
                await trio.lowlevel.checkpoint()  # raises Cancelled: the work scope is cancelled
            if look_first:
                if wanted is None or time.monotonic() - looked > LOOK_EVERY:
                    wanted = await self.wanted()
                    looked = time.monotonic()
                    if wanted is None:
                        return
                self.report.changed += [i for i in batch if _named(i, wanted)]
                batch = [i for i in batch if not _named(i, wanted)]
            results = await trio.to_thread.run_sync(self.attempt_all, step, batch)
            for item, acted in zip(batch, results, strict=True):
                if acted:
                    done.append(item)
                elif acted is not None:  # None: the error is in the report already
                    self.report.changed.append(item)


async def run_gc(
    layout: Layout,
    policy: GcPolicy | None = None,
    *,
    dry_run: bool = False,
    host: str | None = None,
) -> GcReport:
    """One GC pass. LockBusyError when another GC holds the lock; otherwise a report, whose
    `refused` or `aborted` says when it stopped short (then nothing, or only part, was done)."""
    policy = policy or GcPolicy()
    report = GcReport(str(layout.root), host or host_id(), dry_run, policy)
    if dry_run:
        # No lock: a dry run writes nothing (not even the reach index it reads), so it may
        # look while another GC runs.
        plan = await trio.to_thread.run_sync(lambda: plan_gc(layout, policy, save_index=False))
        report.take_plan(plan)
        report.finished = time.time()
        return report
    lock = lock_file(layout, policy, report.host)
    await trio.to_thread.run_sync(lock.acquire)
    run = _Run(layout, policy, report, lock)
    try:
        with unwrapped():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run.heartbeat)
                with run.work:
                    await run.collect()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(lock.release)
    report.finished = time.time()
    log.info(
        "gc: %s to trash, %d pending, %s, %d purged, %d restored%s",
        counted(len(report.trashed), "blob"),
        len(report.plan.pending) if report.plan else 0,
        counted(len(report.temps), "temp file"),
        len(report.purged),
        len(report.restored),
        "" if report.ok else " (stopped short)",
    )
    return report
