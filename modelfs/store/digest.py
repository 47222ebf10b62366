"""Content digests: parsing both spellings Ollama accepts, blob file names, hashing."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from io import BufferedIOBase

from modelfs.store.disk.fileio import open_binary
from modelfs.store.errors import InvalidDigestError

# Ollama accepts either separator and either hex case (manifest/paths.go); we compare and
# name files in lowercase, which is what every Ollama writer produces.
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
# The spelling every Ollama writer produces: one match, and no group to lowercase; and a
# manifest's worth of them, one per line, checked by one match.
_CANONICAL = re.compile(r"sha256:[0-9a-f]{64}")
_CANONICAL_LINES = re.compile(r"(?:sha256:[0-9a-f]{64}\n)*sha256:[0-9a-f]{64}")
_BLOB_NAME = re.compile(r"sha256-[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{64}")

CHUNK = 1 << 20


@dataclass(frozen=True, order=True, slots=True)
class Digest:
    """A sha256 digest; `hex` is always lowercase."""

    hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or _HEX.fullmatch(self.hex) is None:
            raise InvalidDigestError(f"invalid sha256 hex: {self.hex!r}")

    def __hash__(self) -> int:
        # The hex's own hash, which a str keeps once computed: the generated one hashes a new
        # tuple at every lookup, and a mount's build looks digests up ~270,000 times.
        return hash(self.hex)

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Parse `sha256:<hex>` or `sha256-<hex>`; raise InvalidDigestError otherwise."""
        if not isinstance(text, str):
            raise InvalidDigestError(f"invalid digest: {text!r}")
        if cls is Digest:
            return _parse_cached(text)
        return cls._parse_new(text)

    @classmethod
    def _parse_new(cls, text: str) -> Digest:
        hex_ = digest_hex(text)
        if hex_ is None:
            raise InvalidDigestError(f"invalid digest: {text[:80]!r}")
        # digest_hex has proved the hex: skip __post_init__'s second match.
        digest = object.__new__(cls)
        object.__setattr__(digest, "hex", hex_)
        return digest

    @classmethod
    def of_bytes(cls, data: bytes) -> Digest:
        # hexdigest() is 64 lowercase hex digits by construction: no match to prove it.
        digest = object.__new__(cls)
        object.__setattr__(digest, "hex", hashlib.sha256(data).hexdigest())
        return digest

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> Digest:
        with open_binary(path) as f:
            return cls(sha256_stream(f))

    @property
    def blob_name(self) -> str:
        """The file name under `blobs/`: `sha256-<hex>`."""
        return f"sha256-{self.hex}"

    @property
    def short(self) -> str:
        """The 12-digit ID `ollama list` prints."""
        return self.hex[:12]

    def __str__(self) -> str:
        return f"sha256:{self.hex}"


def digest_hex(text: str) -> str | None:
    """The lowercase hex of a digest string (`Digest.parse`'s rule), None when `text` is not
    one. For callers that need only the hex of many digests (GC's reach): no object each."""
    if _CANONICAL.fullmatch(text) is not None:
        return text[7:]
    m = _DIGEST.fullmatch(text)
    return None if m is None else m.group(1).lower()


def digest_hexes(texts: list[str]) -> list[str] | None:
    """`digest_hex` of each string, or None when any is not a digest. Nearly always every
    one is canonical, and one match over them all (a GC reads 100,000) says so."""
    joined = "\n".join(texts)
    # Exactly 71 characters between the separators: so no string held a line break (which
    # could make two digests of one string, or one of two).
    if len(joined) == 72 * len(texts) - 1 and _CANONICAL_LINES.fullmatch(joined) is not None:
        return [text[7:] for text in texts]
    hexes = []
    for text in texts:
        hex_ = digest_hex(text)
        if hex_ is None:
            return None
        hexes.append(hex_)
    return hexes


@lru_cache(maxsize=1 << 16)
def _parse_cached(text: str) -> Digest:
    # A store's manifests name the same few thousand digests over and over (shared template,
    # license and config layers; the same child in many lists): one match per distinct string.
    # Digests are immutable, so sharing one object is safe; a bad string raises every time
    # (lru_cache does not cache exceptions).
    return Digest._parse_new(text)


def forget_parsed() -> None:
    """Empty Digest.parse's memo. A view that lives on through many scans (a mount, a server)
    calls it after each one: what it keeps holds its own Digests, and the memo would gather
    every digest the store ever named, ~370 bytes each, up to its 65,536 strings (~25 MB)."""
    _parse_cached.cache_clear()


def is_blob_name(name: str) -> bool:
    """True for canonical blob file names (`sha256-` and 64 lowercase hex digits)."""
    return _BLOB_NAME.fullmatch(name) is not None


def sha256_stream(f: BufferedIOBase) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(view):
        h.update(view[:n])
    return h.hexdigest()
