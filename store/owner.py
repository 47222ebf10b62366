"""What we create in a store belongs to the store's owner, even when we run as root.

Ollama's Linux service runs as `ollama`; an admin running `modelfs pull` or `modelfs gc` by
hand as root must not leave root-owned directories in the store, where the service (and
modelfs's own units, which run as the store's owner) could no longer create files. Without
root nothing changes hands: what we create is ours, and ours is the store's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def adopt(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> None:
    """Give `path` (not following a symlink) the owner and group of the store `root`."""
    if os.geteuid() != 0:
        return
    with contextlib.suppress(OSError):
        owner = os.stat(root)
        st = os.lstat(path)
        if (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid):
            os.lchown(path, owner.st_uid, owner.st_gid)


def make_dirs(
    path: str | os.PathLike[str], root: str | os.PathLike[str], mode: int = 0o755
) -> list[Path]:
    """mkdir -p; every directory it creates is adopted. Returns them, outermost first."""
    path = Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        adopt(d, root)
        created.append(d)
    return created
