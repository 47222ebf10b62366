"""Credentials: the one reader of every secret modelfs sends or accepts.

    read_credentials(path) -> Credentials            a token file; CredentialsError: one line
    read_password(stream, user) -> Credentials       `--username U --password-stdin`
    Logins(explicit).for_registry(host)              what to send to one registry (blocking)
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
import binascii
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, overload

from modelfs.store.disk.fileio import read_file
from modelfs.sync.errors import SyncError

MAX_TOKEN_FILE = 1024


class CredentialsError(SyncError):
    """A token file that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Credentials:
    secret: str  # the token, or the password of a `user:password` line
    user: str | None = None
    source: str = ""  # where they came from, for messages: a file, a helper, `--username`
    identity_token: bool = False  # an OAuth2 refresh token (docker's `identitytoken`)

    @property
    def who(self) -> str:
        """The credentials in a message: the user and where they came from, never the secret."""
        user = "an identity token" if self.identity_token else f"user {self.user!r}"
        if self.user is None and not self.identity_token:
            user = "a token"
        return f"{user} from {self.source}" if self.source else user

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
        return Credentials(password, user, where)
    if any(not (0x21 <= ord(c) <= 0x7E) for c in text):
        # A bearer token travels in a header as it is: no client could ever send it.
        raise CredentialsError(f"token in {where} has spaces or characters outside printable ASCII")
    return Credentials(text, source=where)


MAX_PASSWORD = 64 << 10


def read_password(stream: TextIO, user: str) -> Credentials:
    """`--username USER --password-stdin`: the password (or token) is the first line of stdin,
    as `docker login --password-stdin` reads it."""
    if not user:
        raise CredentialsError("--username: empty user name")
    text = stream.read(MAX_PASSWORD + 1)
    if len(text) > MAX_PASSWORD:
        raise CredentialsError(f"--password-stdin: more than {MAX_PASSWORD} characters")
    password = text.rstrip("\r\n")
    if not password or "\n" in password:
        raise CredentialsError("--password-stdin: expected the password as one line on stdin")
    return Credentials(password, user, "--username/--password-stdin")


# -- docker's credentials -------------------------------------------------------------------
MAX_DOCKER_CONFIG = 4 << 20
HELPER_TIMEOUT = 30.0
# Docker Hub's credentials are kept under its v1 index URL (docker/cli registry.IndexServer).
_HUB = "https://index.docker.io/v1/"
_HUB_HOSTS = {"docker.io", "index.docker.io", "registry-1.docker.io"}


def docker_config_path() -> Path:
    """`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, as the docker CLI looks."""
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def _server_host(key: str) -> str:
    """The host[:port] of a docker config key (`https://ghcr.io`, `ghcr.io`, the Hub's URL)."""
    host = key.split("://", 1)[-1].split("/", 1)[0].lower()
    return "index.docker.io" if host in _HUB_HOSTS else host


class Logins:
    """Which credentials go to which registry: `explicit` (a token file or `--username`) to
    every host; else what the docker CLI would send, read from its config file: `credHelpers`
    for that host, else `credsStore`, through `docker-credential-<name> get` on PATH (docker's
    credential-helper protocol: the server on stdin, `{"Username","Secret"}` on stdout), else
    the `auths` entry. Each host is looked up once; thread-safe."""

    def __init__(
        self, explicit: Credentials | None = None, *, docker_config: Path | None = None
    ) -> None:
        self.explicit = explicit
        self.docker_config = docker_config or docker_config_path()
        self._found: dict[str, Credentials | None] = {}
        self._config: dict[str, object] | None = None
        self._lock = threading.Lock()

    def for_registry(self, host: str) -> Credentials | None:
        """The credentials for `host` (`host[:port]`), or None; CredentialsError names the
        file or helper that failed. Blocking: it may run a credential helper."""
        if self.explicit is not None:
            return self.explicit
        host = _server_host(host)
        with self._lock:
            if host not in self._found:
                self._found[host] = self._lookup(host)
            return self._found[host]

    def _read_config(self) -> dict[str, object]:
        if self._config is None:
            where = self.docker_config
            try:
                raw = read_file(where, MAX_DOCKER_CONFIG)
            except FileNotFoundError:
                raw = b"{}"
            except OSError as exc:
                raise CredentialsError(f"cannot read {where}: {exc.strerror}") from None
            try:
                config = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise CredentialsError(f"{where} is not JSON") from None
            if not isinstance(config, dict):
                raise CredentialsError(f"{where}: expected a JSON object")
            self._config = config
        return self._config

    def _lookup(self, host: str) -> Credentials | None:
        config = self._read_config()
        helpers = config.get("credHelpers")
        keys = [k for k in helpers if _server_host(k) == host] if isinstance(helpers, dict) else []
        if keys:
            return self._helper(str(helpers[keys[0]]), keys[0])  # type: ignore[index]
        store = config.get("credsStore")
        if isinstance(store, str) and store:
            found = self._helper(store, _HUB if host == "index.docker.io" else host)
            if found is not None:
                return found
        auths = config.get("auths")
        if not isinstance(auths, dict):
            return None
        for key, entry in auths.items():
            if _server_host(key) == host and isinstance(entry, dict):
                return self._entry(key, entry)
        return None

    def _entry(self, key: str, entry: dict[str, object]) -> Credentials | None:
        where = f"{self.docker_config} (auths.{key})"
        token = entry.get("identitytoken")
        if isinstance(token, str) and token:
            return Credentials(token, None, where, identity_token=True)
        user, password = entry.get("username"), entry.get("password")
        auth = entry.get("auth")
        if isinstance(auth, str) and auth:
            try:
                user, sep, password = base64.b64decode(auth, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                sep = ""
            if not sep:
                raise CredentialsError(f"{where}: auth is not base64 of user:password")
        if isinstance(user, str) and isinstance(password, str) and user and password:
            return Credentials(password, user, where)
        return None

    def _helper(self, name: str, server: str) -> Credentials | None:
        program = f"docker-credential-{name}"
        where = f"{program} (named in {self.docker_config})"
        path = shutil.which(program)
        if path is None:
            raise CredentialsError(f"{where}: not found on PATH")
        try:
            done = subprocess.run(
                [path, "get"],
                input=server.encode(),
                capture_output=True,
                timeout=HELPER_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise CredentialsError(f"{where}: no answer in {HELPER_TIMEOUT:g} s") from None
        except OSError as exc:
            raise CredentialsError(f"{where}: cannot run ({exc.strerror})") from None
        if done.returncode != 0:
            said = done.stdout.decode(errors="replace").strip().splitlines()
            if said and "credentials not found" in said[0].lower():
                return None  # the helper's protocol: it holds nothing for this server
            # Its words, not its output: a helper may echo what it was given.
            raise CredentialsError(f"{where}: exited with status {done.returncode} for {server}")
        try:
            answer = json.loads(done.stdout)
            user, secret = answer["Username"], answer["Secret"]
        except (ValueError, KeyError, TypeError):
            raise CredentialsError(f"{where}: answered with no Username and Secret") from None
        if not isinstance(user, str) or not isinstance(secret, str) or not secret:
            raise CredentialsError(f"{where}: answered with no Username and Secret")
        if user == "<token>":  # docker's marker for an identity token
            return Credentials(secret, None, where, identity_token=True)
        return Credentials(secret, user or None, where)
