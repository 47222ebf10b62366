"""Who the registry server answers: one access rule for every request (`check_access`), the
401 challenge Ollama and Docker clients follow, sign-in at the token endpoint, and the signed
URL a blob answer names in its Location."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import re

from modelfs.sync.registry.http import READ_ONLY_METHODS, HTTPError, Request, shown
from modelfs.sync.wire.signin import (
    PEER_SCHEME,
    STATIC_GRANT,
    TOKEN_PATH,
    Access,
    Refused,
    SignInRequest,
)

log = logging.getLogger(__name__)

MAX_TOKEN = 4096
_SCOPE_REPO = re.compile(r"[A-Za-z0-9._:/-]{1,500}")


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_access(access: Access, request: Request) -> None:
    """With a token or keys, every request must carry a credential, loopback too;
    without either, only loopback is served.

    Credentials: `Authorization: Bearer <token>` with the static token or one this
    server issued (Basic with the token as password is taken too, for clients that only
    know `--creds user:password`), a sync daemon's proof that it holds the static token
    (`Modelfs-Peer`, signin.peer_authorization), or a signed URL this server gave out in a
    Location.
    """
    if not access.enabled:
        if not _is_loopback(request.client):
            raise HTTPError(
                403,
                "DENIED",
                "this server has no token and serves loopback clients only",
            )
        return
    header = request.headers.get("authorization", "")
    scheme, _, value = header.strip().partition(" ")
    if scheme == PEER_SCHEME and access.peer_request_ok(value, request.method, request.target):
        request.grant = STATIC_GRANT
        return
    given = _credential(header)
    if given is not None and (grant := access.bearer_grant(given)) is not None:
        request.grant = grant
        return
    if "signature" in request.query and request.method in READ_ONLY_METHODS:
        try:
            request.signed_url = access.url_grant(
                request.raw_path.decode("latin-1"),
                request.query.get("expires", ""),
                request.query.get("grant", ""),
                request.query["signature"],
            )
        except Refused as exc:
            log.warning("signed URL from %s refused: %s", request.client, exc)
            raise unauthorized(access, request, f"signed URL refused: {exc.reason}") from None
        request.grant = request.query["grant"]
        return
    if header:
        log.info("%s %s: credential not accepted", request.client, shown(request))
    raise unauthorized(access, request, "authentication required")


def unauthorized(access: Access, request: Request, message: str) -> HTTPError:
    """A 401 whose challenge Ollama and Docker clients can follow: an absolute realm on
    the request's own scheme, host and port (Ollama requires the host, auth.go:59-62),
    and this server's own service, which a signature must name to count."""
    realm = f"{access.realm.origin(request.scheme, request.host)}{TOKEN_PATH}"
    challenge = f'Bearer realm="{realm}",service="{access.realm.service}"'
    parts = request.raw_path.decode("latin-1").split("/")
    if len(parts) >= 6 and parts[1] == "v2" and parts[-2] in ("manifests", "blobs"):
        repository = "/".join(parts[2:-2])
        if _SCOPE_REPO.fullmatch(repository):
            challenge += f',scope="repository:{repository}:pull"'
    return HTTPError(401, "UNAUTHORIZED", message, [("WWW-Authenticate", challenge)])


def signed_in(access: Access, request: Request) -> str:
    """Who a request to the realm is: a signed Ollama request, or (Docker's token flow) the
    static token as Bearer or Basic password; the grant a short-lived token is issued for."""
    header = request.headers.get("authorization", "")
    try:
        if not header.strip():
            raise Refused("no credential sent")
        if header.split(" ", 1)[0].lower() in ("bearer", "basic"):
            given = _credential(header)
            if given is None or not access.static_ok(given):
                raise Refused("credential not accepted")
            key_id = STATIC_GRANT
        else:
            key_id = access.sign_in(
                SignInRequest(
                    scheme=request.scheme,
                    host=request.headers.get("host", ""),
                    raw_path=request.raw_path.decode("latin-1"),
                    raw_query=request.raw_query,
                    authorization=header,
                    client=request.client,
                    local=request.local,
                )
            )
    except Refused as exc:
        log.warning("sign-in from %s refused: %s", request.client, exc)
        raise HTTPError(401, "UNAUTHORIZED", f"sign-in refused: {exc.reason}") from None
    return key_id


def location(access: Access, request: Request, path: str) -> str:
    """Where Ollama sends a blob's parts: the path itself when only loopback is served;
    the signed URL the request came by (never a fresh one, or a URL fetched again now
    and then would live for ever); else a new one for the request's grant."""
    if request.grant is None:
        return path
    if request.signed_url is not None:
        return request.signed_url
    return access.sign_path(path, request.grant)


def _credential(header: str) -> str | None:
    if not header or len(header) > MAX_TOKEN:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep else None
    return None
