"""Garbage collection planning and its steps, safe on a directory shared by several hosts.

The GC invariants (docs/architecture.md lists each with the test that guards it), and
where each is kept:

1. reachable blobs are never candidates: `store.reach` reads every manifest in every form;
2. an unreadable manifest or lease makes the plan `refused`: a refused plan deletes and moves
   nothing (it only puts back what is known to be wanted);
3. a blob in a live lease is kept (`store.leases`, each lease by its own TTL);
4. nothing younger than `grace` (by mtime) is a candidate; temp and partial files, ours and
   Ollama's, go only when older than `partial_grace`; `grace` is at least GRACE_FLOOR unless
   the policy says otherwise out loud (`below_floor`);
5. one GC at a time: the runner (sync.gc) holds `.modelfs/gc.lock`, a store.lockfile.LockFile;
6. a blob goes only when two passes at least `grace` apart found it unreferenced (the first
   sighting is kept in `.modelfs/gc/state.json`), and then into `.modelfs/trash/<stamp>/`;
   the trash is emptied after `trash_retention`, and a trashed blob that is wanted again
   (a manifest, v2 link, list child or lease names it, and `blobs/` lacks it) is put back,
   before any other step; manifest blobs in the trash are read there, so a v2 link or list
   pointing into the trash keeps (and brings back) what it names;
7. a dry run computes the same plan and performs no step.

Planning reads; the step functions each do one rename or unlink and re-check what they can
just before, because another host may be writing while we plan: the runner lists manifests
and leases again before moving, and a move opens the blob first and compares its mtime,
ctime, size and inode with the plan's (an open makes an NFS client revalidate them).
"""

from __future__ import annotations

import calendar
import contextlib
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.collect.reach import Reach, reachable
from modelfs.store.collector import cycles_uncollected
from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.disk.owner import make_dirs, write_atomic
from modelfs.store.errors import StoreError
from modelfs.store.index.reachcache import ReachCache
from modelfs.store.layout import Layout
from modelfs.store.leases import LeaseSet, read_leases
from modelfs.store.scan import Problem
from modelfs.store.units import format_duration

log = logging.getLogger(__name__)

STATE_VERSION = 1

# Ollama's temp and partial files in blobs/ (ollama/ollama fb30760): `<blob>-partial`,
# `<blob>-partial-<N>` (server/download.go), `<blob>.tmp` (x/transfer), and the
# `sha256-<random digits>` of NewLayer's CreateTemp.
_OLLAMA_TEMP = re.compile(r"(sha256-[0-9a-f]{64})(-partial(-\d+)?|\.tmp)|sha256-\d{1,20}")
# Ours, in .modelfs/tmp: `pull-sha256-<hex>.{partial,json,lock}` and BlobStore's temp files.
_OUR_TEMP_DIGEST = re.compile(r"pull-(sha256-[0-9a-f]{64})\.")
# What store.disk.owner.write_atomic (and so every state file: leases, indexes, the verify
# cache, GC's own) writes before its rename: left by a kill -9 between the two.
_STATE_TEMP = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")
_TRASH_STAMP = re.compile(r"(\d{8}T\d{6}Z)")


# A network filesystem's client may hide another host's new manifest or lease from our
# listings for as long as it caches directories (sshfs: 20 s by default; NFS: acdirmax, 60 s),
# and show an old mtime for as long as it caches attributes. The grace is what keeps a blob
# through that (a pull gives its blobs fresh mtimes before it writes the manifest), so it
# never goes below this unless the caller says every host sees the store uncached.
GRACE_FLOOR = 600.0


def grace_problem(grace: float, below_floor: bool, override: str) -> str | None:
    """Why `grace` may not be used, or None; `override` is how the caller accepts the risk."""
    if grace >= GRACE_FLOOR or below_floor:
        return None
    return (
        f"a grace of {format_duration(grace)} is below the {format_duration(GRACE_FLOOR)} floor "
        "that outlasts network filesystems' client caches (a host whose cached view hides "
        "another host's new manifest could move that model's blobs to the trash); "
        f"{override} accepts that risk"
    )


@dataclass(frozen=True, slots=True)
class GcPolicy:
    grace: float = 3600.0
    partial_grace: float = 7 * 86400.0
    trash_retention: float = 86400.0
    lock_ttl: float = 600.0  # a GC lock without a heartbeat this long is stale
    below_floor: bool = False  # a grace under GRACE_FLOOR was asked for, risk and all

    def __post_init__(self) -> None:
        problem = grace_problem(self.grace, self.below_floor, "below_floor=True")
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True, slots=True)
class FileItem:
    """A file a step acts on: `path` absolute, `rel` relative to the store root."""

    path: Path
    rel: str
    size: int
    mtime: float
    digest: Digest | None = None
    ctime: float = 0.0  # changes with any touch, link or rename of the inode
    ino: int = 0


@dataclass
class GcPlan:
    now: float
    policy: GcPolicy
    refused: list[Problem] = field(default_factory=list)
    strays: list[Problem] = field(default_factory=list)  # reported and kept; GC goes on
    trash: list[FileItem] = field(default_factory=list)  # second sighting: to the trash now
    pending: list[FileItem] = field(default_factory=list)  # first sighting, or too recent
    young: list[FileItem] = field(default_factory=list)  # unreferenced but within grace
    leased: list[FileItem] = field(default_factory=list)  # unreferenced, kept by a lease
    temps: list[FileItem] = field(default_factory=list)  # old temp/partial files to delete
    temps_kept: list[FileItem] = field(default_factory=list)
    purge: list[FileItem] = field(default_factory=list)  # trash past retention: unlink
    restore: list[FileItem] = field(default_factory=list)  # trashed but wanted again
    first_seen: dict[str, float] = field(default_factory=dict)  # the next state
    blobs: int = 0
    referenced: int = 0
    manifests: int = 0
    leases_live: int = 0
    leases_expired: int = 0

    @property
    def steps(self) -> int:
        return len(self.trash) + len(self.temps) + len(self.purge) + len(self.restore)


def _stat(path: str | Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _item(
    directory: Path, name: str, rel: str, st: os.stat_result, digest: Digest | None
) -> FileItem:
    # `directory / name`: a Path from a parsed one costs half a whole path's parsing, and a
    # plan over a large store makes thousands.
    path = directory / name
    return FileItem(path, rel, st.st_size, st.st_mtime, digest, st.st_ctime, st.st_ino)


def trash_stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def _stamp_time(name: str) -> float | None:
    m = _TRASH_STAMP.match(name)
    if m is None:
        return None
    try:
        return float(calendar.timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return None


# -- state ---------------------------------------------------------------------------------
def state_path(layout: Layout) -> Path:
    return layout.state / "gc" / "state.json"


def load_first_seen(layout: Layout) -> dict[str, float]:
    """When each unreferenced blob was first seen so. A lost or bad state only delays GC."""
    path = state_path(layout)
    try:
        obj = json.loads(path.read_bytes())
        seen = obj["first_seen"] if obj.get("version") == STATE_VERSION else {}
        return {k: float(v) for k, v in seen.items() if is_blob_name(k)}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: unreadable (%s); every candidate starts its grace again", path, exc)
        return {}


def save_first_seen(layout: Layout, first_seen: dict[str, float]) -> None:
    body = {"version": STATE_VERSION, "first_seen": dict(sorted(first_seen.items()))}
    write_atomic(state_path(layout), json.dumps(body, indent=0).encode(), layout.root)


# -- the plan ------------------------------------------------------------------------------
def plan_gc(
    layout: Layout, policy: GcPolicy, *, now: float | None = None, save_index: bool = True
) -> GcPlan:
    """The plan; `save_index`: leave the reach index updated (a dry run only reads it)."""
    with cycles_uncollected():
        return _plan(layout, policy, now if now is not None else time.time(), save_index)


def _plan(layout: Layout, policy: GcPolicy, now: float, save_index: bool) -> GcPlan:
    plan = GcPlan(now, policy)
    trashed = trash_index(layout)
    leases = read_leases(layout, now)
    # The plan may use the reach index (tag files unchanged since the last plan are not read
    # again); the look just before anything moves, `leases_and_reach`, reads every manifest.
    cache = ReachCache.open(layout, save=save_index)
    reach = reachable(layout, manifests=leases.manifests, trash=trashed, cache=cache)
    plan.refused = [*reach.unreadable, *leases.unreadable]
    plan.strays = list(reach.strays)
    history, problem = history_roots(layout, now)
    if problem is not None:
        plan.refused.append(problem)
    reach.keep(history)
    plan.manifests = reach.manifests
    plan.leases_live, plan.leases_expired = len(leases.live), len(leases.expired)
    keep = reach.blob_names
    leased = {d.blob_name for d in leases.digests}
    wanted = keep | leased
    previous = load_first_seen(layout)

    others = _plan_blobs(layout, plan, keep, leased, previous, cache)
    cache.save()
    _plan_temps(layout, plan, wanted, others)
    _plan_compat(layout, plan, wanted)
    _plan_trash(layout, plan, wanted)
    if plan.refused:
        # What an unreadable file names is unknown, so no blob may be called unneeded (a dry
        # run would list as going what it may name); only put-backs are still done.
        plan.trash, plan.pending, plan.young, plan.leased = [], [], [], []
        plan.temps, plan.temps_kept, plan.purge, plan.first_seen = [], [], [], {}
    return plan


def history_roots(layout: Layout, now: float) -> tuple[set[Digest], Problem | None]:
    """What tag history keeps (versions replaced within its retention): roots for every GC,
    whether or not the daemon that recorded them runs."""
    from modelfs.store.history import TagHistory  # history imports blobs, which GC does not need

    history = TagHistory(layout)
    if not history.exists():
        return set(), None
    try:
        return history.roots(now, history.retention()), None
    except (OSError, ValueError, StoreError) as exc:
        return set(), Problem("bad-history", ".modelfs/history", str(exc))


def _plan_blobs(
    layout: Layout,
    plan: GcPlan,
    keep: set[str],
    leased: set[str],
    previous: dict[str, float],
    cache: ReachCache | None = None,
) -> list[str]:
    """Sort every blob into referenced, leased, young, pending and trash (`keep` and `leased`
    by blob file name); the other names in blobs/ are returned for `_plan_temps`. `cache`:
    the reach index, which holds the names in blobs/ while it is as it was."""
    policy, now = plan.policy, plan.now
    try:
        names = os.listdir(layout.blobs) if cache is None else cache.listdir(layout.blobs)
    except FileNotFoundError:
        return []
    except OSError as exc:
        plan.refused.append(Problem("bad-blob", "blobs", f"cannot list: {exc.strerror}"))
        return []
    # A large store holds 100,000 blobs, nearly all referenced: one set difference settles
    # those (`keep` holds only canonical blob names), and only the rest are looked at.
    rest = set(names)
    rest -= keep
    plan.referenced += len(names) - len(rest)
    plan.blobs += len(names) - len(rest)
    others: list[str] = []
    for name in sorted(rest):
        if not is_blob_name(name):
            others.append(name)  # temps are planned apart; foreign files are never ours
            continue
        plan.blobs += 1
        path = os.path.join(layout.blobs, name)
        st = _stat(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            continue  # a link or a dir under a blob's name: reported by scan, not ours
        item = _item(layout.blobs, name, f"blobs/{name}", st, Digest(name[7:]))
        if name in leased:
            plan.leased.append(item)
        elif now - st.st_mtime < policy.grace:
            plan.young.append(item)
        else:
            first = previous.get(name)
            plan.first_seen[name] = first if first is not None else now
            if first is not None and now - first >= policy.grace:
                plan.trash.append(item)
            else:
                plan.pending.append(item)
    return others


def _temp_digest(name: str, pattern: re.Pattern[str]) -> Digest | None:
    m = pattern.match(name)
    if m is None or m.group(1) is None:
        return None
    return Digest(m.group(1)[7:])


def _plan_temps(layout: Layout, plan: GcPlan, wanted: set[str], in_blobs: list[str]) -> None:
    """Temp and partial files of every writer, ours and Ollama's, past the partial grace.
    `in_blobs`: the names `_plan_blobs` found in blobs/ besides blobs (listed once)."""
    places: list[tuple[Path, re.Pattern[str] | None]] = [
        (layout.blobs, _OLLAMA_TEMP),
        (layout.tmp, _OUR_TEMP_DIGEST),
        (layout.links, None),
        (layout.leases, None),
        (layout.state, None),
        (layout.state / "gc", None),
        (layout.state / "verify", None),
    ]
    for directory, pattern in places:
        if directory == layout.blobs:
            names = in_blobs
        else:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
        rel_dir = directory.relative_to(layout.root).as_posix()
        for name in names:
            if directory == layout.blobs:
                if _OLLAMA_TEMP.fullmatch(name) is None:
                    continue
            elif directory not in (layout.tmp, layout.links) and not _STATE_TEMP.fullmatch(name):
                continue  # the state files themselves (leases expire by their TTL)
            path = os.path.join(directory, name)
            st = _stat(path)
            # A symlink there is a manifests-v2 link never renamed into place (a kill -9 in
            # BlobStore.write_v2_manifest); unlinking it leaves its target alone.
            link = (
                directory in (layout.tmp, layout.links)
                and st is not None
                and stat.S_ISLNK(st.st_mode)
            )
            if st is None or not (stat.S_ISREG(st.st_mode) or link):
                continue
            digest = _temp_digest(name, pattern) if pattern is not None else None
            item = _item(directory, name, f"{rel_dir}/{name}", st, digest)
            old = plan.now - st.st_mtime >= plan.policy.partial_grace
            if old and (digest is None or digest.blob_name not in wanted):
                plan.temps.append(item)
            else:
                plan.temps_kept.append(item)
    _plan_fuse_hidden(layout, plan)


# What a FUSE client (sshfs, and libfuse's default `hard_remove` off) makes of a file that is
# unlinked or renamed over while a process of that client holds it open: it stays, renamed to
# `.fuse_hidden<hex>`, until that process closes it; a client that dies first leaves it for
# ever. In `.modelfs/` it is one of ours (a lease or temp file some process had open).
_FUSE_HIDDEN = ".fuse_hidden"


def _plan_fuse_hidden(layout: Layout, plan: GcPlan) -> None:
    """`.fuse_hidden*` files anywhere one level into `.modelfs/`, older than the grace and
    open in no process of this host: what no one will close."""
    found: list[tuple[Path, str, os.stat_result]] = []
    for directory in (layout.state, *_subdirs(layout.state)):
        try:
            names = [n for n in os.listdir(directory) if n.startswith(_FUSE_HIDDEN)]
        except OSError:
            continue
        for name in names:
            st = _stat(directory / name)
            if st is not None and stat.S_ISREG(st.st_mode):
                found.append((directory, name, st))
    if not found:
        return
    held = open_here()
    for directory, name, st in found:
        rel = f"{directory.relative_to(layout.root).as_posix()}/{name}"
        item = _item(directory, name, rel, st, None)
        where = os.path.join(os.path.realpath(directory), name)  # as /proc names it
        if plan.now - st.st_mtime >= plan.policy.grace and where not in held:
            plan.temps.append(item)
        else:
            plan.temps_kept.append(item)


def _subdirs(directory: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def open_here() -> set[str]:
    """The path of every file a process of this host holds open, as /proc names it. Read
    with readlink, which asks nothing of the file's filesystem (a stat of a file on a dead
    mount would hang). Another user's processes are hidden from a non-root GC: their files
    count as closed, which for `.fuse_hidden` files older than the grace they nearly always
    are."""
    held: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return held
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for fd in names:
            with contextlib.suppress(OSError):
                held.add(os.readlink(f"{fds}/{fd}"))
    return held


def _plan_compat(layout: Layout, plan: GcPlan, wanted: set[str]) -> None:
    """Computed tensors of llama.cpp views (`.modelfs/compat/<source hex>/`) outlive their
    source blob only by the grace: derived data, rebuilt on the next read if ever needed."""
    try:
        entries = list(os.scandir(layout.compat))
    except OSError:
        return
    for de in entries:
        st = _stat(de.path)
        if st is None or not stat.S_ISDIR(st.st_mode) or not is_blob_name(f"sha256-{de.name}"):
            continue
        source = Digest(de.name)
        if source.blob_name in wanted or os.path.lexists(layout.blob(source)):
            continue
        if plan.now - st.st_mtime >= plan.policy.grace:
            size = sum(f.stat().st_size for f in Path(de.path).rglob("*") if f.is_file())
            plan.temps.append(
                FileItem(Path(de.path), f".modelfs/compat/{de.name}", size, st.st_mtime, source)
            )


def _trash_dirs(layout: Layout) -> list[os.DirEntry[str]]:
    try:
        return sorted(os.scandir(layout.trash), key=lambda d: d.name)
    except OSError:
        return []


def trash_index(layout: Layout) -> dict[Digest, Path]:
    """Each blob in the trash, by digest (the newest copy where several runs moved one)."""
    index: dict[Digest, Path] = {}
    for stamp_dir in _trash_dirs(layout):
        try:
            names = os.listdir(stamp_dir.path)
        except OSError:
            continue
        for name in names:
            if is_blob_name(name):
                index[Digest(name[7:])] = Path(stamp_dir.path, name)
    return index


def _plan_trash(layout: Layout, plan: GcPlan, wanted: set[str]) -> None:
    rel_trash = layout.trash.relative_to(layout.root).as_posix()
    for stamp_dir in _trash_dirs(layout):
        when = _stamp_time(stamp_dir.name)
        try:
            entries = list(os.scandir(stamp_dir.path))
        except OSError:
            continue
        for de in entries:
            st = _stat(de.path)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            digest = Digest(de.name[7:]) if is_blob_name(de.name) else None
            rel = f"{rel_trash}/{stamp_dir.name}/{de.name}"
            item = _item(Path(stamp_dir.path), de.name, rel, st, digest)
            if (
                digest is not None
                and de.name in wanted
                and not os.path.lexists(layout.blob(digest))
            ):
                plan.restore.append(item)
            elif when is None or plan.now - when >= plan.policy.trash_retention:
                plan.purge.append(item)


# -- the steps ---------------------------------------------------------------------------------
def fresh_stat(path: Path) -> os.stat_result | None:
    """The file's attributes as the server has them now: an NFS client revalidates a file's
    cached attributes when it is opened (close-to-open consistency), a plain stat may not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:
        return _stat(path)  # another user's unreadable blob: the plain look is all we have
    except OSError:
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def unchanged(item: FileItem, st: os.stat_result | None) -> bool:
    """Whether `st` is the file the plan saw, untouched since (mtime, ctime, size, inode)."""
    if st is None or (st.st_mtime, st.st_size) != (item.mtime, item.size):
        return False
    return (item.ctime, item.ino) in ((0.0, 0), (st.st_ctime, st.st_ino))


def move_to_trash(layout: Layout, item: FileItem, trash_dir: Path, grace: float) -> bool:
    """Move one blob into this run's trash dir; False when it changed since the plan (touched,
    replaced or gone), which means someone wants it."""
    st = fresh_stat(item.path)
    if not unchanged(item, st):
        return False
    assert st is not None
    if time.time() - st.st_mtime < grace:
        return False
    make_dirs(trash_dir, layout.root)
    try:
        os.rename(item.path, trash_dir / item.path.name)
    except FileNotFoundError:
        # On NFS a retransmitted rename that already happened says "not found".
        return os.path.lexists(trash_dir / item.path.name)
    return True


def put_back(layout: Layout, item: FileItem) -> bool:
    """Return a trashed blob to blobs/, unless a blob of that name has appeared meanwhile."""
    assert item.digest is not None
    target = layout.blob(item.digest)
    try:
        os.link(item.path, target)  # fails if the name exists: never replaces a blob
    except FileExistsError:
        pass
    except OSError:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(item.path)
    with contextlib.suppress(OSError):
        os.utime(target)  # young again, so no pass counts it as long unreferenced
    return True


def delete_file(item: FileItem, *, same_mtime: bool = True) -> bool:
    """Unlink a file (or remove a derived-data directory) unless it changed since the plan."""
    st = _stat(item.path)
    if st is None or (same_mtime and st.st_mtime != item.mtime):
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(item.path)
        else:
            os.unlink(item.path)
    except FileNotFoundError:
        return False
    return True


def remove_empty_dirs(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.rmdir()


def leases_and_reach(layout: Layout) -> tuple[LeaseSet, Reach]:
    """A fresh look just before acting, to drop candidates that became wanted since the plan:
    every directory listed again (a new opendir each), nothing taken from the plan."""
    leases = read_leases(layout)
    reach = reachable(layout, manifests=leases.manifests, trash=trash_index(layout))
    history, problem = history_roots(layout, time.time())
    if problem is not None:
        reach.unreadable.append(problem)
    reach.keep(history)
    return leases, reach
