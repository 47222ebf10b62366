"""Ollama's `ollama pull`, transcribed from its Go source (ollama/ollama fb30760), for tests.

    client = OllamaClient(home)            ~/.ollama/id_ed25519 made on first use (real ed25519)
    client.pull("127.0.0.1:PORT/library/llama3.2:3b", insecure=True)
    client.log                             every request: (method, url, headers, status)

What is transcribed, and from where (file:line at fb30760):
- The name: `HOST/ns/model:tag`, https unless `--insecure` (types/model/name.go:317-330 BaseURL,
  DisplayNamespaceModel; server/images.go:1017-1019, 1371-1373).
- `pullModelManifest` (images.go:1272-1294): `GET /v2/<ns>/<model>/manifests/<tag>` with
  `Accept: application/vnd.docker.distribution.manifest.v2+json` only, through
  `makeRequestWithRetry` (images.go:1309-1353): two tries; a 401 parses the challenge
  (images.go:1414-1445 getValue/parseRegistryChallenge, quoted values only) and signs in
  (server/auth.go:28-99); a 404 is "not found", any other >= 400 an error with the body.
  Every request from `makeRequest` (images.go:1370-1412) carries `User-Agent: ollama/…` and,
  once it has one, `Authorization: Bearer <token>`; redirects are followed (Go's default).
- Sign-in (server/auth.go:28-99, auth/auth.go:44-85): the realm's query gets `service`, every
  space-separated `scope`, `ts` (Unix seconds) and `nonce` (16 random bytes, base64 RawURL),
  encoded as url.Values.Encode (keys sorted, QueryEscape); the realm's host must equal the
  request's host:port (auth.go:60); the signature is `<b64 ssh pubkey blob>:<b64 ed25519 sig>`
  over `GET,<URL>,<b64(hex(sha256("")))>`; the answer is `{"token": …}`.
- Layers with `application/vnd.ollama.image.tensor` go through x/transfer (images.go:1027-1047,
  1138-1211; x/transfer/download.go:166-440): per blob, `resolve` GETs the blob URL with the
  Bearer token and drains the body, taking a 200 as the URL itself (download.go:400-440); then
  `downloadOnce` GETs it again and hashes while writing `<blob>.tmp` (download.go:217-338);
  `User-Agent: ollama-transfer/1.0`, redirects not followed (x/transfer/transfer.go:108,122-130).
- Other models, blob by blob (images.go:1049-1071; server/download.go:476-517): a blob already
  in blobs/ is a cache hit; else `Prepare` (download.go:130-185) HEADs it for Content-Length and
  cuts parts of clamp(total/16, 100 MB, 1000 MB) (download.go:99-103, 158-177), each recorded in
  `<blob>-partial-N` as JSON; `run` (download.go:218-331) makes one GET without Range through
  makeRequestWithRetry, following redirects only to the same hostname (download.go:242-256),
  takes 200 or 307 and then `resp.Location()` (download.go:267-270; Go resolves a relative
  Location against the request URL), leaving the body unread; the parts, at most 16 at once
  (download.go:277-309), GET that URL with `Range: bytes=a-b` through http.DefaultClient, with
  no Authorization and no status check, copying part.Size bytes into `<blob>-partial` at the
  part's offset (download.go:333-365); a short body is retried (maxRetries 6, download.go:31,
  285-307; the 2^try s sleeps are `retry_sleep` here so a failing test does not wait a minute).
  Then the part files go and `<blob>-partial` is renamed to the blob (download.go:315-330).
- Every blob that was not a cache hit is sha256-checked, removed on mismatch (images.go:1073-
  1090, 1449-1467), and the manifest bytes are written as received to
  `manifests/<host>/<ns>/<model>/<tag>` (images.go:1097-1111; name.go:292-302 Filepath).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote_plus, urlencode, urljoin, urlsplit, urlunsplit

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_ssh_private_key,
)

ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"  # images.go:1276
USER_AGENT = "ollama/0.0.0 (amd64 linux) Go/go1.24.0"  # images.go:1392's shape
TRANSFER_AGENT = "ollama-transfer/1.0"  # x/transfer/transfer.go:108
GO_AGENT = "Go-http-client/1.1"  # http.DefaultClient's, download.go:345
# Go's Transport asks for gzip itself (and decodes it) unless the request has a Range; then it
# sends no Accept-Encoding, which "identity" stands for here (httpx would add its own list).
GO_ENCODING = "gzip"
GO_RANGE_ENCODING = "identity"
TENSOR = "application/vnd.ollama.image.tensor"  # manifest/layer.go:21
NUM_PARTS = 16  # download.go:100
MIN_PART = 100 * 1000 * 1000  # download.go:101 (format.MegaByte is 1000*1000)
MAX_PART = 1000 * 1000 * 1000  # download.go:102
MAX_RETRIES = 6  # download.go:31
EMPTY_BODY = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()


class OllamaError(Exception):
    """What `ollama pull` would print after `Error: `."""


@dataclass
class Logged:
    method: str
    url: str
    headers: dict[str, str]
    status: int
    location: str | None = None


@dataclass
class RegOpts:
    """registryOptions (server/images.go): what carries the token between requests."""

    insecure: bool = False
    token: str = ""


@dataclass
class OllamaClient:
    home: Path
    retry_sleep: float = 0.0
    timeout: float = 60.0
    log: list[Logged] = field(default_factory=list)
    part_sizes: dict[str, list[int]] = field(default_factory=dict)
    # digest -> seconds from its HEAD to its sha256 check done (the GGUF path), for benches,
    # and the part of that spent in the check
    seconds: dict[str, float] = field(default_factory=dict)
    hash_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models = self.home / ".ollama" / "models"
        self.key_path = self.home / ".ollama" / "id_ed25519"
        if not self.key_path.exists():
            # What `ollama serve` makes on first start: an OpenSSH ed25519 key pair.
            self.key_path.parent.mkdir(parents=True, exist_ok=True)
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
            self.key_path.write_bytes(pem)
            self.key_path.chmod(0o600)
            pub = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
            self.key_path.with_suffix(".pub").write_bytes(pub + b" ollama@test\n")
        (self.models / "blobs").mkdir(parents=True, exist_ok=True)
        # Plain http on loopback: no CA bundle to load (that costs ~0.5 s per client).
        self.http = httpx.Client(timeout=self.timeout, follow_redirects=False, verify=False)
        # http.DefaultClient, shared by every part (download.go:345): redirects followed.
        self.plain = httpx.Client(timeout=self.timeout, follow_redirects=True, verify=False)

    def close(self) -> None:
        self.http.close()
        self.plain.close()

    @property
    def public_key(self) -> str:
        """The `.pub` line, as an admin copies it into the server's keys file."""
        return self.key_path.with_suffix(".pub").read_text().strip()

    # -- auth/auth.go --------------------------------------------------------------------
    def sign(self, data: bytes) -> str:
        """auth.Sign (auth/auth.go:53-85): `<b64 pubkey blob>:<b64 raw ed25519 sig>`."""
        key = load_ssh_private_key(self.key_path.read_bytes(), None)
        assert isinstance(key, Ed25519PrivateKey)
        pub = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
        blob = pub.split(b" ")[1].strip().decode()
        return f"{blob}:{base64.b64encode(key.sign(data)).decode()}"

    # -- server/auth.go ------------------------------------------------------------------
    @staticmethod
    def challenge_url(realm: str, service: str, scope: str, *, ts: int | None = None) -> str:
        """registryChallenge.URL (auth.go:28-51)."""
        parts = urlsplit(realm)
        values: list[tuple[str, str]] = parse_qsl(parts.query, keep_blank_values=True)
        values.append(("service", service))
        values.extend(("scope", s) for s in scope.split(" "))
        values.append(("ts", str(int(time.time()) if ts is None else ts)))
        nonce = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        values.append(("nonce", nonce))
        # url.Values.Encode: sorted by key (stable for repeated keys), QueryEscape'd.
        values.sort(key=lambda kv: kv[0])
        query = urlencode(values, quote_via=quote_plus)
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))

    def get_token(self, challenge: dict[str, str], original_host: str) -> str:
        """getAuthorizationToken (auth.go:53-100)."""
        url = self.challenge_url(challenge["realm"], challenge["service"], challenge["scope"])
        host = urlsplit(url).netloc
        if host != original_host:
            raise OllamaError(f'realm host "{host}" does not match original host "{original_host}"')
        signature = self.sign(f"GET,{url},{EMPTY_BODY}".encode())
        r = self._request("GET", url, {"Authorization": signature}, RegOpts(), follow=True)
        body = r.read()
        r.close()
        if r.status_code >= 400:
            raise OllamaError(f"{r.status_code}: {body.decode(errors='replace')}")
        return str(json.loads(body)["token"])

    # -- server/images.go ----------------------------------------------------------------
    @staticmethod
    def parse_challenge(header: str) -> dict[str, str]:
        """parseRegistryChallenge + getValue (images.go:1414-1445), quirks included."""
        header = header.removeprefix("Bearer ")

        def get_value(key: str) -> str:
            start = header.find(key + "=")
            if start == -1:
                return ""
            start += len(key) + 2
            end = start
            while end < len(header):
                if header[end] == '"':
                    if end + 1 < len(header) and header[end + 1] != ",":
                        end += 1
                        continue
                    break
                end += 1
            return header[start:end]

        return {k: get_value(k) for k in ("realm", "service", "scope")}

    def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None,
        opts: RegOpts,
        *,
        follow: bool | str = True,
        agent: str = USER_AGENT,
    ) -> httpx.Response:
        """makeRequest (images.go:1370-1412); `follow="same-host"` is run's CheckRedirect."""
        parts = urlsplit(url)
        if parts.scheme != "http" and opts.insecure:
            url = urlunsplit(("http", *parts[1:]))
        sent = dict(headers or {})
        if opts.token:
            sent["Authorization"] = f"Bearer {opts.token}"
        sent["User-Agent"] = agent
        sent.setdefault("Accept-Encoding", GO_ENCODING)
        first_host = urlsplit(url).hostname
        for _ in range(11):
            request = self.http.build_request(method, url, headers=sent)
            response = self.http.send(request, stream=True)
            self.log.append(
                Logged(method, url, sent, response.status_code, response.headers.get("location"))
            )
            location = response.headers.get("location")
            if response.status_code not in (301, 302, 303, 307, 308) or not location or not follow:
                return response
            target = urljoin(url, location)
            if follow == "same-host" and urlsplit(target).hostname != first_host:
                return response  # http.ErrUseLastResponse
            response.close()
            url = target
        raise OllamaError(f"{method} {url}: stopped after 10 redirects")

    def request_with_retry(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None,
        opts: RegOpts,
        *,
        follow: bool | str = True,
    ) -> httpx.Response:
        """makeRequestWithRetry (images.go:1309-1353)."""
        for _ in range(2):
            r = self._request(method, url, headers, opts, follow=follow)
            if r.status_code == 401:
                r.close()
                challenge = self.parse_challenge(r.headers.get("www-authenticate", ""))
                opts.token = self.get_token(challenge, urlsplit(url).netloc)
                continue
            if r.status_code == 404:
                r.close()
                raise OllamaError("file does not exist")
            if r.status_code >= 400:
                body = r.read()
                r.close()
                raise OllamaError(f"{r.status_code}: {body.decode(errors='replace')}")
            return r
        raise OllamaError("unauthorized: access denied")

    def pull(self, name: str, *, insecure: bool = False) -> Path:
        """PullModel (images.go:998-1125); the written manifest's path."""
        host, rest = name.split("/", 1)
        namespace, model_tag = rest.split("/", 1)
        model, _, tag = model_tag.partition(":")
        tag = tag or "latest"
        base = f"https://{host}"
        opts = RegOpts(insecure=insecure)
        r = self.request_with_retry(
            "GET", f"{base}/v2/{namespace}/{model}/manifests/{tag}", {"Accept": ACCEPT}, opts
        )
        data = r.read()
        r.close()
        manifest: dict[str, Any] = json.loads(data)
        layers = list(manifest.get("layers") or [])
        if (manifest.get("config") or {}).get("digest"):
            layers.append(manifest["config"])
        repo_url = f"{base}/v2/{namespace}/{model}"
        if any(layer.get("mediaType") == TENSOR for layer in layers):
            self._pull_with_transfer(repo_url, layers, opts)
        else:
            skip_verify: dict[str, bool] = {}
            for layer in layers:
                started = time.perf_counter()
                hit = self._download_blob(repo_url, layer["digest"], opts)
                self.seconds[layer["digest"]] = time.perf_counter() - started
                skip_verify[layer["digest"]] = skip_verify.get(layer["digest"], hit) and hit
            for layer in layers:
                if not skip_verify[layer["digest"]]:
                    started = time.perf_counter()
                    self._verify_blob(layer["digest"])
                    self.hash_seconds[layer["digest"]] = time.perf_counter() - started
                    self.seconds[layer["digest"]] += self.hash_seconds[layer["digest"]]
        path = self.models / "manifests" / host / namespace / model / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def blob_path(self, digest: str) -> Path:
        return self.models / "blobs" / digest.replace(":", "-")

    def _verify_blob(self, digest: str) -> None:
        path = self.blob_path(digest)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(4 << 20):
                h.update(chunk)
        if f"sha256:{h.hexdigest()}" != digest:
            path.unlink()
            raise OllamaError(f"digest mismatch, file must be downloaded again: want {digest}")

    # -- server/download.go --------------------------------------------------------------
    def _download_blob(self, repo_url: str, digest: str, opts: RegOpts) -> bool:
        """downloadBlob (download.go:476-517): True for a cache hit."""
        path = self.blob_path(digest)
        if path.exists():
            return True
        url = f"{repo_url}/blobs/{digest}"
        # Prepare (download.go:130-185), without part files left from before.
        r = self.request_with_retry("HEAD", url, None, opts)
        r.close()
        total = int(r.headers.get("content-length", "0"))
        size = min(max(total // NUM_PARTS, MIN_PART), MAX_PART)
        parts: list[dict[str, int]] = []
        offset = 0
        while offset < total:
            if offset + size > total:
                size = total - offset
            part = {"N": len(parts), "Offset": offset, "Size": size, "Completed": 0}
            parts.append(part)
            self._write_part(path, part)
            offset += size
        self.part_sizes[digest] = [p["Size"] for p in parts]
        # run (download.go:218-331)
        partial = Path(f"{path}-partial")
        with open(partial, "wb") as f:
            f.truncate(total)
        r = self.request_with_retry(
            "GET", url, None, RegOpts(opts.insecure, opts.token), follow="same-host"
        )
        r.close()  # the body is never read
        if r.status_code not in (200, 307):
            raise OllamaError(f"unexpected status code {r.status_code}")
        location = r.headers.get("location")
        if location is None:
            raise OllamaError("http: no Location header in response")
        direct = urljoin(str(r.request.url), location)
        with ThreadPoolExecutor(NUM_PARTS) as pool:
            for result in [pool.submit(self._part, direct, partial, path, p) for p in parts]:
                result.result()
        for part in parts:
            os.unlink(f"{partial}-{part['N']}")
        partial.rename(path)
        return False

    def _write_part(self, path: Path, part: dict[str, int]) -> None:
        Path(f"{path}-partial-{part['N']}").write_text(json.dumps(part) + "\n")

    def _part(self, direct: str, partial: Path, path: Path, part: dict[str, int]) -> None:
        """One part with its retries (download.go:285-307, downloadChunk 333-365)."""
        for attempt in range(MAX_RETRIES):
            start = part["Offset"] + part["Completed"]
            stop = part["Offset"] + part["Size"]
            want = part["Size"] - part["Completed"]
            # http.DefaultClient: its own User-Agent, no Authorization.
            headers = {
                "Range": f"bytes={start}-{stop - 1}",
                "User-Agent": GO_AGENT,
                "Accept-Encoding": GO_RANGE_ENCODING,
            }
            with self.plain.stream("GET", direct, headers=headers) as r:
                self.log.append(Logged("GET", direct, headers, r.status_code))
                n = 0
                with open(partial, "r+b") as f:
                    f.seek(start)
                    for chunk in r.iter_raw():  # io.CopyN: status unchecked
                        chunk = chunk[: want - n]
                        f.write(chunk)
                        n += len(chunk)
                        if n >= want:
                            break
            part["Completed"] += n
            self._write_part(path, part)
            if part["Completed"] == part["Size"]:
                return
            time.sleep(self.retry_sleep * 2**attempt)  # io.ErrUnexpectedEOF: retried
        raise OllamaError("max retries exceeded: unexpected EOF")

    # -- x/transfer/download.go ----------------------------------------------------------
    def _pull_with_transfer(
        self, repo_url: str, layers: list[dict[str, Any]], opts: RegOpts
    ) -> None:
        """pullWithTransfer (images.go:1138-1211) and x/transfer's download (download.go)."""
        base = repo_url.split("/v2/", 1)[0]
        if opts.insecure:
            base = "http://" + base.split("://", 1)[1]
        repo = repo_url.split("/v2/", 1)[1]
        for layer in layers:
            digest, size = layer["digest"], int(layer["size"])
            path = self.blob_path(digest)
            if path.exists() and path.stat().st_size == size:
                continue
            url = self._resolve(f"{base}/v2/{repo}/blobs/{digest}", base, opts)
            headers = {"User-Agent": TRANSFER_AGENT, "Accept-Encoding": GO_ENCODING}
            if urlsplit(url).netloc == urlsplit(base).netloc and opts.token:
                headers["Authorization"] = f"Bearer {opts.token}"
            with self.http.stream("GET", url, headers=headers) as r:
                self.log.append(Logged("GET", url, headers, r.status_code))
                if r.status_code not in (200, 206):
                    raise OllamaError(f"status {r.status_code}")
                h = hashlib.sha256()
                tmp = Path(f"{path}.tmp")
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                        h.update(chunk)
            if f"sha256:{h.hexdigest()}" != digest or tmp.stat().st_size != size:
                tmp.unlink()
                raise OllamaError("digest mismatch")
            tmp.rename(path)

    def _resolve(self, url: str, base: str, opts: RegOpts) -> str:
        """resolve (x/transfer/download.go:400-440)."""
        for _ in range(10):
            headers = {"User-Agent": TRANSFER_AGENT, "Accept-Encoding": GO_ENCODING}
            if opts.token:
                headers["Authorization"] = f"Bearer {opts.token}"
            with self.http.stream("GET", url, headers=headers) as r:
                for _chunk in r.iter_raw():
                    pass  # drained, as io.Copy(io.Discard, resp.Body)
                self.log.append(Logged("GET", url, headers, r.status_code))
            if r.status_code == 200:
                return url
            if r.status_code == 401:
                challenge = self.parse_challenge(r.headers.get("www-authenticate", ""))
                opts.token = self.get_token(challenge, urlsplit(base).netloc)
                continue
            if r.status_code in (301, 302, 307):
                target = urljoin(url, r.headers["location"])
                if urlsplit(target).netloc != urlsplit(url).netloc:
                    return target
                url = target
                continue
            raise OllamaError(f"status {r.status_code}")
        raise OllamaError("too many redirects")
