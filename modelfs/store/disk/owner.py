"""What we create in a store belongs to the store's owner, even when we run as root.

Ollama's Linux service runs as `ollama`; an admin running `modelfs pull` or `modelfs gc` by
hand as root must not leave root-owned directories in the store, where the service (and
modelfs's own units, which run as the store's owner) could no longer create files. Without
root nothing changes hands: what we create is ours, and ours is the store's.

`write_atomic` is how every small state file of ours is written (leases, GC state, the verify
cache, tag history, fetch sidecars, computed view tensors): whole or not at all, durable, and
owned like the store.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes,
    root: str | os.PathLike[str],
    *,
    mode: int = 0o644,
    sync_dir: bool = False,
    sync: bool = True,
) -> None:
    """Replace `path` with `data`: a temp file beside it (`.<name>.<random>.tmp`, which
    readers of our state dirs skip), fsynced, adopted, renamed over. A reader sees the old
    bytes or the new, never half; a failure (a full disk) leaves no temp file behind."""
    path = Path(path)
    make_dirs(path.parent, root)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:  # not for a cache rebuilt from the store when lost
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        adopt(tmp, root)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
