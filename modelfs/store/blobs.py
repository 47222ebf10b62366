"""Writing into a store the way Ollama expects to find things.

Only finished, verified blobs and finished manifests ever appear under `blobs/` and
`manifests*/`: every write goes to a temp file under `.modelfs/tmp/` (never at depth 4 of a
manifests tree, never a name Ollama's prune would take for its own), is fsynced, and is renamed
into place. Blobs get a fresh mtime, because Ollama's startup prune spares young blobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from modelfs.store.digest import CHUNK, Digest
from modelfs.store.disk.owner import adopt, make_dirs
from modelfs.store.errors import CorruptBlobError, StoreError
from modelfs.store.layout import Layout
from modelfs.store.names import Name

FILE_MODE = 0o644
DIR_MODE = 0o755


def _make_dirs(path: Path, root: Path) -> None:
    """mkdir -p, owned like the store, fsyncing each new directory's parent so the new entry
    survives a crash."""
    for d in make_dirs(path, root, DIR_MODE):
        fsync_dir(d.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    """Atomic, verified writes of blobs and manifests into one store root."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def ensure_dirs(self) -> None:
        for d in (self.layout.blobs, self.layout.tmp):
            make_dirs(d, self.layout.root, DIR_MODE)

    @contextlib.contextmanager
    def temp_file(self, prefix: str = "blob-") -> Iterator[tuple[BinaryIO, Path]]:
        """A temp file in `.modelfs/tmp/`, removed unless it was renamed away."""
        self.ensure_dirs()
        fd, name = tempfile.mkstemp(prefix=prefix, dir=self.layout.tmp)
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f, path
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def has(self, digest: Digest, size: int | None = None) -> bool:
        """A regular file (not a link) under the blob's name, of `size` bytes when given."""
        try:
            st = os.lstat(self.layout.blob(digest))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def commit(self, temp: Path, digest: Digest) -> Path:
        """Rename a finished temp file to its blob name after checking its sha256.

        The caller hashed while writing; this re-check is for callers that did not.
        """
        actual = Digest.of_file(temp)
        if actual != digest:
            raise CorruptBlobError(f"digest mismatch for {digest}: got {actual}")
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self._install(temp, digest)

    def install(self, temp: Path, digest: Digest) -> Path:
        """Rename a finished temp file, which the caller hashed and fsynced, to its blob name.

        For writers that verified the bytes as they arrived (sync.transfer): no second read. The
        rename replaces whatever is there (a blob of the wrong size is never written in place).
        `temp` must be on the store's filesystem (`.modelfs/tmp/`).
        """
        return self._install(temp, digest)

    def _install(self, temp: Path, digest: Digest) -> Path:
        os.chmod(temp, FILE_MODE)
        adopt(temp, self.layout.root)
        target = self.layout.blob(digest)
        os.replace(temp, target)
        os.utime(target)
        fsync_dir(self.layout.blobs)
        return target

    def put_stream(self, src: BinaryIO | io.RawIOBase, expected: Digest | None = None) -> Digest:
        """Copy a stream into a new blob, hashing as it goes; verify against `expected`."""
        with self.temp_file() as (f, temp):
            h = hashlib.sha256()
            while chunk := src.read(CHUNK):
                h.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            digest = Digest(h.hexdigest())
            if expected is not None and digest != expected:
                raise CorruptBlobError(f"digest mismatch for {expected}: got {digest}")
            # Replace whatever is there: an existing file of that name may be zeroed or cut
            # short, and a verified copy renamed over it is the repair.
            f.close()
            self._install(temp, digest)
        return digest

    def put_bytes(self, data: bytes) -> Digest:
        digest = Digest.of_bytes(data)
        blob = self.layout.blob(digest)
        # A blob found here may leave (another host's GC moves it to the trash) before it is
        # touched: then it is written anew, never an error.
        with contextlib.suppress(FileNotFoundError):
            if self.has(digest, len(data)) and blob.read_bytes() == data:
                os.utime(blob)  # a fresh mtime, as a new write would give it
                return digest
        with self.temp_file() as (f, temp):
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            self._install(temp, digest)
        return digest

    def _replace_file(self, target: Path, data: bytes) -> None:
        _make_dirs(target.parent, self.layout.root)
        with self.temp_file("manifest-") as (f, temp):
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.chmod(temp, FILE_MODE)
            adopt(temp, self.layout.root)
            if temp.stat().st_dev != target.parent.stat().st_dev:
                raise StoreError(f"{self.layout.tmp} and {target.parent} are on different devices")
            os.replace(temp, target)
        fsync_dir(target.parent)

    def write_legacy_manifest(self, name: Name, raw: bytes) -> Path:
        """`manifests/<host>/<ns>/<model>/<tag>`, byte for byte (what Ollama ≤ 0.39 reads)."""
        target = self.layout.legacy_manifest(name)
        self._replace_file(target, raw)
        return target

    def write_v2_manifest(self, name: Name, raw: bytes) -> Path:
        """Store the manifest bytes as a blob and point `manifests-v2/…/<tag>` at it.

        A relative symlink, as Ollama writes it; a hardlink where symlinks fail, then a copy.
        """
        digest = self.put_bytes(raw)
        target = self.layout.v2_manifest(name)
        _make_dirs(target.parent, self.layout.root)
        blob = self.layout.blob(digest)
        # The link is made in our tmp dir and renamed into place, so no half-made entry ever
        # sits at depth 4 of manifests-v2/, where Ollama would take it for a bad manifest.
        _make_dirs(self.layout.links, self.layout.root)
        link = self.layout.links / f"link-{secrets.token_hex(8)}"
        try:
            os.symlink(os.path.relpath(blob, target.parent), link)
            adopt(link, self.layout.root)
        except OSError:
            # A symlink made but not adopted (a network filesystem that takes no chown) is
            # ours to remove, or it would sit in tmp/ for ever.
            _discard(link)
            try:
                os.link(blob, link)
            except OSError:
                _discard(link)
                self._replace_file(target, raw)
                return target
        try:
            os.replace(link, target)
        finally:
            # rename() of a hardlink onto the same inode succeeds and leaves the source behind.
            _discard(link)
        fsync_dir(target.parent)
        return target


def _discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
