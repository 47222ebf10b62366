"""Who may read from `modelfs serve`: a static token, Ollama's key sign-in, signed blob URLs.

    access = Access(token="s3cret", keys_path="/etc/modelfs/authorized_keys")
    access.enabled                          any credential configured (else: loopback only)
    access.bearer_grant(value)              the grant of the static token or of a token this
                                            server issued (None: neither)
    access.sign_in(SignInRequest(...))      Ollama's signed token request -> its key's id
    access.sign_path(path, grant) / url_grant(path, expires, grant, signature)
                                            capability URLs for blob parts

Ollama signs in the way its registry expects (ollama/ollama fb30760 server/auth.go:28-99,
auth/auth.go:53-85): on a 401 it reads `realm`, `service` and `scope` from the challenge
(server/images.go:1414-1445), requires the realm on the request's own host and port
(server/auth.go:59-62), adds `service`, `scope`, `ts` (Unix seconds) and `nonce` to the realm's
query (url.Values.Encode, keys sorted), and sends `GET <that URL>` with

    Authorization: <base64 of its ssh-ed25519 public key blob>:<base64 ed25519 signature>

over the bytes `GET,<the URL as sent>,<base64 of the hex sha256 of an empty body>`. It takes
`{"token": ...}` and sends `Authorization: Bearer <token>` from then on (images.go:1384-1390).
Ollama's blob part requests carry no Authorization at all (server/download.go:340-345), so an
authenticated blob GET is answered with a `Location` on the same path plus `expires` and
`signature` query parameters (server/download.go:270 reads it), which alone let the parts in.

A signature counts only when it was made for this server's own realm (sync.realm): the URL
it covers names a host and port this server answers to and this server's own `service`.

Issued tokens and signed URLs are HMACs under a secret made when the server starts: they are
good on this server only, and a restart ends them (Ollama signs in again by itself; a blob it
was halfway through fails and the next `ollama pull` starts it over). Each names its grant,
the key it was issued to (or `static`, the token file's), and stops working when that key
leaves the keys file. A signed URL keeps the expiry it was issued with: answers to it carry
that same URL, never a fresh one, so no URL lives longer than SIGNED_URL_TTL.

The keys file is read again when its stat (inode, size, mtime) changes, so adding or removing a
key needs no restart. Ed25519 verification is the `cryptography` package's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import parse_qs, quote

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from modelfs.store.disk.fileio import read_file
from modelfs.store.units import counted
from modelfs.sync.errors import SyncError
from modelfs.sync.wire.realm import Realm

log = logging.getLogger(__name__)

TOKEN_PATH = "/modelfs/v1/token"
STATIC_GRANT = "static"  # what the token file's holders (and daemons proving it) are granted
TOKEN_TTL = 300  # seconds an issued bearer token is good for; Ollama signs in again after
# A blob's parts all go to the one URL Ollama got before the first part (download.go:231-275),
# so the URL must outlive the slowest whole-blob download we want to allow: 40 GB at ~2 MB/s.
SIGNED_URL_TTL = 6 * 3600
TS_WINDOW = 300  # a sign-in's `ts` may be this many seconds off our clock, either way
MAX_NONCES = 100_000  # nonces remembered; only sign-ins with a valid signature add one
MAX_KEYS_FILE = 1 << 20
MAX_CREDENTIAL = 4096
# What Ollama signs for a GET, whose body is empty: base64(hex(sha256(""))) (auth.go:64-65).
EMPTY_BODY = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()
_KEY_TYPE = "ssh-ed25519"


class AccessConfigError(SyncError):
    """The keys file cannot be used at start-up; one line for the user."""


class Refused(Exception):
    """A credential that is not good: `reason` goes to the client, `str()` to the log."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason = reason


# -- the keys file ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AuthorizedKey:
    blob: bytes  # the SSH wire-format public key, what Ollama sends base64-encoded
    key: Ed25519PublicKey
    comment: str
    line: int

    @property
    def key_id(self) -> str:
        """A short stable id for the key (in tokens and log lines)."""
        return base64.urlsafe_b64encode(hashlib.sha256(self.blob).digest()[:12]).decode()

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.blob)


def parse_keys(text: str, source: str) -> tuple[dict[bytes, AuthorizedKey], list[str]]:
    """Keys by blob, and one problem line per line that is not an ssh-ed25519 key.

    Lines are `ssh-ed25519 AAAA… comment`, as in `~/.ollama/id_ed25519.pub`; blank lines and
    `#` comments are skipped.
    """
    keys: dict[bytes, AuthorizedKey] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 2)
        if fields[0] != _KEY_TYPE or len(fields) < 2:
            problems.append(f"{source}:{number}: not an {_KEY_TYPE} public key, skipped")
            continue
        try:
            key = load_ssh_public_key(f"{fields[0]} {fields[1]}".encode())
            blob = base64.b64decode(fields[1], validate=True)
        except (ValueError, UnsupportedAlgorithm, binascii.Error):
            problems.append(f"{source}:{number}: not a valid {_KEY_TYPE} public key, skipped")
            continue
        assert isinstance(key, Ed25519PublicKey)
        comment = fields[2] if len(fields) > 2 else ""
        keys.setdefault(blob, AuthorizedKey(blob, key, comment, number))
    return keys, problems


class AuthorizedKeys:
    """The keys file, read again whenever its stat changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stat: tuple[int, ...] | None = None
        self._keys: dict[bytes, AuthorizedKey] = {}
        try:
            self._load(os.stat(self.path))
        except OSError as exc:
            raise AccessConfigError(
                f"cannot read authorized keys file {self.path}: {exc.strerror}"
            ) from None
        if not self._keys:
            log.warning("%s holds no ssh-ed25519 key: no Ollama host can sign in", self.path)

    def _load(self, st: os.stat_result) -> None:
        raw = read_file(self.path, MAX_KEYS_FILE)
        if len(raw) > MAX_KEYS_FILE:
            raise OSError(0, f"larger than {MAX_KEYS_FILE} bytes")
        keys, problems = parse_keys(raw.decode("utf-8", "replace"), self.path)
        for problem in problems:
            log.warning("%s", problem)
        self._keys = keys
        self._stat = _stat_key(st)

    def current(self) -> dict[bytes, AuthorizedKey]:
        """The keys as the file holds them now: a file gone or unreadable holds none."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stat is not None:
                log.warning("%s: %s; no key is accepted until it is back", self.path, exc.strerror)
            self._stat, self._keys = None, {}
            return self._keys
        if _stat_key(st) != self._stat:
            try:
                self._load(st)
            except OSError as exc:
                log.warning("%s: %s; no key is accepted", self.path, exc.strerror)
                self._stat, self._keys = _stat_key(st), {}
            else:
                log.info("%s: %s", self.path, counted(len(self._keys), "key"))
        return self._keys


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# -- the whole rule --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SignInRequest:
    """A token request as it arrived: enough to rebuild the URL Ollama signed."""

    scheme: str
    host: str  # the Host header, which Ollama's client sets to the realm URL's host
    raw_path: str
    raw_query: str
    authorization: str
    client: str | None
    local: tuple[str, int] | None = None  # the address and port the connection reached


def token_hash(token: str | bytes) -> bytes:
    data = token.encode("utf-8") if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


class Access:
    def __init__(
        self,
        *,
        token: str | None = None,
        keys_path: str | os.PathLike[str] | None = None,
        token_ttl: float = TOKEN_TTL,
        url_ttl: float = SIGNED_URL_TTL,
        realm: Realm | None = None,
    ) -> None:
        # Only a hash of the static token is kept; comparing hashes takes the same time
        # whatever the length or prefix of what a client sends.
        self._token_hash = token_hash(token) if token else None
        self.keys = AuthorizedKeys(keys_path) if keys_path is not None else None
        self.token_ttl = token_ttl
        self.url_ttl = url_ttl
        self.realm = realm if realm is not None else Realm(socket.gethostname())
        self._secret = secrets.token_bytes(32)
        self._nonces: OrderedDict[tuple[bytes, str], float] = OrderedDict()
        self._peer_nonces: OrderedDict[str, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._token_hash is not None or self.keys is not None

    @property
    def kind(self) -> str:
        kinds = [k for k, on in (("token", self._token_hash), ("keys", self.keys)) if on]
        return "+".join(kinds) or "loopback"

    # -- bearer tokens ---------------------------------------------------------------------
    def static_ok(self, given: str) -> bool:
        return self._token_hash is not None and hmac.compare_digest(
            token_hash(given), self._token_hash
        )

    def bearer_grant(self, given: str) -> str | None:
        """The grant of the static token, or of an unexpired token this server issued to a
        key still in the file (or to a holder of the static token); None for anything else."""
        if self.static_ok(given):
            return STATIC_GRANT
        parts = given.split(".")
        if len(parts) != 4 or parts[0] != "mf1" or not parts[1].isdigit():
            return None
        _, expires, key_id, mac = parts
        if not hmac.compare_digest(mac, self._mac("token", expires, key_id)):
            return None
        if int(expires) < time.time():
            log.info("an issued token expired; the client signs in again")
            return None
        return key_id if self.grant_alive(key_id) else None

    def grant_alive(self, grant: str) -> bool:
        """Does what `grant` was given to still hold: the token file (it is read once, so
        only a restart with another file ends it, and with it every grant), or the key, still
        in the keys file?"""
        if grant == STATIC_GRANT:
            return self._token_hash is not None
        keys = self.keys.current() if self.keys is not None else {}
        return any(k.key_id == grant for k in keys.values())

    def issue(self, key_id: str) -> dict[str, object]:
        """The token endpoint's answer, in the shape Docker's token flow and Ollama read."""
        now = int(time.time())
        expires = str(now + int(self.token_ttl))
        token = f"mf1.{expires}.{key_id}.{self._mac('token', expires, key_id)}"
        return {
            "token": token,
            "access_token": token,
            "expires_in": int(self.token_ttl),
            "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        }

    # -- Ollama's sign-in ------------------------------------------------------------------
    def sign_in(self, req: SignInRequest) -> str:
        """The key id a signed token request proves, or Refused."""
        if self.keys is None:
            raise Refused("this server takes no key sign-in (no authorized keys)")
        realm = self.realm
        if len(req.authorization) > MAX_CREDENTIAL or req.authorization.count(":") != 1:
            raise Refused("Authorization is not <public key>:<signature>")
        key_text, _, sig_text = req.authorization.strip().partition(":")
        try:
            blob = base64.b64decode(key_text, validate=True)
            signature = base64.b64decode(sig_text, validate=True)
        except binascii.Error:
            raise Refused("the public key or the signature is not base64") from None
        key = self.keys.current().get(blob)
        if key is None:
            raise Refused(f"key {_fingerprint(blob)} is not authorized", f"not in {self.keys.path}")
        who = f"{key.fingerprint} {key.comment}".strip()
        origin = realm.origin(req.scheme, req.host)
        url = f"{origin}{req.raw_path}"
        if req.raw_query:
            url += f"?{req.raw_query}"
        try:
            key.key.verify(signature, f"GET,{url},{EMPTY_BODY}".encode())
        except InvalidSignature:
            raise Refused("bad signature", f"{who}, over GET {url}") from None
        # Signed, so the key's holder asked `origin` for a token: counted only when that is
        # us (sync.realm), or what it signed for another registry would buy a token here.
        if not realm.ours(req.scheme, req.host, req.local):
            raise Refused(
                f"signed for {origin[:200]}, which is not this server",
                f"{who}; this server answers to {realm.describe(req.local)}; "
                "name others with --public-url",
            )
        try:
            query = parse_qs(req.raw_query, keep_blank_values=True, max_num_fields=32)
        except ValueError:
            raise Refused("too many query parameters", who) from None
        services = query.get("service", [])
        if services != [realm.service]:
            raise Refused(
                f"signed for service {','.join(services)[:100]!r}, not this server's "
                f"{realm.service!r}",
                f"{who}, at {origin[:200]}",
            )
        ts_text = query.get("ts", [""])[0]
        nonce = query.get("nonce", [""])[0]
        now = time.time()
        if not ts_text.isdigit() or len(ts_text) > 12 or abs(int(ts_text) - now) > TS_WINDOW:
            raise Refused(
                f"timestamp {ts_text[:20]!r} is more than {TS_WINDOW} s from the server's clock",
                who,
            )
        if not nonce:
            raise Refused("no nonce", who)
        self._forget_nonces(now)
        if (blob, nonce) in self._nonces:
            raise Refused("nonce replayed", who)
        if len(self._nonces) >= MAX_NONCES:
            raise Refused("too many sign-ins; try again in a few minutes", who)
        # Kept while its `ts` could still pass the window check (ts <= now + TS_WINDOW);
        # counting from now keeps the dict in expiry order.
        self._nonces[(blob, nonce)] = now + 2 * TS_WINDOW
        log.info("sign-in from %s: %s", req.client or "?", who)
        return key.key_id

    def _forget_nonces(self, now: float) -> None:
        while self._nonces:
            first, until = next(iter(self._nonces.items()))
            if until >= now:
                break
            del self._nonces[first]

    # -- signed blob URLs ------------------------------------------------------------------
    def sign_path(self, path: str, grant: str) -> str:
        """`path?expires=…&grant=…&signature=…`: lets reads of exactly this path in until
        then, while `grant` holds (grant_alive)."""
        return signed_url(path, str(int(time.time() + self.url_ttl)), grant, self._secret)

    def url_grant(self, path: str, expires: str, grant: str, signature: str) -> str:
        """The canonical signed URL of a good, unexpired one whose grant holds; Refused
        otherwise."""
        if (
            not expires.isdigit()
            or len(expires) > 12
            or len(grant) > MAX_NONCE
            or not hmac.compare_digest(signature, self._mac("url", expires, f"{grant}\n{path}"))
        ):
            raise Refused("it does not match its signature", path[:200])
        if int(expires) < time.time():
            raise Refused("it expired", path[:200])
        if not self.grant_alive(grant):
            raise Refused(
                "the key it was given to is no longer authorized", f"{grant}, {path[:200]}"
            )
        return signed_url(path, expires, grant, self._secret)

    def _mac(self, purpose: str, expires: str, subject: str) -> str:
        return _mac(self._secret, purpose, expires, subject)

    # -- peers ---------------------------------------------------------------------------
    def peer_request_ok(self, credential: str, method: str, target: str) -> bool:
        """Is `credential` (after PEER_SCHEME) a sync daemon's proof that it holds the static
        token, made for this request (`peer_authorization`: method, path and query), fresh
        and not seen before?"""
        if self._token_hash is None or len(credential) > MAX_CREDENTIAL:
            return False
        parts = credential.strip().split(".")
        if len(parts) != 3:
            return False
        ts, nonce, mac = parts
        if not ts.isdigit() or len(ts) > 12 or not 0 < len(nonce) <= MAX_NONCE:
            return False
        expected = _mac(self._token_hash, "peer-request", f"{ts}.{nonce}", _subject(method, target))
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return False
        now = time.time()
        if abs(int(ts) - now) > TS_WINDOW:
            # Made with our token, so a peer of ours whose clock is off: said, since nothing
            # else would tell its operator why every request is refused.
            log.warning(
                "a peer's proof of the token is dated %+d s from this host's clock (more than "
                "%d s): refused; set both hosts' clocks (NTP)",
                int(ts) - int(now),
                TS_WINDOW,
            )
            return False
        while self._peer_nonces and next(iter(self._peer_nonces.values())) < now:
            self._peer_nonces.popitem(last=False)
        if nonce in self._peer_nonces:
            log.warning("a peer request's nonce was sent again (a replay?): refused")
            return False
        if len(self._peer_nonces) >= MAX_NONCES:
            self._peer_nonces.popitem(last=False)  # the oldest; its window is nearly over
        # Kept while its `ts` could still pass the window check; in expiry order.
        self._peer_nonces[nonce] = now + 2 * TS_WINDOW
        return True

    def prove(self, nonce: str, path: str, body: bytes) -> str | None:
        """This server's answer to a peer's nonce for `body` (`proof_ok`), or None without
        a token."""
        if self._token_hash is None:
            return None
        return _mac(self._token_hash, "peer-proof", nonce, _proven(path, body))


def signed_url(path: str, expires: str, grant: str, secret: bytes) -> str:
    mac = _mac(secret, "url", expires, f"{grant}\n{path}")
    return f"{path}?expires={expires}&grant={quote(grant, safe='')}&signature={mac}"


def _mac(key: bytes, purpose: str, nonce: str, subject: str) -> str:
    data = f"{purpose}\n{nonce}\n{subject}".encode()
    digest = hmac.new(key, data, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


# Sync daemons that share a token never send it to each other; each side proves it holds it.
# A request carries `Authorization: Modelfs-Peer <ts>.<nonce>.<mac>`, an HMAC keyed by the
# token's sha256 over the time, a fresh nonce, the method, the path and the query: good for
# that request only, within TS_WINDOW of the server's clock, once (a server remembers the
# nonces it took). A daemon takes a peer's catalog and manifests only when the answer carries
# `Modelfs-Peer-Proof`, an HMAC of another fresh nonce it sent, the path and the sha256 of the
# body, checked before the body is used. Anything else that listens on a peer's address (a
# tokenless `modelfs serve`, one with another token) learns no token from what it is sent,
# cannot answer for a real peer it relays to with a body of its own, and so cannot choose what
# a tag becomes on every host.
PEER_SCHEME = "Modelfs-Peer"
PROOF_NONCE_HEADER = "Modelfs-Peer-Nonce"
PROOF_HEADER = "Modelfs-Peer-Proof"
MAX_NONCE = 128  # longer nonces are not answered: a header's worth, no more


def proof_path(path: str) -> str:
    """What a proof covers: the path from `/v2/` on, so a peer behind a reverse proxy that
    serves it under a prefix (`https://host/models/v2/…`) proves the same path it sees."""
    at = path.find("/v2/")
    return path[at:] if at >= 0 else path


def new_nonce() -> str:
    return secrets.token_urlsafe(24)


def proof_ok(token: str, nonce: str, path: str, given: str | None, body: bytes) -> bool:
    """Does `given` (the peer's PROOF_HEADER) prove it holds `token` and sent `body`?
    Constant-time."""
    if not given:
        return False
    expected = _mac(token_hash(token), "peer-proof", nonce, _proven(proof_path(path), body))
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def peer_authorization(token: str, method: str, target: str) -> str:
    """The `Authorization` a sync daemon sends a peer: proof that it holds `token`, made for
    this one request (`Access.peer_request_ok`; `target` is the path and query as sent), never
    the token itself."""
    ts, nonce = str(int(time.time())), new_nonce()
    mac = _mac(token_hash(token), "peer-request", f"{ts}.{nonce}", _subject(method, target))
    return f"{PEER_SCHEME} {ts}.{nonce}.{mac}"


def _subject(method: str, target: str) -> str:
    """What a peer request's proof covers: the method and the whole request target, the
    query too (a listing's `n` and `last` choose what it answers)."""
    path, mark, query = target.partition("?")
    return f"{method.upper()} {proof_path(path)}{mark}{query}"


def _proven(path: str, body: bytes) -> str:
    return f"{path}\n{hashlib.sha256(body).hexdigest()}"


def _fingerprint(blob: bytes) -> str:
    """`SHA256:…`, as `ssh-keygen -lf` shows a key."""
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"
