"""The files of an artifact's tar layer (ModelPack's `*.v1.tar` layers, modelpack/model-spec@
d78bf3231b4f26196c4a955e1007ccc47e19a77c docs/spec.md "layers"; Docker Model Runner's
`vllm.config.tar` and `dir.tar`, docker/model-runner@642c7211 pkg/distribution/types/config.go),
read without unpacking anything: each regular file's name, size and where its bytes start in
the tar, so that a landing copies them into blobs of their own and keeps the tar as it came.

    tar_members(path, what) -> [TarMember]     (UnsafeTarError)
    plain_path(name, what) -> name               (UnsafeTarError)

A tar is a list of names someone else chose: one that could write outside a model's directory
(absolute, `..`), name one file twice, link, or make a device, a FIFO or a sparse file, and one
of more members than any model has, is refused whole, before any member is copied.

Its headers are someone else's too, and the stdlib reads them trustingly: a PAX `size` of -1
(taken as it is by Python before 3.11.13), a PAX header of long digit runs (parsed with
backtracking regular expressions, quadratic in its length, before 3.11.10: CVE-2024-6232), an
extended header of gigabytes (read whole into memory) or a chain of thousands of them (one
recursion each) would make a member that reads past its end, an hour's CPU, an OOM, a
RecursionError, or (a GNU sparse map that is no numbers) a ValueError. `_CheckedInfo`
refuses each before tarfile parses it.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from modelfs.store.errors import ManifestError

# A model repository holds tens of files, a sharded one a few hundred; a tar of more members
# is not a model, and its header walk alone would cost a read per member.
MAX_MEMBERS = 4096
MAX_NAME = 1024
# An extended header (PAX `x`/`g`, GNU long name/link) holds a name and a few numbers: a
# name's worth and then some. More in a row before one member than these kinds can add up to
# is no header a tar tool writes.
MAX_EXTENDED = 64 << 10
MAX_CHAIN = 8
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_LONG = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
# A PAX record is "<length> <keyword>=<value>\n" (POSIX pax, "pax Extended Header"); no
# number a record holds (a length, size, time, id) has more digits than this.
_RECORD_HEAD = re.compile(rb"([0-9]{1,20}) [^=\n]+=")
_LONG_DIGITS = re.compile(rb"[0-9]{65}")
_SPARSE = re.compile(rb"(?:^|\n)[0-9]+ GNU\.sparse\.")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


class UnsafeTarError(ManifestError):
    """A tar layer whose members cannot be landed as files of a model."""


@dataclass(frozen=True, slots=True)
class TarMember:
    name: str  # relative, '/'-separated, no `.` or `..` parts
    offset: int  # where its bytes start in the tar
    size: int


def _pax_ok(body: bytes) -> bool:
    """Whether `body` is whole PAX records, end to end, without a digit run the stdlib's
    older parsers would backtrack over; one linear pass."""
    if _LONG_DIGITS.search(body):
        return False
    pos = 0
    while pos < len(body):
        head = _RECORD_HEAD.match(body, pos)
        if head is None:
            return False
        length = int(head.group(1))
        if length <= head.end() - pos or body[pos + length - 1 : pos + length] != b"\n":
            return False
        pos += length
    return True


class _BadHeader(Exception):
    """Raised through tarfile (which passes on what it does not know), said by tar_members."""


class _CheckedInfo(tarfile.TarInfo):
    """tarfile's header reader, with each header's own numbers checked before it is
    processed (tarfile.open's `tarinfo` class; `_proc_member` is what every header goes
    through, in 3.11 to 3.14)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise _BadHeader(f"member {self.name!r} has a negative size")
        if self.type not in (*_EXTENDED, *_LONG):
            tar.modelfs_chain = 0  # type: ignore[attr-defined]
            return super()._proc_member(tar)  # type: ignore[misc, no-any-return]
        chain = getattr(tar, "modelfs_chain", 0) + 1
        tar.modelfs_chain = chain  # type: ignore[attr-defined]
        if chain > MAX_CHAIN:
            raise _BadHeader(f"more than {MAX_CHAIN} extended headers in a row")
        if self.size > MAX_EXTENDED:
            raise _BadHeader(f"an extended header of {self.size} bytes (over {MAX_EXTENDED})")
        if self.type in _EXTENDED:
            start = tar.fileobj.tell()
            body = tar.fileobj.read(self.size)
            tar.fileobj.seek(start)
            if not _pax_ok(body):
                raise _BadHeader("a PAX header that is not PAX records")
            # Sparse files are refused anyway; their maps are parsed with bare int() calls.
            if _SPARSE.search(body):
                raise _BadHeader("a GNU sparse file's PAX header")
        return super()._proc_member(tar)  # type: ignore[misc, no-any-return]


def _kind(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"a symlink to {info.linkname!r}"
    if info.islnk():
        return f"a hard link to {info.linkname!r}"
    if info.ischr() or info.isblk():
        return "a device"
    if info.isfifo():
        return "a FIFO"
    if info.issparse():
        return "a sparse file"
    return f"of tar type {info.type!r}"


def plain_path(name: str, what: str) -> str:
    """`name` (a tar member's, a filepath annotation's) as a relative path inside the model's
    directory; refused if it could leave it, or holds a control character or bytes that are no
    UTF-8 (tarfile gives those as lone surrogates; two such names would read alike once
    written as JSON, where each is U+FFFD)."""
    trimmed = name.removeprefix("./").rstrip("/")
    parts = trimmed.split("/")
    if (
        not trimmed
        or len(name) > MAX_NAME
        or name.startswith("/")
        or any(p in ("", ".", "..") or "\\" in p for p in parts)
        or _UNPRINTABLE.search(name)
    ):
        raise UnsafeTarError(f"{what}: {name!r} is not a plain relative path; refused")
    return trimmed


def tar_members(path: Path, what: str) -> list[TarMember]:
    """The regular files of the uncompressed tar at `path`, in tar order; every member is
    checked before this returns, so a refusal leaves nothing half copied."""
    size = os.stat(path).st_size
    files: dict[str, TarMember] = {}
    dirs: set[str] = set()
    count = 0
    try:
        # "r:" reads an uncompressed tar only: a compressed one is a ReadError, not inflated.
        with tarfile.open(path, "r:", tarinfo=_CheckedInfo) as tar:
            while (info := tar.next()) is not None:
                count += 1
                if count > MAX_MEMBERS:
                    raise UnsafeTarError(f"{what}: more than {MAX_MEMBERS} members; refused")
                name = plain_path(info.name, f"{what}: member")
                if info.size < 0:  # a PAX `size` record, applied after _CheckedInfo saw it
                    raise UnsafeTarError(f"{what}: member {name!r} has a negative size; refused")
                if info.isdir():
                    if name in files:
                        raise UnsafeTarError(f"{what}: {name!r} is a file and a directory")
                    dirs.add(name)
                    continue
                if not info.isreg() or info.issparse():
                    raise UnsafeTarError(f"{what}: member {name!r} is {_kind(info)}; refused")
                if name in files or name in dirs:
                    raise UnsafeTarError(f"{what}: member {name!r} appears twice; refused")
                if info.offset_data + info.size > size:
                    raise UnsafeTarError(f"{what}: member {name!r} runs past the tar's end")
                files[name] = TarMember(name, info.offset_data, info.size)
    except _BadHeader as exc:
        raise UnsafeTarError(f"{what}: {exc}; refused") from None
    except (tarfile.TarError, EOFError, ValueError) as exc:  # ValueError: tarfile's int()
        raise UnsafeTarError(f"{what}: not an uncompressed tar ({exc})") from None
    parents = {"/".join(n.split("/")[:i]) for n in files for i in range(1, n.count("/") + 1)}
    clash = sorted(parents & files.keys())
    if clash:
        raise UnsafeTarError(f"{what}: {clash[0]!r} is a file and a directory; refused")
    return list(files.values())


class TarSlice(io.RawIOBase):
    """A member's bytes, read from the tar as a stream (BlobStore.put_stream)."""

    def __init__(self, path: Path, member: TarMember) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed with this stream
        self._f.seek(member.offset)
        self._left = member.size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer)[: self._left]
        n = self._f.readinto(view)
        self._left -= n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()
