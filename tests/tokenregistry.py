"""A registry that signs clients in with the Docker/OCI token flow, as a process, for tests.

    python tests/tokenregistry.py --dir D --user alice:pw [--cdn] [--throttle N] [--expires S]
    -> prints `READY <registry URL> <CDN URL or ->` once both listen

What it does, as Docker Hub, GHCR or Harbor do (the distribution project's token spec):
- every `/v2/` request wants `Authorization: Bearer <token>` good for its repository and
  action, else 401 `WWW-Authenticate: Bearer realm="<URL>/token",service="tokenreg",
  scope="repository:<repo>:<actions>"`;
- `GET /token?service=&scope=` gives tokens: `pull` of any repository not under `private/` to
  anyone (anonymously too); `private/…` and every `push` only to a user of `--user` signed in
  with Basic; a wrong password is 401. Tokens last `--expires` seconds (`expires_in`);
- `--cdn`: blob GETs are 307 redirects to a second listener (the "CDN") with a signed URL; the
  CDN answers 400 to any request carrying `Authorization`, as S3 does;
- `--throttle N`: the first N manifest and blob GETs are 429 with `Retry-After: 1`
  (`--retry-after S`);
- `--token-uses N`: the first token issued to each user (and the first anonymous one) is
  refused (401) after N requests, before its expiry, as a revoked one is;
- `POST /token` with `grant_type=refresh_token` trades an identity token of `--identity` for a
  token (`access_token`);
- `--challenges combined`: the 401 offers `Basic realm="tokenreg"` first and the Bearer
  challenge after it, in one `WWW-Authenticate` (RFC 9110 11.6.1 allows a list);
  `--challenges split`: the same two as two headers;
- `_catalog` to signed-in users (scope `registry:catalog:*`);
- pushes: POST/PATCH/PUT uploads and manifest PUTs, kept in memory and in `--dir`.

`GET /_stats` (no sign-in) is what it saw: token requests (user, scopes), requests (method,
path, the kind of Authorization), CDN requests (with or without Authorization), 429s sent.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

SERVICE = "tokenreg"


class State:
    def __init__(self, root: Path, users: dict[str, str], expires: float, throttle: int) -> None:
        self.root = root
        self.users = users
        self.expires = expires
        self.throttle = throttle
        self.retry_after = 1
        self.token_uses = 0  # >0: a token is refused after this many requests
        self.challenges = "one"  # how a 401 offers its challenges (--challenges)
        self.uses: dict[str, int] = {}
        self.revocable: set[str] = set()  # the first token issued to each user (and to nobody)
        self.refresh_tokens: dict[str, str] = {}  # identity token -> user
        self.lock = threading.Lock()
        self.tokens: dict[str, tuple[set[tuple[str, str]], float]] = {}
        self.manifests: dict[tuple[str, str], tuple[bytes, str]] = {}  # (repo, ref)
        self.uploads: dict[str, bytearray] = {}
        self.signed: dict[str, str] = {}  # signature -> digest
        self.stats: dict[str, Any] = {"tokens": [], "requests": [], "cdn": [], "throttled": 0}
        self.registry_url = ""
        self.cdn_url = ""

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest.replace(":", "-")


def _grant(state: State, user: str | None, scope: str) -> set[tuple[str, str]]:
    kind, _, rest = scope.partition(":")
    repo, _, actions = rest.rpartition(":")
    if scope == "registry:catalog:*":
        return {("catalog", "*")} if user is not None else set()
    if kind != "repository":
        return set()
    granted = set()
    for action in actions.split(","):
        if action == "pull" and (user is not None or not repo.startswith("private/")):
            granted.add((repo, "pull"))
        if action == "push" and user is not None:
            granted.add((repo, "push"))
    return granted


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State
    cdn = False

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            if k == "WWW-Authenticate" and self.state.challenges == "split":
                for one in v.split("\n"):
                    self.send_header(k, one)
                continue
            self.send_header(k, v.replace("\n", ", "))
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
        h = {"Content-Type": "application/json", **(headers or {})}
        self._send(status, json.dumps(obj).encode(), h)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_PATCH(self) -> None:
        self._route()

    def do_PUT(self) -> None:
        self._route()

    def do_DELETE(self) -> None:
        self._route()

    # -- routing -------------------------------------------------------------------------
    def _route(self) -> None:
        s = self.state
        u = urlsplit(self.path)
        if self.cdn:
            self._cdn(u.path, parse_qs(u.query))
            return
        if u.path == "/_stats":
            with s.lock:
                self._json(200, s.stats)
            return
        if u.path == "/token" and self.command == "POST":
            self._oauth(parse_qs(self._body().decode()))
            return
        if u.path == "/token":
            self._token(parse_qs(u.query))
            return
        auth = self.headers.get("Authorization", "")
        with s.lock:
            s.stats["requests"].append([self.command, u.path, auth.split(" ")[0]])
        if not u.path.startswith("/v2/"):
            self._send(404)
            return
        rest = u.path[len("/v2/") :]
        if rest == "":
            if self._allowed(auth, None, "pull"):
                self._json(200, {})
            else:
                self._challenge(None)
            return
        if rest == "_catalog":
            if not self._allowed(auth, "catalog", "*"):
                self._challenge("registry:catalog:*")
                return
            with s.lock:
                repos = sorted({r for (r, _) in s.manifests})
            self._json(200, {"repositories": repos})
            return
        for marker in ("/blobs/uploads/", "/manifests/", "/blobs/", "/tags/list"):
            if marker in rest:
                repo, _, tail = rest.partition(marker)
                break
        else:
            self._send(404)
            return
        action = "pull" if self.command in ("GET", "HEAD") else "push"
        if not self._allowed(auth, repo, action):
            self._body()
            self._challenge(f"repository:{repo}:{'pull' if action == 'pull' else 'pull,push'}")
            return
        if marker in ("/manifests/", "/blobs/") and self.command == "GET":
            with s.lock:
                throttle = s.throttle > 0
                if throttle:
                    s.throttle -= 1
                    s.stats["throttled"] += 1
            if throttle:
                wait = {"Retry-After": str(s.retry_after)}
                self._json(429, {"errors": [{"code": "TOOMANYREQUESTS"}]}, wait)
                return
        if marker == "/blobs/uploads/":
            self._upload(repo, tail, parse_qs(u.query))
        elif marker == "/manifests/":
            self._manifest(repo, tail)
        elif marker == "/blobs/":
            self._blob(tail)
        else:
            tags = sorted(ref for (r, ref) in s.manifests if r == repo and ":" not in ref)
            self._json(200, {"name": repo, "tags": tags})

    def _allowed(self, auth: str, repo: str | None, action: str) -> bool:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        s = self.state
        with s.lock:
            found = s.tokens.get(token)
            s.uses[token] = uses = s.uses.get(token, 0) + 1
        if found is None or found[1] < time.monotonic():
            return False
        if s.token_uses and uses > s.token_uses and token in s.revocable:
            return False  # revoked early: a client must take a new one, whatever its expiry
        return repo is None or (repo, action) in found[0]

    def _challenge(self, scope: str | None) -> None:
        params = f'realm="{self.state.registry_url}/token",service="{SERVICE}"'
        if scope:
            params += f',scope="{scope}"'
        self._json(
            401,
            {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
            {"WWW-Authenticate": self._offer(f"Bearer {params}")},
        )

    def _offer(self, bearer: str) -> str:
        """The challenges of a 401, one a line (`_send` puts them in one header or several)."""
        if self.state.challenges == "one":
            return bearer
        return f'Basic realm="{SERVICE}"\n{bearer}'

    def _token(self, query: dict[str, list[str]]) -> None:
        s = self.state
        user: str | None = None
        auth = self.headers.get("Authorization", "")
        if auth:
            scheme, _, value = auth.partition(" ")
            try:
                name, _, password = base64.b64decode(value).decode().partition(":")
            except ValueError:
                name, password = "", ""
            if scheme.lower() != "basic" or s.users.get(name) != password:
                with s.lock:
                    s.stats["tokens"].append({"user": name, "refused": True})
                self._json(401, {"details": "incorrect username or password"})
                return
            user = name
        token = self._issue(user, query.get("scope", []), service=query.get("service"))
        self._json(
            200, {"token": token, "expires_in": s.expires, "issued_at": "2026-01-01T00:00:00Z"}
        )

    def _issue(self, user: str | None, scopes: list[str], **noted: object) -> str:
        """A new token for what `user` may do of `scopes`, recorded in the stats."""
        s = self.state
        granted: set[tuple[str, str]] = set()
        for scope in scopes:
            granted |= _grant(s, user, scope)
        token = secrets.token_hex(16)
        with s.lock:
            s.tokens[token] = (granted, time.monotonic() + s.expires)
            if not any(t.get("user") == user for t in s.stats["tokens"]):
                s.revocable.add(token)
            s.stats["tokens"].append({"user": user, "scopes": scopes, **noted})
        return token

    def _oauth(self, form: dict[str, list[str]]) -> None:
        """The OAuth2 form docker sends with an identity token (a refresh token)."""
        s = self.state
        refresh = form.get("refresh_token", [""])[0]
        user = s.refresh_tokens.get(refresh)
        if form.get("grant_type") != ["refresh_token"] or user is None:
            self._json(401, {"error": "invalid_grant"})
            return
        scopes = " ".join(form.get("scope", [])).split()
        token = self._issue(user, scopes, grant="refresh_token")
        self._json(200, {"access_token": token, "expires_in": s.expires})

    # -- content -------------------------------------------------------------------------
    def _manifest(self, repo: str, ref: str) -> None:
        s = self.state
        if self.command == "PUT":
            raw = self._body()
            digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            kind = self.headers.get("Content-Type", "application/json")
            with s.lock:
                s.manifests[(repo, ref)] = (raw, kind)
                s.manifests[(repo, digest)] = (raw, kind)
            self._send(201, headers={"Docker-Content-Digest": digest, "Location": self.path})
            return
        with s.lock:
            found = s.manifests.get((repo, ref))
        if found is None:
            self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN"}]})
            return
        raw, kind = found
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        self._send(200, raw, {"Content-Type": kind, "Docker-Content-Digest": digest})

    def _blob(self, digest: str) -> None:
        s = self.state
        path = s.blob_path(digest)
        if not path.is_file():
            self._json(404, {"errors": [{"code": "BLOB_UNKNOWN"}]})
            return
        if self.command == "GET" and s.cdn_url:
            sig = secrets.token_hex(8)
            with s.lock:
                s.signed[sig] = digest
            self._send(307, headers={"Location": f"{s.cdn_url}/blob/{digest}?sig={sig}"})
            return
        self._file(path)

    def _file(self, path: Path) -> None:
        size = path.stat().st_size
        start, end = 0, size
        status = 200
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes="):
            a, _, b = wanted[6:].partition("-")
            start, end = int(a), min(size, int(b) + 1 if b else size)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    def _upload(self, repo: str, tail: str, query: dict[str, list[str]]) -> None:
        s = self.state
        if self.command == "POST":
            uid = secrets.token_hex(8)
            with s.lock:
                s.uploads[uid] = bytearray()
            self._body()
            location = f"/v2/{repo}/blobs/uploads/{uid}"
            self._send(202, headers={"Location": location, "Range": "0-0"})
            return
        uid = tail.strip("/")
        with s.lock:
            buf = s.uploads.get(uid)
        if buf is None:
            self._body()
            self._json(404, {"errors": [{"code": "BLOB_UPLOAD_UNKNOWN"}]})
            return
        if self.command == "DELETE":
            self._send(204)
            return
        buf += self._body()
        location = f"/v2/{repo}/blobs/uploads/{uid}"
        if self.command == "PATCH":
            self._send(202, headers={"Location": location, "Range": f"0-{len(buf) - 1}"})
            return
        digest = query.get("digest", [""])[0]
        if "sha256:" + hashlib.sha256(buf).hexdigest() != digest:
            self._json(400, {"errors": [{"code": "DIGEST_INVALID"}]})
            return
        path = s.blob_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(buf))
        self._send(
            201, headers={"Docker-Content-Digest": digest, "Location": f"/v2/{repo}/blobs/{digest}"}
        )

    def _cdn(self, path: str, query: dict[str, list[str]]) -> None:
        s = self.state
        auth = "Authorization" in self.headers
        with s.lock:
            s.stats["cdn"].append({"path": path, "authorization": auth})
            digest = s.signed.get(query.get("sig", [""])[0])
        if auth:
            self._send(
                400, b"<Error><Code>InvalidArgument</Code>Only one auth mechanism allowed</Error>"
            )
            return
        if digest is None or path != f"/blob/{digest}":
            self._send(403, b"<Error><Code>AccessDenied</Code></Error>")
            return
        self._file(s.blob_path(digest))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tokenregistry")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--user", action="append", default=[], help="USER:PASSWORD")
    p.add_argument("--cdn", action="store_true")
    p.add_argument("--throttle", type=int, default=0)
    p.add_argument("--retry-after", type=int, default=1)
    p.add_argument("--token-uses", type=int, default=0)
    p.add_argument("--identity", action="append", default=[], help="REFRESH_TOKEN:USER")
    p.add_argument("--expires", type=float, default=300)
    p.add_argument("--challenges", choices=["one", "combined", "split"], default="one")
    args = p.parse_args(argv)
    users = dict(u.split(":", 1) for u in args.user)
    state = State(args.dir, users, args.expires, args.throttle)
    state.retry_after = args.retry_after
    state.token_uses = args.token_uses
    state.challenges = args.challenges
    for item in args.identity:
        refresh, _, user = item.partition(":")
        state.refresh_tokens[refresh] = user
    (args.dir / "blobs").mkdir(parents=True, exist_ok=True)

    def serve(cdn: bool) -> ThreadingHTTPServer:
        handler = type("H", (Handler,), {"state": state, "cdn": cdn})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    registry = serve(False)
    state.registry_url = f"http://127.0.0.1:{registry.server_address[1]}"
    if args.cdn:
        cdn = serve(True)
        state.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
    print(f"READY {state.registry_url} {state.cdn_url or '-'}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()  # until the test closes our stdin (or kills us)


if __name__ == "__main__":
    main()
