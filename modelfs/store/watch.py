"""A cheap fingerprint of a store, for anyone who must notice changes (the mount, the server)."""

from __future__ import annotations

import os
from pathlib import Path

from modelfs.store.layout import Layout


def store_signature(layout: Layout) -> tuple[object, ...]:
    """Cheap fingerprint of everything that names a model: every entry of the manifest trees
    (inode, mtime, size) and the blobs dir's mtime, which moves on every blob add or delete."""
    sig: list[object] = []
    for top in (layout.manifests, layout.manifests_v2):
        stack = [(top, 0)]
        while stack:
            path, depth = stack.pop()
            try:
                with os.scandir(path) as it:
                    for de in it:
                        try:
                            st = de.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        sig.append((de.path, st.st_ino, st.st_mtime_ns, st.st_size))
                        if depth < 3 and de.is_dir(follow_symlinks=False):
                            stack.append((Path(de.path), depth + 1))
            except OSError:
                sig.append((str(path), None))
    for d in (layout.blobs,):
        try:
            st = os.stat(d)
            sig.append((str(d), st.st_mtime_ns, st.st_ino))
        except OSError:
            sig.append((str(d), None))
    sig.sort(key=repr)
    return tuple(sig)
