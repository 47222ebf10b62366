"""What GC's reach read from each plain manifest (the blob names it keeps), and the names in
`blobs/`, under `.modelfs/reach-index`, so a GC plan re-reads only the tag files that changed
and lists `blobs/` again only when it changed.

Only the plan and `modelfs verify` (which moves nothing for it) use it: the look GC takes just
before it moves anything (`leases_and_reach`) reads every manifest afresh, as it always did. And
the plan still lists every tag file and looks at each: a file's names are used only while it is
as it was, by its stamp (inode, size, mtime_ns, ctime_ns; Ollama rewrites a manifest in place,
ollama/ollama fb30760 manifest/manifest.go:159, so the ctime is what moves), and for a
`manifests-v2/` link by the link's stamp and the stamp of the file it lands on. A manifest list
is not kept (what it keeps depends on which of its children are present), nor anything that
could not be read: those are read every time. The file is indexfile's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from modelfs.store.index.indexfile import (
    dir_key,
    racy,
    read_index,
    stamp,
    started,
    write_index,
)
from modelfs.store.index.shape import nested_texts, texts
from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MAGIC = b"modelfs reach index\n"
FILE_NAME = "reach-index"

Key = tuple[int, ...]  # a file's stamp, or a link's and its target's
Listing = tuple[tuple[int, int, int], tuple[str, ...]]  # a directory's (ino, mtime, ctime), names


@dataclass(slots=True)
class ReachCache:
    files: dict[str, tuple[Key, tuple[str, ...]]] = field(default_factory=dict)
    path: Path | None = None
    root: str = ""
    started: int = 0
    listing: Listing | None = None  # of blobs/
    _met: dict[str, tuple[Key, tuple[str, ...]]] = field(default_factory=dict)
    _listing: Listing | None = None

    @classmethod
    def open(cls, layout: Layout, *, save: bool = True) -> ReachCache:
        """The store's reach index; `save=False` only reads it (`save` then writes nothing)."""
        path = layout.state / FILE_NAME
        cache = cls(path=path if save else None, root=str(layout.root), started=started())
        obj, why = read_index(path, MAGIC, FORMAT_VERSION, cache.root)
        if obj is not None:
            try:
                saved_root, files, listing = obj
                if saved_root == cache.root:
                    cache.files = {p: (tuple(k), tuple(n)) for p, k, n in files}
                    # Names of the shape written (store.index.shape): GC sorts and compares
                    # them with those it lists.
                    nested_texts(n for _, n in cache.files.values())
                    if listing is not None:
                        key, names = listing
                        cache.listing = (tuple(key), tuple(names))
                        texts(cache.listing[1])
            except (TypeError, ValueError) as exc:
                why = f"corrupt ({type(exc).__name__})"
                cache.files, cache.listing = {}, None
        if why is not None:
            log.info("reach index %s: %s; GC reads every manifest and rebuilds it", path, why)
        return cache

    @staticmethod
    def key(path: str, *, is_link: bool) -> Key | None:
        """The file's key as it is now, or None when it is not a file to remember."""
        try:
            st = os.lstat(path)
            if is_link:
                if not stat.S_ISLNK(st.st_mode):
                    return None
                target = os.stat(path)
                return (*stamp(st), *stamp(target)) if stat.S_ISREG(target.st_mode) else None
            if not stat.S_ISREG(st.st_mode):
                return None
            return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # stamp(), inline
        except OSError:
            return None

    def names(self, path: str, key: Key) -> tuple[str, ...] | None:
        known = self.files.get(path)
        if known is None or known[0] != key:
            return None
        self._met[path] = known
        return known[1]

    def keep(self, path: str, key: Key, names: tuple[str, ...]) -> None:
        """Remember what `path`, as it was at `key` (taken before it was read), keeps."""
        # The ctimes: a stamp's last field, and a link's target's.
        if not any(racy(ctime, self.started) for ctime in key[3::4]):
            self._met[path] = (key, names)

    def listdir(self, directory: Path) -> list[str]:
        """os.listdir(directory) (blobs/), or the names it gave while it is as it was
        (indexfile.dir_key)."""
        key = dir_key(os.stat(directory), self.started)
        if key is not None and self.listing is not None and self.listing[0] == key:
            self._listing = self.listing
            return list(self.listing[1])
        names = os.listdir(directory)
        if key is not None:
            self._listing = (key, tuple(names))
        return names

    def save(self, *, listed: bool = True) -> None:
        """Leave for the next plan what this one met; written only when that changed.
        `listed=False`: this look did not list blobs/ (`verify`): the listing stays."""
        if not listed:
            self._listing = self.listing
        # Compared whole: a file too new to keep (racy) is read each time, and not news.
        changed = self._met != self.files or self._listing is not self.listing
        self.files, self._met = self._met, {}
        self.listing, self._listing = self._listing, None
        if not changed or self.path is None:
            return
        files = [(p, k, n) for p, (k, n) in self.files.items()]
        body = (self.root, files, self.listing)
        with contextlib.suppress(OSError):  # a store we cannot write to: read in full each time
            write_index(self.path, MAGIC, FORMAT_VERSION, body, self.root)
