"""Peers proven by a pinned key: the one place TLS to a peer is set up and checked.

    pin = parse_pin("sha256:<64 hex>")          ValueError (one line) for anything else
    pin_of_cert_file(path) -> "sha256:…"        what `modelfs serve --print-pin` prints
    tls = PeerTls({url: pin, …})                 the daemon's `pin` keys, by peer URL
    tls.context_for(scheme, host, port) -> ssl.SSLContext | None    None: ordinary verification
    pin_mismatch(exc) -> PinMismatch | None     was this failure a certificate that is not pinned?

A pin is `sha256:` and the hex SHA-256 of the certificate's SubjectPublicKeyInfo (its public
key, DER-encoded), as curl's `--pinnedpubkey` and RFC 7469 pin: it names the key, so a
certificate renewed with the same key keeps its pin. A pinned peer's certificate is trusted by
the pin alone, like an SSH host key: no CA, host name or expiry is checked, so a self-signed
certificate is fine, and anything else on that address is refused during the handshake,
before a request (and the token it carries) is sent.

Both ways modelfs talks to a peer use the context from here: the httpx client (its transport,
sync.proxies.ProxyRouter, picks the context by the request's origin) and the raw large-blob
receiver (sync.client `PeerClient._connect`, `wrap_socket`). The check is in the SSL objects
the context makes (`sslobject_class` for httpx's memory-BIO TLS, `sslsocket_class` for
`wrap_socket`), so neither caller can forget it.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PIN_PREFIX = "sha256:"
UNPINNED = "certificate does not match pin"  # the reason status and /metrics show
_PIN = re.compile(r"sha256:([0-9a-fA-F]{64})")
MAX_CERT_BYTES = 1 << 20

Origin = tuple[str, str, int]  # scheme, host (lowercase, no brackets), port


def parse_pin(text: str) -> str:
    """`sha256:<64 hex digits>`, lowercased; ValueError naming the expected form."""
    m = _PIN.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"expected sha256:<64 hex digits> (what `modelfs serve --print-pin` prints), "
            f"got {text!r}"
        )
    return PIN_PREFIX + m.group(1).lower()


def pin_of_der(der: bytes) -> str:
    """The pin of a DER certificate: the SHA-256 of its SubjectPublicKeyInfo."""
    key = x509.load_der_x509_certificate(der).public_key()
    spki = key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return PIN_PREFIX + hashlib.sha256(spki).hexdigest()


def pin_of_cert_file(path: str | os.PathLike[str]) -> str:
    """The pin of the (first) certificate in a PEM file; ValueError or OSError if unusable."""
    data = Path(path).read_bytes()[:MAX_CERT_BYTES]
    try:
        cert = x509.load_pem_x509_certificates(data)[0]
    except ValueError:
        raise ValueError(f"{path}: not a PEM certificate") from None
    return pin_of_der(cert.public_bytes(Encoding.DER))


def names_of_cert_file(path: str | os.PathLike[str]) -> list[str]:
    """The DNS names and addresses the (first) certificate in a PEM file is for: its subject
    alternative names, else its common name; [] if it cannot be read (check_tls says why)."""
    try:
        cert = x509.load_pem_x509_certificates(Path(path).read_bytes()[:MAX_CERT_BYTES])[0]
    except (OSError, ValueError):
        return []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        common = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        return [str(a.value) for a in common]
    addresses = map(str, san.get_values_for_type(x509.IPAddress))
    return [*san.get_values_for_type(x509.DNSName), *addresses]


class PinMismatch(ssl.SSLCertVerificationError):
    """The peer's certificate is not the pinned one (or it sent none)."""

    def __init__(self, found: str | None, wanted: str) -> None:
        super().__init__(f"{UNPINNED} (found {found or 'none'})")
        self.found = found
        self.wanted = wanted


def _check(obj: ssl.SSLObject | ssl.SSLSocket, wanted: str) -> None:
    der = obj.getpeercert(binary_form=True)
    found = pin_of_der(der) if der else None
    if found != wanted:
        raise PinMismatch(found, wanted)


class _PinnedObject(ssl.SSLObject):
    pin = ""

    def do_handshake(self) -> None:
        super().do_handshake()
        _check(self, self.pin)


class _PinnedSocket(ssl.SSLSocket):
    pin = ""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check(self, self.pin)


def pinned_context(pin: str) -> ssl.SSLContext:
    """A client context that accepts exactly the certificate whose key `pin` names."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # The pin replaces CA, host-name and expiry checks (see the module docstring).
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    attrs: dict[str, Any] = {"pin": pin}
    context.sslobject_class = type("PinnedObject", (_PinnedObject,), attrs)
    context.sslsocket_class = type("PinnedSocket", (_PinnedSocket,), attrs)
    return context


def origin_of(url: str) -> Origin:
    u = urlsplit(url)
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), u.port or (443 if scheme == "https" else 80)


class PeerTls:
    """The pinned peers of one session, by origin; the rest get ordinary verification.
    `update` (a reload) replaces the pins; a context is made once per pin."""

    def __init__(self, pins: Mapping[str, str] | None = None) -> None:
        self._contexts: dict[Origin, ssl.SSLContext] = {}
        self._made: dict[str, ssl.SSLContext] = {}
        self.update(pins or {})

    def update(self, pins: Mapping[str, str]) -> None:
        made = {pin: self._made.get(pin) or pinned_context(pin) for pin in pins.values()}
        self._contexts = {origin_of(url): made[pin] for url, pin in pins.items()}
        self._made = made

    def context_for(self, scheme: str, host: str, port: int) -> ssl.SSLContext | None:
        if scheme != "https":
            return None
        return self._contexts.get((scheme, host.lower().strip("[]"), port))


def pin_mismatch(exc: BaseException) -> PinMismatch | None:
    """The PinMismatch behind `exc` (httpx and trio wrap it in their own errors), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PinMismatch):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
