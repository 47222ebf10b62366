"""`modelfs verify` as text for a terminal (`--json` prints `Report.as_json()` instead)."""

from __future__ import annotations

from modelfs.store.collect.verify_report import Owner, Report
from modelfs.store.units import counted, human_bytes

LIST_AT_MOST = 20  # orphans and strays beyond this are summed, not listed


def _names(owners: list[Owner]) -> str:
    labels = list(dict.fromkeys(o.label for o in owners))
    if not labels:
        return "no manifest names it"
    more = f" and {len(labels) - 3} more" if len(labels) > 3 else ""
    return "named by " + ", ".join(labels[:3]) + more


def render(report: Report) -> str:
    out: list[str] = []
    how = (
        f"{report.sha256} by sha256, {report.xxh3_only} unchanged since the last full check"
        if report.mode == "quick"
        else "sha256 of each"
    )
    out.append(
        f"checked {report.blobs} blobs ({human_bytes(report.bytes)}) in {report.seconds:.1f} s, "
        f"{report.mode}: {how}"
    )
    for c in report.corrupt:
        where = f"moved to {c.quarantined}" if c.quarantined else (c.error or "")
        fixed = "; repaired" if c.repaired else ""
        out.append(
            f"CORRUPT     blobs/{c.name}  {human_bytes(c.size)}  its bytes hash to "
            f"sha256:{c.actual[:12]}…; {_names(c.owners)}; {where}{fixed}"
        )
    for name, why in report.unreadable:
        out.append(f"UNREADABLE  blobs/{name}: {why}")
    for m in report.missing:
        what = "absent" if m.actual is None else f"{m.actual} bytes, the manifest says {m.size}"
        also = f"; present as {m.found_as} (see MISNAMED)" if m.found_as else ""
        fixed = "; repaired" if m.repaired else ""
        out.append(
            f"MISSING     {m.digest} ({human_bytes(m.size)}) for {m.owner.label} "
            f"({m.owner.manifest}): {what}{also}{fixed}"
        )
    for path, message in report.bad_manifests:
        out.append(f"BAD MANIFEST {path}: {message}")
    for r in report.repairs:
        if not r.ok:
            out.append(f"NOT REPAIRED {r.digest}: {r.detail}")
    for name in report.changed:
        out.append(f"CHANGED     blobs/{name} changed while it was read; not judged (run again)")
    if report.orphaned:
        reclaim = report.reclaimable
        kept = len(report.orphaned) - len(reclaim)
        out.append(
            f"ORPHANED    {counted(len(report.orphaned), 'blob')}, "
            f"{human_bytes(report.orphaned_bytes)}, "
            f"named by no manifest: `modelfs gc` reclaims {len(reclaim)} "
            f"({human_bytes(sum(s for _, s in reclaim))}), keeps {kept} for now (why, below)"
            + ("; some may belong to the bad manifests above" if report.bad_manifests else "")
        )
        for name, size in report.orphaned[:LIST_AT_MOST]:
            kept_why = report.kept.get(name)
            out.append(
                f"              blobs/{name}  {human_bytes(size)}"
                + (f"  kept: {kept_why}" if kept_why else "")
            )
        if len(report.orphaned) > LIST_AT_MOST:
            out.append(f"              … and {len(report.orphaned) - LIST_AT_MOST} more (--json)")
            groups: dict[str, list[int]] = {}
            for name, size in report.orphaned:
                if name in report.kept:
                    groups.setdefault(report.kept[name], []).append(size)
            for why, sizes in groups.items():  # every reason, where not all are listed
                out.append(f"              kept: {len(sizes)} ({human_bytes(sum(sizes))}): {why}")
    if report.stray:
        out.append(
            f"STRAY       {counted(len(report.stray), 'file')}, {human_bytes(report.stray_bytes)}, "
            "neither blobs nor manifests (left alone)"
        )
        for path, stray_size, stray_why in report.stray[:LIST_AT_MOST]:
            shown = "" if stray_size is None else f"  {human_bytes(stray_size)}"
            out.append(f"              {path}{shown}: {stray_why}")
        if len(report.stray) > LIST_AT_MOST:
            out.append(f"              … and {len(report.stray) - LIST_AT_MOST} more (--json)")
    for mis in report.misnamed:
        out.append(
            f"MISNAMED    {mis.path}: copied from another OS; Ollama's name for it is sha256-…; "
            f"fix, in {report.root}:  {mis.fix}"
        )
    if report.quarantine:
        total = sum(size for _, size in report.quarantine)
        out.append(
            f"QUARANTINE  {counted(len(report.quarantine), 'file')}, {human_bytes(total)}, in "
            f"{report.root}/.modelfs/quarantine (never served; delete them when done)"
        )
    if not report.cache_written:
        out.append("note: the verify cache could not be written (see the log)")
    if report.ok:
        repaired = sum(r.ok for r in report.repairs)
        out.append(
            "ok: every blob matches its name and every manifest is whole"
            + (f" ({repaired} repaired)" if repaired else "")
        )
    else:
        hint = "" if report.repairs else "; `--repair-from URL` fetches good copies from a peer"
        out.append("NOT OK: " + ", ".join(report.problems) + hint)
    return "\n".join(out)
