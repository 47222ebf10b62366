"""The verify cache, `<store>/.modelfs/verify/cache`: what a full check found of each blob
(store.collect.verify: its stat stamp, the sample of a large one, when), for --quick.

    VerifyCache.load(layout) / .save()

A store has tens of thousands of blobs and a quick verify of them takes a few hundredths of a
second, so the file is made to load in about a millisecond, in columns, and no object is made
for a blob unless asked: a header, then the names as the listing of `blobs/` gave them (every
name it gave, NUL-separated: a name cannot hold a NUL), their stamps (4 little-endian int64 a
name: inode, size, mtime_ns, ctime_ns; all 0 for a name with no entry, such as a stray), their
check times (one int64 a name, Unix seconds), the samples (`name NUL hex` pairs) and the last
survey of the store besides blobs (`mark NUL text`: verify_report.survey_mark, survey_text). No
marshal or pickle: a store may be someone else's, and this file is read as data only, and only
from a regular file that no one but us and the store's owner can write (it decides which
blobs go unread). A file that is not one, or fails its checksum, is ignored with one warning
(every blob then gets a full check); so is the JSON cache.json of modelfs before it, once.
"""

from __future__ import annotations

import array
import contextlib
import errno
import itertools
import logging
import os
import struct
import sys
import zlib
from pathlib import Path

from modelfs.store.collect.verify import SAMPLE_FROM, CacheEntry, Stamp
from modelfs.store.digest import is_blob_name
from modelfs.store.disk.fileio import open_stat
from modelfs.store.disk.owner import write_atomic
from modelfs.store.index.indexfile import DirKey
from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

MAGIC = b"modelfs verify cache\n"
VERSION = 4  # 1 and 2: cache.json; 3: blobs/'s key without its ctime
# version, crc32 of what follows the header, names, bytes of names, bytes of samples, bytes of
# the survey, whether `listed` holds, blobs/'s inode, mtime_ns and ctime_ns then
_HEADER = struct.Struct("<IIQQQQQqqq")
_SAMPLE_HEX = 32


class VerifyCache:
    """Per blob name, its CacheEntry. Held in columns as the file has them: `names` as the
    listing of blobs/ that saved it gave them (every name it gave, so that the next listing of
    an unchanged directory is the same list, compared whole), `flat` their stamps (4 ints a
    name, all 0 for a name with no entry: a stray, a blob that failed), `at` their check times,
    and `samples` by name; `listed`: blobs/'s (inode, mtime_ns, ctime_ns) when it was listed,
    if that was out of the racy margin (a name comes or goes only by a create, rename or unlink
    there, each of which moves its ctime, which no program can set back as `rsync -a` sets the
    mtime: while it is the same, so is the listing); `survey`: the last
    survey of the store, and the mark of what it was made of (verify_report.survey_mark).

    `stamps` and `times` are the same as dicts by name (of the names with an entry), made when
    first asked for; once `put` changed them, they are what `same` and `save` go by."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.names: list[str] = []
        self.flat: array.array[int] = array.array("q")
        self.at: array.array[int] = array.array("q")
        self.samples: dict[str, str] = {}
        self.listed: DirKey | None = None
        self.survey: tuple[str, str] | None = None
        self._stamps: dict[str, Stamp] | None = None
        self._times: dict[str, int] | None = None
        self._edited = False  # by `put`: the columns are no longer what it holds

    @classmethod
    def of_columns(
        cls,
        layout: Layout,
        names: list[str],
        flat: array.array[int],
        at: array.array[int],
        samples: dict[str, str],
        listed: DirKey | None,
    ) -> VerifyCache:
        cache = cls(layout)
        cache.names, cache.flat, cache.at, cache.samples = names, flat, at, samples
        cache.listed = listed
        return cache

    def _dicts(self) -> tuple[dict[str, Stamp], dict[str, int]]:
        if self._stamps is None or self._times is None:
            it = iter(self.flat)
            stamps: dict[str, Stamp] = {}
            times: dict[str, int] = {}
            for name, stamp, at in zip(
                self.names, zip(it, it, it, it, strict=True), self.at, strict=True
            ):
                if stamp[0]:  # no file has inode 0: a name with no entry
                    stamps[name] = stamp
                    times[name] = at
            self._stamps, self._times = stamps, times
        return self._stamps, self._times

    @property
    def stamps(self) -> dict[str, Stamp]:
        return self._dicts()[0]

    @property
    def times(self) -> dict[str, int]:
        return self._dicts()[1]

    def aligned(self, names: list[str]) -> tuple[array.array[int], array.array[int]]:
        """The stamps (4 a name, 0s: no entry) and check times of `names`, by position: the
        columns as they are when `names` is the listing they were saved under (a directory
        not changed since lists the same), else gathered by name."""
        if self._stamps is None and names == self.names:
            return self.flat, self.at
        stamps, times = self._dicts()
        flat: array.array[int] = array.array("q")
        at: array.array[int] = array.array("q")
        none = (0, 0, 0, 0)
        for name in names:
            flat.extend(stamps.get(name, none))
            at.append(times.get(name, 0))
        return flat, at

    def get(self, name: str) -> CacheEntry | None:
        stamp = self.stamps.get(name)
        if stamp is None:
            return None
        return CacheEntry(stamp, self.samples.get(name), self.times[name])

    def put(self, name: str, entry: CacheEntry) -> None:
        self._edited = True
        self.stamps[name] = entry.stamp
        self.times[name] = entry.verified_at
        if entry.sample is None:
            self.samples.pop(name, None)
        else:
            self.samples[name] = entry.sample

    @property
    def entries(self) -> dict[str, CacheEntry]:
        """Every entry as an object (for a look at a few; the columns are for the many)."""
        return {name: e for name in self.stamps if (e := self.get(name)) is not None}

    def same(self, other: VerifyCache) -> bool:
        """Whether both would save the same file: the same entries, in columns of the same
        order (what the next listing compares), blobs/'s key and survey. Not the entries alone:
        a name with none that came (a stray) changes the listing and the key, and a cache not
        saved for it has every later run list blobs/ again."""
        return (*self._columns(), self.survey) == (*other._columns(), other.survey)

    def _columns(
        self,
    ) -> tuple[list[str], array.array[int], array.array[int], dict[str, str], DirKey | None]:
        """names, stamps, check times, samples and blobs/'s key, as `save` writes them."""
        if not self._edited or self._stamps is None or self._times is None:
            return self.names, self.flat, self.at, self.samples, self.listed
        # The names are the listing only while they are the columns as they came.
        names = list(self._stamps)
        flat = array.array("q", itertools.chain.from_iterable(self._stamps.values()))
        at = array.array("q", map(self._times.__getitem__, names))
        samples = {n: s for n, s in self.samples.items() if n in self._stamps}
        return names, flat, at, samples, None

    @staticmethod
    def path_for(layout: Layout) -> Path:
        return layout.state / "verify" / "cache"

    @property
    def path(self) -> Path:
        return self.path_for(self.layout)

    @classmethod
    def load(cls, layout: Layout) -> VerifyCache:
        path = cls.path_for(layout)
        cache = cls(layout)
        try:
            raw = _read_regular(path, layout.root)
        except FileNotFoundError:
            if path.with_name("cache.json").exists():
                # modelfs before this format: every blob gets one full check.
                log.info("verify cache %s is of an older modelfs; ignoring it", path)
            return cache
        except OSError as exc:
            log.warning("verify cache %s unreadable (%s); ignoring it", path, _why(exc))
            return cache
        try:
            cache._read(raw)
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            log.warning("verify cache %s is damaged (%s); ignoring it", path, exc)
            return cls(layout)
        return cache

    def _read(self, raw: bytes) -> None:
        if not raw.startswith(MAGIC):
            raise ValueError("not a verify cache")
        version, crc, n, names_len, samples_len, survey_len, has_key, ino, mtime, ctime = (
            _HEADER.unpack_from(raw, len(MAGIC))
        )
        if version != VERSION:
            raise ValueError(f"format {version}, not {VERSION}")
        body = memoryview(raw)[len(MAGIC) + _HEADER.size :]
        end = names_len + 40 * n + samples_len
        if len(body) != end + survey_len or zlib.crc32(body) != crc:
            raise ValueError("length or checksum")
        if survey_len:
            mark, _, text = str(body[end:], "utf-8").partition("\0")
            self.survey = (mark, text)
        body = body[:end]
        names = str(body[:names_len], "utf-8", "surrogateescape").split("\0") if n else []
        if len(names) != n:
            raise ValueError(f"{len(names)} names, not {n}")
        # Names as a listing of blobs/ gives them: never a path out of it.
        if n and (
            "/" in body[:names_len].tobytes().decode("latin-1") or {"", ".", ".."} & set(names)
        ):
            raise ValueError("a name no listing of blobs/ holds")
        flat = _int64s(body[names_len : names_len + 32 * n])
        at = _int64s(body[names_len + 32 * n : names_len + 40 * n])
        pairs = str(body[names_len + 40 * n :], "ascii").split("\0") if samples_len else []
        samples = dict(zip(pairs[::2], pairs[1::2], strict=True))
        for name, sample in samples.items():
            if len(sample) != _SAMPLE_HEX:
                raise ValueError(f"the sample of {name} is not 32 hex digits")
            int(sample, 16)
        # A large blob's entry without a sample (or a small one's with one) was not written
        # by this code: such a blob gets a full check.
        sizes = flat[1::4]
        large = []
        if n and max(sizes) >= SAMPLE_FROM:  # in C: a store of small blobs has none
            large = [i for i, size in enumerate(sizes) if size >= SAMPLE_FROM]
        # Only a blob's entry may have a sample, which sends it to a check (and a blob found
        # corrupt there to the quarantine): any other is taken for a changed name.
        good = {names[i] for i in large if names[i] in samples and is_blob_name(names[i])}
        odd = [i for i in large if names[i] not in good]
        if len(good) != len(samples):
            odd += [i for i, name in enumerate(names) if name in samples and name not in good]
        for i in odd:
            flat[4 * i : 4 * i + 4] = array.array("q", bytes(32))
        self.names, self.flat, self.at = names, flat, at
        self.samples = samples if len(good) == len(samples) else {n: samples[n] for n in good}
        self.listed = (ino, mtime, ctime) if has_key else None

    def save(self) -> bool:
        """Write atomically (temp file in the same directory, fsync, rename); False, with a
        warning, where the store cannot be written (a read-only store can still be verified)."""
        path = self.path
        names, flat, at, samples, listed = self._columns()
        if sys.byteorder == "big":
            flat, at = array.array("q", flat), array.array("q", at)  # not ours to swap
            flat.byteswap()
            at.byteswap()
        blob = "\0".join(names).encode("utf-8", "surrogateescape")
        pairs = "\0".join(itertools.chain.from_iterable(samples.items())).encode("ascii")
        survey = "\0".join(self.survey).encode() if self.survey is not None else b""
        body = b"".join((blob, flat.tobytes(), at.tobytes(), pairs, survey))
        key = listed or (0, 0, 0)
        counts = (len(names), len(blob), len(pairs), len(survey))
        head = _HEADER.pack(VERSION, zlib.crc32(body), *counts, bool(listed), *key)
        try:
            write_atomic(path, MAGIC + head + body, self.layout.root)
        except OSError as exc:
            log.warning("cannot write the verify cache %s: %s", path, _why(exc))
            return False
        with contextlib.suppress(OSError):
            path.with_name("cache.json").unlink()  # modelfs before this format's
        return True


def _read_regular(path: Path, root: Path) -> bytes:
    """The bytes of the regular file at `path`: a FIFO there would block a read for ever, and
    a link could lead anywhere (/dev/zero), so neither is followed or waited on (OSError).
    PermissionError for a file that a user other than us or the store's owner could have
    written: what it says decides which blobs go unread."""
    fd, st = open_stat(path, follow=False)
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o022 or st.st_uid not in (os.geteuid(), os.stat(root).st_uid):
            raise PermissionError(errno.EPERM, "writable by another user")
        return f.read()


def _int64s(data: memoryview) -> array.array[int]:
    out = array.array("q")
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
