"""The walk of a manifests tree (`manifests/`, `manifests-v2/`) that the scan and GC's reach
share: every file at tag depth, and what is out of place on the way."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from pathlib import Path

TreeItem = tuple[tuple[str, ...], os.DirEntry[str] | None, str]

STRAY_DIRECTORY = "stray directory where a manifest should be"
STRAY_FILE = "stray file (not a manifest: wrong depth)"


def _is_dir(de: os.DirEntry[str]) -> bool:
    """A directory, or a link to one; False for what cannot be followed (a link loop is
    then judged where it is read)."""
    try:
        return de.is_dir(follow_symlinks=True)
    except OSError:
        return False


_NAME = operator.attrgetter("name")


def walk_manifest_tree(root: Path) -> Iterator[TreeItem]:
    """Yield (parts, dir entry, problem) for everything at or above depth 4 that is not a dir
    on the way down. Depth-4 entries that are files or symlinks are candidates; anything else
    out of place is yielded with a problem text."""

    def walk(path: str, parts: tuple[str, ...]) -> Iterator[TreeItem]:
        try:
            it = os.scandir(path)
        except NotADirectoryError:
            return
        except OSError as exc:
            yield parts, None, f"cannot list: {exc.strerror}"
            return
        with it:
            for de in sorted(it, key=_NAME):
                sub = (*parts, de.name)
                if len(sub) < 4:
                    # Ollama's Glob follows links to directories; the depth bound stops loops.
                    if _is_dir(de):
                        yield from walk(de.path, sub)
                    else:
                        yield sub, de, STRAY_FILE
                elif _is_dir(de):
                    # Ollama skips these (ollama/ollama fb30760 manifest/manifest.go:189-194,
                    # os.Stat follows a link): a directory holds no manifest, names no blobs.
                    yield sub, de, STRAY_DIRECTORY
                else:
                    yield sub, de, ""

    if root.is_dir():
        yield from walk(str(root), ())
