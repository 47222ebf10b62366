"""`modelfs gc` as text: what went, what waits, what was kept and why."""

from __future__ import annotations

from collections.abc import Sequence

from modelfs.store.collect.gc import FileItem, GcPlan
from modelfs.store.units import counted, format_duration, human_bytes
from modelfs.sync.daemon.gc import GcReport


def _total(items: Sequence[FileItem]) -> str:
    n = len(items)
    return f"{n} file{'s' if n != 1 else ''}, {human_bytes(sum(i.size for i in items))}"


def render_gc(report: GcReport) -> str:
    would = report.dry_run
    plan = report.plan or GcPlan(report.started, report.policy)
    lines = [
        f"gc of {report.store} on {report.host}{' (dry run: nothing changed)' if would else ''}: "
        f"{plan.manifests} manifests, {plan.blobs} blobs ({plan.referenced} referenced), "
        f"{counted(plan.leases_live, 'live lease')}, {plan.leases_expired} expired"
    ]
    if report.refused:
        lines.append("refused, nothing deleted; these cannot be read:")
        lines += [f"  {p.path}: {p.message}" for p in report.refused]
    if plan.strays:
        lines.append("stray files (kept; not models, GC goes on):")
        lines += [f"  {p.path}: {p.message}" for p in plan.strays]
    if report.aborted:
        lines.append(f"stopped: {report.aborted}")

    def section(title: str, items: Sequence[FileItem], *, each: bool = True) -> None:
        if not items:
            return
        lines.append(f"{title}: {_total(items)}")
        if each:
            lines.extend(f"  {i.rel}  {human_bytes(i.size)}" for i in items)

    retention = format_duration(report.policy.trash_retention)
    grace = format_duration(report.policy.grace)
    section(
        f"{'would move' if would else 'moved'} to trash (unlinked after {retention})",
        report.trashed,
    )
    section(
        f"unneeded, first seen (they go after a second run {grace} or more later)", plan.pending
    )
    section(f"unneeded but younger than {grace} (kept)", plan.young)
    section("unneeded but held by a live lease (kept)", plan.leased)
    section("changed since the plan, so kept", report.changed)
    section(f"{'would delete' if would else 'deleted'} old temp and partial files", report.temps)
    section(f"{'would empty' if would else 'emptied'} from the trash", report.purged)
    section(
        f"{'would restore' if would else 'restored'} from the trash (wanted again)", report.restored
    )
    verb = "would free" if would else "freed"
    lines.append(
        f"{verb} {human_bytes(report.bytes_freed)} now; "
        f"{human_bytes(report.bytes_trashed)} in the trash until it is emptied"
    )
    return "\n".join(lines)
