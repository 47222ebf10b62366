"""What `modelfs verify` reports: the store's state besides blob hashes, and the report itself.

    survey(index, referenced) -> Survey        missing, stray, misnamed, bad manifests, owners
    Report(...)                                 one run's findings; `.ok`, `.as_json()`

Kinds of findings, and whether they make the store "not whole" (exit status 1):

- corrupt: a blob whose sha256 is not its name (moved to quarantine)           — wrong
- unreadable: a blob that cannot be read (EIO, EACCES)                         — wrong
- missing: a manifest names a blob that is absent or has another size           — wrong
- bad manifest: a manifest that cannot be read or parsed                        — wrong
- orphaned: a blob no manifest names: `modelfs gc` reclaims it, unless GC keeps it for now
  (tag history, a live lease, younger than the grace; `gc_keeps` says which) — information
- stray: a file that is not a blob or a manifest (Ollama partials, .DS_Store,
  a `manifests-v2` link to a blob `ollama rm` deleted: a removed tag)          — information
- misnamed: `sha256:<hex>` (a copy from another OS); Ollama renames these
  itself at startup, and the fix is printed                                     — information
- changed: a blob modified or replaced while it was read (not judged)           — information
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelfs.store.collect.gc import history_roots
from modelfs.store.collect.reach import Reach
from modelfs.store.digest import Digest
from modelfs.store.errors import InvalidDigestError, StoreError
from modelfs.store.history import TagHistory
from modelfs.store.layout import Layout
from modelfs.store.leases import read_leases
from modelfs.store.names import Name
from modelfs.store.scan import STRAY_KINDS, Entry, StoreIndex, Variant
from modelfs.store.units import counted, format_duration

# -- what manifests say ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Owner:
    """A manifest that names a blob."""

    manifest: str  # path relative to the store root
    name: Name  # the tag, for a repository name to fetch the blob under
    label: str  # `gemma4:26b`, or `gemma4:26b@mlx` for a list's child


@dataclass(slots=True)
class Missing:
    digest: Digest
    size: int  # what the manifest says
    actual: int | None  # the size of the file there, None when absent
    owner: Owner
    found_as: str | None = None  # `blobs/sha256:<hex>`: present under a foreign name
    repaired: bool = False


@dataclass(slots=True)
class Misnamed:
    path: str  # relative to the store root
    size: int | None
    fix: str  # a shell command, run in the store root


@dataclass(slots=True)
class Survey:
    missing: list[Missing] = field(default_factory=list)
    stray: list[tuple[str, int | None, str]] = field(default_factory=list)  # path, size, why
    misnamed: list[Misnamed] = field(default_factory=list)
    bad_manifests: list[tuple[str, str]] = field(default_factory=list)  # path, message
    referenced: set[str] = field(default_factory=set)  # blob names (`sha256-<hex>`)
    index: StoreIndex | None = None  # for `owners`
    rescan: Callable[[], StoreIndex] | None = None  # for `owners`, without an `index`

    def owners(self, digests: set[Digest]) -> dict[Digest, list[Owner]]:
        """The manifests that name each of `digests` (a few corrupt blobs: not worth a list
        for every blob of the store)."""
        out: dict[Digest, list[Owner]] = {}
        if digests and self.index is None and self.rescan is not None:
            self.index = self.rescan()
        if not digests or self.index is None:
            return out
        for entry, variant, owner in _owners(self.index):
            if variant is None:
                if entry.top.digest in digests:
                    out.setdefault(entry.top.digest, []).append(owner)
                continue
            manifest = variant.manifest
            if variant.from_list and manifest.digest in digests:
                out.setdefault(manifest.digest, []).append(owner)
            for digest in manifest.blob_sizes():
                if digest in digests:
                    out.setdefault(digest, []).append(owner)
        return out


def _owners(index: StoreIndex) -> Iterator[tuple[Entry, Variant | None, Owner]]:
    """Each entry (variant None, as its top manifest's owner), then each of its variants."""
    for entry in index.sorted_entries():
        yield entry, None, Owner(entry.rel, entry.name, entry.name.shortest)
        for variant in entry.variants:
            label = entry.name.shortest + (f"@{variant.runner}" if variant.from_list else "")
            yield entry, variant, Owner(entry.rel, entry.name, label)


def _lsize(root: Path, rel: str) -> int | None:
    try:
        st = os.lstat(root / rel)
    except OSError:
        return None
    return None if st.st_mode & 0o170000 == 0o040000 else st.st_size


def misnamed_fix(root: Path, rel: str) -> str:
    """The command that gives a foreign-named blob Ollama's name (run in the store root)."""
    name = rel.rsplit("/", 1)[-1]
    try:
        canonical = Digest.parse(name).blob_name
    except InvalidDigestError:
        return f"# not a digest: inspect {shlex.quote(rel)}"
    # `name` matched the digest pattern, so it holds no quote: plain single quotes are safe.
    if (root / "blobs" / canonical).exists():
        # Both spellings present: the canonical one is what Ollama uses (verify checks it).
        return f"rm '{rel}'"
    return f"mv '{rel}' blobs/{canonical}"


def survey(index: StoreIndex, reach: Reach) -> Survey:
    """What the scan and the reachability walk (shared with GC) say, besides blob hashes."""
    root = index.layout.root
    out = Survey(referenced=reach.blob_names, index=index)
    foreign: dict[Digest, str] = {}
    # A stray in the manifests trees is told in GC's words (the walk that GC shares knows
    # whether it held a manifest).
    words = {p.path: p.message for p in reach.strays}
    for problem in index.problems:
        if problem.kind == "foreign-blob":
            out.misnamed.append(
                Misnamed(problem.path, _lsize(root, problem.path), misnamed_fix(root, problem.path))
            )
            with contextlib.suppress(InvalidDigestError):
                foreign[Digest.parse(problem.path.rsplit("/", 1)[-1])] = problem.path
        elif problem.kind in STRAY_KINDS:
            message = words.get(problem.path, problem.message)
            out.stray.append((problem.path, _lsize(root, problem.path), message))
        elif problem.kind == "bad-manifest":
            out.bad_manifests.append((problem.path, problem.message))
    # The reachability walk reads every manifest file, also legacy files a v2 tag hides: one of
    # those that cannot be read is a broken manifest too (one the scan calls a stray, such as
    # a `.DS_Store` where a tag would be, stays a stray: it is no lost model).
    known = {path for path, _ in out.bad_manifests} | {path for path, _, _ in out.stray}
    for problem in reach.strays:  # in the words GC reports them with
        if problem.path not in known:
            known.add(problem.path)
            out.stray.append((problem.path, _lsize(root, problem.path), problem.message))
    for problem in reach.unreadable:
        if problem.path not in known:
            known.add(problem.path)
            out.bad_manifests.append((problem.path, problem.message))

    # The scan checked each tag's blobs by the same sizes (a warm scan recalls what it found
    # while blobs/ is unchanged): only a tag it found lacking is looked into, for what and
    # whose (a store of thousands of blobs has no time for a Layer object of each).
    lacking = {p.path for p in index.problems if p.kind == "missing-blob"}
    seen: set[tuple[Digest, str]] = set()
    for entry, variant, owner in _owners(index):
        if variant is None or entry.rel not in lacking:
            continue
        sizes = variant.manifest.blob_sizes()
        for digest in sizes:
            # Sizes as the scan index keeps them while blobs/ is as it listed it (no stat a
            # blob): verify reads every blob's own size and bytes itself.
            size = index.blob_size(digest)
            if size != sizes[digest] and (digest, entry.rel) not in seen:
                seen.add((digest, entry.rel))
                out.missing.append(
                    Missing(
                        digest,
                        sizes[digest],
                        size,
                        owner,
                        found_as=foreign.get(digest),
                    )
                )
    return out


# -- the survey again, while what it was made of stays --------------------------------------------
SURVEY_FORMAT = 1


def survey_mark(
    listed: tuple[int, int, int] | None,
    files: Mapping[str, tuple[tuple[int, ...], tuple[str, ...]]],
    reach: Reach,
) -> str | None:
    """What a survey is made of, as one digest: blobs/'s (inode, mtime_ns, ctime_ns) (its names,
    and the sizes the scan index trusts while it stays), the stamp of every tag file (the reach
    index's, `files`: what is in a tag file stays while its stamp does, as the scan index has
    it too), and what the reach walk found wrong. None when some of it is not known to stay:
    blobs/ changed within the racy margin, or a tag file the reach index does not keep (too
    new to, a list, one that cannot be read or has no tag's name)."""
    if listed is None or len(files) != reach.tags:
        return None
    problems = [(p.kind, p.path, p.message) for p in (*reach.strays, *reach.unreadable)]
    problems += [(p.kind, p.path, p.message) for p in reach.removed]
    made_of = (SURVEY_FORMAT, listed, sorted((p, k) for p, (k, _) in files.items()), problems)
    return hashlib.sha256(repr(made_of).encode()).hexdigest()


def survey_text(found: Survey) -> str:
    """What `survey_again` makes the same Survey of (sizes aside: they are looked at again)."""
    return json.dumps(
        {
            "missing": [
                [
                    m.digest.hex,
                    m.size,
                    m.actual,
                    m.owner.manifest,
                    [m.owner.name.host, m.owner.name.namespace, m.owner.name.model],
                    m.owner.name.tag,
                    m.owner.label,
                    m.found_as,
                ]
                for m in found.missing
            ],
            "stray": [[path, why] for path, _, why in found.stray],
            "misnamed": [[m.path, m.fix] for m in found.misnamed],
            "bad_manifests": [[path, message] for path, message in found.bad_manifests],
        },
        separators=(",", ":"),
    )


def survey_again(
    text: str, layout: Layout, reach: Reach, rescan: Callable[[], StoreIndex]
) -> Survey | None:
    """The Survey `survey_text` wrote, with what `reach` keeps, the sizes of the strays and
    misnamed files as they are now, and `rescan` for the owners of a corrupt blob; None if
    `text` is not one."""
    root = layout.root
    try:
        doc = json.loads(text)
        out = Survey(referenced=reach.blob_names, rescan=rescan)
        for hex_, size, actual, manifest, (host, ns, model), tag, label, found_as in doc["missing"]:
            owner = Owner(manifest, Name.from_parts(host, ns, model, tag), label)
            out.missing.append(Missing(Digest(hex_), size, actual, owner, found_as))
        out.stray = [(path, _lsize(root, path), why) for path, why in doc["stray"]]
        out.misnamed = [Misnamed(path, _lsize(root, path), fix) for path, fix in doc["misnamed"]]
        out.bad_manifests = [(path, message) for path, message in doc["bad_manifests"]]
    except (ValueError, KeyError, TypeError, StoreError):
        return None
    return out


# -- the report --------------------------------------------------------------------------------
@dataclass(slots=True)
class Corrupt:
    name: str  # sha256-<hex>
    size: int
    actual: str  # the sha256 its bytes have
    owners: list[Owner]
    quarantined: str | None = None  # where it went, relative to the store root
    error: str | None = None  # why it could not be moved
    repaired: bool = False


@dataclass(slots=True)
class Repair:
    digest: Digest
    size: int
    ok: bool
    detail: str  # the peer it came from, or why it could not be fetched
    dropped: list[str] = field(default_factory=list)  # quarantined copies removed


@dataclass(slots=True)
class Report:
    root: Path
    mode: str  # "full" | "quick"
    blobs: int = 0
    bytes: int = 0  # bytes of the blobs checked
    bytes_read: int = 0
    sha256: int = 0  # blobs whose sha256 was computed
    xxh3_only: int = 0  # blobs a quick check passed without sha256 (stamp, and sample if large)
    seconds: float = 0.0
    corrupt: list[Corrupt] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # blob name, why
    changed: list[str] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    orphaned: list[tuple[str, int]] = field(default_factory=list)  # blob name, size
    kept: dict[str, str] = field(default_factory=dict)  # orphan -> why GC keeps it for now
    stray: list[tuple[str, int | None, str]] = field(default_factory=list)
    misnamed: list[Misnamed] = field(default_factory=list)
    bad_manifests: list[tuple[str, str]] = field(default_factory=list)
    quarantine: list[tuple[str, int]] = field(default_factory=list)  # in quarantine afterwards
    repairs: list[Repair] = field(default_factory=list)
    cache_written: bool = True

    @property
    def orphaned_bytes(self) -> int:
        return sum(size for _, size in self.orphaned)

    @property
    def reclaimable(self) -> list[tuple[str, int]]:
        """The orphans GC will reclaim (after its second sighting), not the ones it keeps."""
        return [(n, s) for n, s in self.orphaned if n not in self.kept]

    @property
    def stray_bytes(self) -> int:
        return sum(size or 0 for _, size, _ in self.stray)

    @property
    def problems(self) -> list[str]:
        """What makes the store not whole, after any repair (empty: exit status 0)."""
        out = []
        if n := sum(not c.repaired for c in self.corrupt):
            out.append(f"{n} corrupt")
        if self.unreadable:
            out.append(f"{len(self.unreadable)} unreadable")
        if n := len({m.digest for m in self.missing if not m.repaired}):
            out.append(f"{n} missing")
        if self.bad_manifests:
            out.append(counted(len(self.bad_manifests), "bad manifest"))
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        def owner(o: Owner) -> dict[str, str]:
            return {"manifest": o.manifest, "name": o.label}

        return {
            "store": str(self.root),
            "mode": self.mode,
            "ok": self.ok,
            "problems": self.problems,
            "checked": {
                "blobs": self.blobs,
                "bytes": self.bytes,
                "bytes_read": self.bytes_read,
                "sha256": self.sha256,
                "xxh3_only": self.xxh3_only,
                "seconds": round(self.seconds, 3),
            },
            "corrupt": [
                {
                    "blob": f"blobs/{c.name}",
                    "digest": "sha256:" + c.name.removeprefix("sha256-"),
                    "size": c.size,
                    "actual": f"sha256:{c.actual}",
                    "quarantined": c.quarantined,
                    "error": c.error,
                    "repaired": c.repaired,
                    "manifests": [owner(o) for o in c.owners],
                }
                for c in self.corrupt
            ],
            "unreadable": [{"blob": f"blobs/{n}", "error": why} for n, why in self.unreadable],
            "changed": [f"blobs/{n}" for n in self.changed],
            "missing": [
                {
                    "digest": str(m.digest),
                    "size": m.size,
                    "actual_size": m.actual,
                    "found_as": m.found_as,
                    "repaired": m.repaired,
                    **owner(m.owner),
                }
                for m in self.missing
            ],
            "orphaned": {
                "bytes": self.orphaned_bytes,
                "reclaimable_bytes": sum(s for _, s in self.reclaimable),
                "blobs": [
                    {"blob": f"blobs/{n}", "size": s, "kept": self.kept.get(n)}
                    for n, s in self.orphaned
                ],
            },
            "stray": {
                "bytes": self.stray_bytes,
                "files": [{"path": p, "size": s, "why": why} for p, s, why in self.stray],
            },
            "misnamed": [{"path": m.path, "size": m.size, "fix": m.fix} for m in self.misnamed],
            "bad_manifests": [{"path": p, "message": msg} for p, msg in self.bad_manifests],
            "quarantine": [
                {"path": f".modelfs/quarantine/{n}", "size": s} for n, s in self.quarantine
            ],
            "repairs": [
                {
                    "digest": str(r.digest),
                    "size": r.size,
                    "ok": r.ok,
                    "detail": r.detail,
                    "dropped_from_quarantine": r.dropped,
                }
                for r in self.repairs
            ],
            "cache_written": self.cache_written,
        }


def gc_keeps(
    layout: Layout, orphans: list[tuple[str, int]], now: float, grace: float
) -> dict[str, str]:
    """Why GC keeps each orphan it will not reclaim yet, by GC's own roots (store.gc): tag
    history (a replaced version within its retention), a live lease, or an mtime within
    `grace`. Orphans absent from the answer are GC's to reclaim."""
    history, _ = history_roots(layout, now)
    retention = ""
    if history:
        with contextlib.suppress(OSError, ValueError, StoreError):
            retention = f" for {format_duration(TagHistory(layout).retention())}"
    held: dict[str, str] = {}
    for lease in read_leases(layout, now).live:
        for d in lease.digests:
            held.setdefault(d.blob_name, f"a live {lease.purpose} lease of {lease.host}")
    out: dict[str, str] = {}
    for name, _ in orphans:
        if Digest(name.removeprefix("sha256-")) in history:
            out[name] = f"tag history keeps it{retention} (a version a tag moved away from)"
        elif name in held:
            out[name] = f"held by {held[name]}"
        else:
            try:
                age = now - os.stat(layout.blobs / name, follow_symlinks=False).st_mtime
            except OSError:
                continue
            if age < grace:
                out[name] = f"younger than GC's grace ({format_duration(grace)})"
    return out
