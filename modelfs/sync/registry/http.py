"""The HTTP side of the registry server: ASGI requests as `Request`, errors as `HTTPError` (and
the one mapping from what handlers raise to a status), path, header and `Range` parsing, and
headers as ASGI wants them."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

from modelfs.store.digest import Digest
from modelfs.store.errors import (
    BlobError,
    InvalidDigestError,
    InvalidNameError,
    ManifestError,
    ModelNotFoundError,
    StoreError,
)
from modelfs.sync.errors import SyncError
from modelfs.sync.registry.zerocopy import ZEROCOPY
from modelfs.sync.wire.protocol import API_VERSION_HEADER

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_PATH = 2048  # bytes of raw path; the longest valid manifest URL is ~630
JSON = "application/json"
OCTETS = "application/octet-stream"
READ_ONLY_METHODS = ("GET", "HEAD")
KNOWN_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "PATCH", "DELETE", "OPTIONS"})
DIGITS = re.compile(r"[0-9]{1,19}")
_HOST_HEADER = re.compile(r"[A-Za-z0-9._:\[\]%-]{1,300}")


# -- errors ----------------------------------------------------------------------------------
class HTTPError(Exception):
    """An answer that is not a success: status, OCI error code and a one-line message."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = list(headers)


def error_status(exc: BaseException) -> HTTPError:
    """The one mapping from what handlers raise to an HTTP status and OCI error code."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidNameError):
        return HTTPError(400, "NAME_INVALID", str(exc))
    if isinstance(exc, InvalidDigestError):
        return HTTPError(400, "DIGEST_INVALID", str(exc))
    if isinstance(exc, ModelNotFoundError | ManifestError):
        return HTTPError(404, "MANIFEST_UNKNOWN", str(exc))
    if isinstance(exc, BlobError):
        # Missing, quarantined or the wrong size: to a client all mean "not here, try a peer".
        return HTTPError(404, "BLOB_UNKNOWN", str(exc))
    if isinstance(exc, StoreError):
        return HTTPError(500, "UNKNOWN", str(exc))
    if isinstance(exc, SyncError):
        # A mirror's upstream failed (sync.mirror) and the store has no copy.
        return HTTPError(502, "UNKNOWN", str(exc))
    if isinstance(exc, OSError):
        return HTTPError(500, "UNKNOWN", f"cannot read the store: {exc.strerror or exc}")
    return HTTPError(500, "UNKNOWN", "internal error")


# -- requests and responses ------------------------------------------------------------------
@dataclass(slots=True)
class Request:
    method: str
    raw_path: bytes
    query: dict[str, str]
    headers: dict[str, str]
    client: str | None
    scheme: str = "http"
    host: str = "localhost"  # the Host header when it is a plain host[:port]; else our address
    raw_query: str = ""
    zerocopy: bool = False  # the server takes `http.response.zerocopysend` (sync.zerocopy)
    local: tuple[str, int] | None = None  # the address and port the connection reached
    # Set by check_access: the grant the request came with (signin.STATIC_GRANT or a key
    # id; None when only loopback is served), and the signed URL it used, if it used one.
    grant: str | None = None
    signed_url: str | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> Request:
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope.get("headers", ()):
            name = raw_name.decode("latin-1").lower()
            value = raw_value.decode("latin-1")
            if name in headers:
                # Lists may be split over several lines; for the rest the first one counts.
                if name in ("accept", "accept-encoding"):
                    headers[name] += ", " + value
                continue
            headers[name] = value
        raw_path = scope.get("raw_path") or scope.get("path", "/").encode("utf-8")
        raw_path = raw_path.partition(b"?")[0]
        query: dict[str, str] = {}
        qs = scope.get("query_string", b"").decode("latin-1")
        try:
            for key, value in parse_qsl(qs, keep_blank_values=True, max_num_fields=16):
                query.setdefault(key, value)
        except ValueError:
            query = {"\0": ""}  # too many fields: no handler accepts this key
        client = scope.get("client")
        server = scope.get("server")
        local = (str(server[0]), int(server[1])) if server and server[1] is not None else None
        host = headers.get("host", "")
        if _HOST_HEADER.fullmatch(host) is None:
            addr, port = server or ("localhost", None)
            addr = f"[{addr}]" if ":" in addr else addr
            host = addr if port is None else f"{addr}:{port}"
        return cls(
            method=scope.get("method", "GET").upper(),
            raw_path=raw_path,
            query=query,
            headers=headers,
            client=client[0] if client else None,
            scheme=scope.get("scheme", "http"),
            host=host,
            raw_query=qs,
            zerocopy=ZEROCOPY in (scope.get("extensions") or {}),
            local=local,
        )

    @property
    def target(self) -> str:
        """The path and query as sent."""
        path = self.raw_path.decode("latin-1")
        return f"{path}?{self.raw_query}" if self.raw_query else path


def split_path(raw_path: bytes) -> list[str]:
    """Path segments, each percent-decoded on its own; HTTPError for anything suspicious.

    Decoding per segment keeps an encoded slash (`%2F`) inside its segment, where it fails
    name validation, instead of turning into a separator; `.`/`..`, NUL, backslashes, empty
    segments and non-UTF-8 bytes are refused outright.
    """
    if len(raw_path) > MAX_PATH:
        raise HTTPError(414, "NAME_INVALID", f"path longer than {MAX_PATH} bytes")
    if not raw_path.startswith(b"/"):
        raise HTTPError(400, "NAME_INVALID", "path must start with /")
    segments = []
    parts = raw_path[1:].split(b"/")
    for i, part in enumerate(parts):
        try:
            text = unquote_to_bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise HTTPError(400, "NAME_INVALID", "path is not UTF-8") from None
        if text in (".", "..") or any(c in text for c in "/\\\0") or not text.isprintable():
            raise HTTPError(400, "NAME_INVALID", f"invalid path segment {text[:80]!r}")
        if not text and i != len(parts) - 1:
            raise HTTPError(400, "NAME_INVALID", "empty path segment")
        segments.append(text)
    return segments


def entity_tag(digest: Digest, suffix: str = "") -> str:
    return f'"{digest}{suffix}"'


def etag_matches(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    candidates = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in candidates or etag in candidates


def accepts(header: str | None, token: str) -> bool:
    """True when an Accept or Accept-Encoding header names `token` explicitly (no wildcard)
    with a non-zero q."""
    if not header:
        return False
    for item in header.split(","):
        value, *params = (p.strip() for p in item.split(";"))
        if value.lower() != token:
            continue
        q = 1.0
        for param in params:
            key, _, number = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(number)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The one byte range a `Range` header asks for, as (first, last) inclusive.

    None means "send it all": another unit, or several ranges (RFC 9110 lets a server ignore
    either). A malformed `bytes=` spec or an unsatisfiable one is a 416.
    """
    unit, sep, spec = header.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    spec = spec.strip()
    if "," in spec:
        return None

    def refuse(why: str) -> HTTPError:
        return HTTPError(
            416,
            "RANGE_INVALID",
            f"range {spec[:40]!r} {why}",
            [("Content-Range", f"bytes */{size}")],
        )

    first_text, dash, last_text = (p.strip() for p in spec.partition("-"))
    if (
        not dash
        or not (first_text or last_text)
        or (first_text and not DIGITS.fullmatch(first_text))
        or (last_text and not DIGITS.fullmatch(last_text))
    ):
        raise refuse("is malformed")
    if not first_text:
        suffix = int(last_text)
        if suffix == 0 or size == 0:
            raise refuse(f"is not satisfiable for {size} bytes")
        return max(0, size - suffix), size - 1
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last < first:
        raise refuse("is malformed")
    if first >= size:
        raise refuse(f"is not satisfiable for {size} bytes")
    return first, min(last, size - 1)


def encoded(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    out.append((API_VERSION_HEADER[0].lower().encode(), API_VERSION_HEADER[1].encode()))
    return out


def shown(request: Request) -> str:
    return request.raw_path[:200].decode("latin-1")
