"""Token files: the one reader of the credentials a host serves with and sends to its peers.

    read_credentials(path) -> Credentials            CredentialsError: one line, names the file
    Credentials.authorization                        the `Authorization` header value to send
    Credentials.secret                               what a server with this file accepts

A token file holds one line: a bearer token (`head -c 32 /dev/urandom | base64`), or
`user:password` for a registry with htpasswd auth. A token is sent as `Bearer <token>`; a
`user:password` line as HTTP Basic. A server given the file (`modelfs serve --token-file`,
the sync daemon's `token_file`) accepts `Bearer <secret>` or Basic with the secret as the
password, where the secret is the token, or the password of a `user:password` line: so
hosts sharing one file accept each other, whichever of the two forms it holds.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import overload

from modelfs.store.fileio import read_file
from modelfs.sync.errors import SyncError

MAX_TOKEN_FILE = 1024


class CredentialsError(SyncError):
    """A token file that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Credentials:
    secret: str  # the token, or the password of a `user:password` line
    user: str | None = None

    @property
    def authorization(self) -> str:
        if self.user is None:
            return f"Bearer {self.secret}"
        raw = f"{self.user}:{self.secret}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def __repr__(self) -> str:  # never print the secret (a log line, a traceback)
        return f"Credentials(user={self.user!r}, secret=…)"


@overload
def read_credentials(path: None) -> None: ...
@overload
def read_credentials(path: str | os.PathLike[str]) -> Credentials: ...
def read_credentials(path: str | os.PathLike[str] | None) -> Credentials | None:
    """The credentials in a token file, surrounding whitespace stripped (None: none given)."""
    if path is None:
        return None
    where = os.fspath(path)
    try:
        raw = read_file(path, MAX_TOKEN_FILE)
    except OSError as exc:
        raise CredentialsError(f"cannot read token file {where}: {exc.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE:
        raise CredentialsError(f"token file {where} is larger than {MAX_TOKEN_FILE} bytes")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CredentialsError(f"token file {where} is not UTF-8 text") from None
    if not text:
        raise CredentialsError(f"token file {where} is empty")
    if "\n" in text or "\r" in text:
        raise CredentialsError(f"token file {where}: expected one line (a token, or user:password)")
    user, sep, password = text.partition(":")
    if sep:
        # Basic carries it base64-encoded: any printable characters will do.
        if not user or not password or not text.isprintable():
            raise CredentialsError(f"token file {where}: expected user:password, both non-empty")
        return Credentials(password, user)
    if any(not (0x21 <= ord(c) <= 0x7E) for c in text):
        # A bearer token travels in a header as it is: no client could ever send it.
        raise CredentialsError(f"token in {where} has spaces or characters outside printable ASCII")
    return Credentials(text)
