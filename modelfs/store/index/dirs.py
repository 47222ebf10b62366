"""The walk of a manifests tree (store.disk.tree's), with each directory's listing kept in the
scan index: a directory whose (inode, mtime_ns, ctime_ns) is as it was is not listed again,
only stat'ed. A name comes or goes in a directory only by a create, rename or unlink there,
each of which moves its mtime and ctime; a listing read within indexfile.RACY_NS of its
directory's last change is not kept. What an entry is (directory, file, link) is kept with it:
it changes only by a new entry of that name. What a link points at is not: a link is stat'ed
each walk, as the plain walk does.

It yields what walk_manifest_tree yields, in the same order, with a `Listed` where that gives
an os.DirEntry: the same questions answered (a link's stat is taken once, as DirEntry does).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from modelfs.store.disk.tree import STRAY_DIRECTORY, STRAY_FILE
from modelfs.store.index.indexfile import racy
from modelfs.store.index.scancache import DirListing

ListedItem = tuple[tuple[str, ...], "Listed | None", str]


class Listed:
    """An entry of a directory as its kept listing names it: what a scan asks of a DirEntry."""

    __slots__ = ("_kind", "_stat", "name", "path")

    def __init__(self, path: str, name: str, kind: str) -> None:
        self.path = path
        self.name = name
        self._kind = kind
        self._stat: os.stat_result | None = None

    def is_symlink(self) -> bool:
        return self._kind == "l"

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._is("f", stat.S_ISREG, follow_symlinks)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._is("d", stat.S_ISDIR, follow_symlinks)

    def _is(self, kind: str, test: Callable[[int], bool], follow: bool) -> bool:
        if self._kind == "l" and follow:
            try:
                return test(self.stat().st_mode)
            except OSError:
                return False
        return self._kind == kind

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if not follow_symlinks:
            return os.lstat(self.path)
        st = self._stat
        if st is None:
            st = self._stat = os.stat(self.path)
        return st


def _kind(de: os.DirEntry[str]) -> str:
    if de.is_symlink():
        return "l"
    if de.is_dir(follow_symlinks=False):
        return "d"
    return "f" if de.is_file(follow_symlinks=False) else "o"


def walk_tree_kept(
    root: Path, kept: dict[str, DirListing], seen: dict[str, DirListing], since_ns: int
) -> list[ListedItem]:
    """walk_manifest_tree's items, from `kept` listings where a directory is as it was; every
    listing usable next time goes into `seen` (a new tuple where it was read again). A list,
    not a generator: a chain of four generators cost more per tag than the rest of the walk."""
    items: list[ListedItem] = []
    add = items.append

    def listing(path: str) -> tuple[tuple[str, ...], str] | None:
        """A directory's entries, kept or read; None when it is no directory (any more)."""
        st = os.stat(path)  # OSError: as the plain walk's scandir would say
        if not stat.S_ISDIR(st.st_mode):
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        known = kept.get(path)
        if known is not None and known[0] == key:
            seen[path] = known
            return known[1], known[2]
        with os.scandir(path) as it:
            found = sorted((de.name, _kind(de)) for de in it)
        names, kinds = tuple(n for n, _ in found), "".join(k for _, k in found)
        if not racy(max(st.st_mtime_ns, st.st_ctime_ns), since_ns):
            seen[path] = (key, names, kinds)
        return names, kinds

    def walk(path: str, parts: tuple[str, ...]) -> None:
        try:
            got = listing(path)
        except NotADirectoryError:
            return
        except OSError as exc:
            add((parts, None, f"cannot list: {exc.strerror}"))
            return
        if got is None:
            return
        deep = len(parts) == 3
        for name, kind in zip(*got, strict=True):
            entry = Listed(f"{path}/{name}", name, kind)
            if not deep:
                # Ollama's Glob follows links to directories; the depth bound stops loops.
                if kind == "d" or (kind == "l" and entry.is_dir()):
                    walk(entry.path, (*parts, name))
                else:
                    add(((*parts, name), entry, STRAY_FILE))
            elif kind == "d" or (kind == "l" and entry.is_dir()):
                add(((*parts, name), entry, STRAY_DIRECTORY))
            else:
                add(((*parts, name), entry, ""))

    if root.is_dir():
        walk(str(root), ())
    return items
