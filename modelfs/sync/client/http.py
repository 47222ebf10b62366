"""The httpx client every outgoing request uses, and the one place its errors become SyncErrors."""

from __future__ import annotations

import contextlib
import ssl
import zlib
from collections.abc import AsyncIterator, Iterator

import httpx

from modelfs.sync.client.credentials import Credentials, Logins
from modelfs.sync.client.proxies import ProxyRouter, ProxyRules
from modelfs.sync.client.tokenauth import MAX_WAIT, RegistryAuth, retry_delay
from modelfs.sync.errors import (
    PeerAuthError,
    PeerCertificateError,
    PeerError,
    PeerNotFoundError,
    PeerUnreachableError,
)
from modelfs.sync.wire.pins import UNPINNED, PeerTls, PinMismatch, pin_mismatch

USER_AGENT = "modelfs/0.1"
# A stalled peer is one that sends nothing for this long; a slow one that keeps sending is fine.
READ_TIMEOUT = 30.0
# What we take compressed, and how much a compressed body may grow in one step (`Inflating`).
ACCEPT_ENCODING = "gzip, deflate"
INFLATE_STEP = 64 << 10


def make_client(
    credentials: Credentials | Logins | None = None,
    *,
    read_timeout: float = READ_TIMEOUT,
    verify: bool | str | ssl.SSLContext = True,
    push: bool = False,
    proxies: ProxyRules | None = None,
    tls: PeerTls | None = None,
    peer_token: str | None = None,
) -> httpx.AsyncClient:
    """An httpx client for peers and registries: every request routed by the proxy rules
    (sync.proxies, the environment's by default) and signed in by `RegistryAuth` (a token
    file's header as it is; docker's credentials and tokens when a registry asks), which
    httpx keeps off redirects to another host, such as a registry's blob storage."""
    logins = credentials if isinstance(credentials, Logins) else Logins(credentials)
    rules = proxies if proxies is not None else ProxyRules.from_environment()
    timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=read_timeout, pool=None)

    # One transport (pool and proxies) for both: the token client needs no closing of its
    # own, since closing `http` closes it.
    transport = Inflating(
        ProxyRouter(
            rules,
            tls,
            verify=verify,
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )
    )

    def client(auth: httpx.Auth | None) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            headers={"User-Agent": USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
            timeout=timeout,
            follow_redirects=True,
            transport=transport,
            auth=auth,
        )

    return client(RegistryAuth(logins, client(None), push=push, peer_token=peer_token))


class Inflating(httpx.AsyncBaseTransport):
    """The transport under every client: a gzip or deflate body is inflated here, at most
    `INFLATE_STEP` bytes at a time, so a reader that caps what it takes (a manifest's 16 MiB,
    a blob's size) stops a compression bomb after that much. httpx inflates each received
    piece whole: 64 KiB of zeros compressed 1000:1 were 64 MiB in memory before any cap was
    looked at. We ask for no other coding (`ACCEPT_ENCODING`), and refuse one sent anyway."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        coding = response.headers.get("content-encoding", "").strip().lower()
        if coding in ("", "identity") or request.method == "HEAD":
            return response
        if coding not in ("gzip", "x-gzip", "deflate"):
            await response.aclose()
            raise httpx.DecodingError(f"Content-Encoding {coding[:40]!r}", request=request)
        # The length and coding were the compressed body's; what the caller reads is plain.
        dropped = (b"content-encoding", b"content-length")
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in dropped]
        stream = _Inflated(response, request)
        return httpx.Response(
            response.status_code, headers=headers, stream=stream, extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Inflated(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, request: httpx.Request) -> None:
        self.response = response
        self.request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # wbits 32+: a gzip or a zlib header, as the peer sent it (httpx reads deflate so too).
        inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)
        stream = self.response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        empty = True
        try:
            async for data in stream:
                empty = empty and not data
                while data and not inflater.eof:
                    piece = inflater.decompress(data, INFLATE_STEP)
                    data = inflater.unconsumed_tail
                    if piece:
                        yield piece
            if not inflater.eof and not empty:  # an empty body (a 404's, say) is no stream
                raise zlib.error("the compressed body ends early")
        except zlib.error as exc:
            raise httpx.DecodingError(f"cannot inflate: {exc}", request=self.request) from None

    async def aclose(self) -> None:
        await self.response.aclose()


def registry_auth(http: httpx.AsyncClient) -> RegistryAuth:
    """The `RegistryAuth` of a client `make_client` made."""
    auth = http.auth
    assert isinstance(auth, RegistryAuth)
    return auth


def raise_for_status(response: httpx.Response, what: str) -> None:
    """Turn a non-2xx answer into the matching PeerError, naming the URL and `what`."""
    if response.is_success:
        return
    status = response.status_code
    where = f"{response.request.method} {response.request.url}"
    if status in (401, 403):
        raise PeerAuthError(f"{where}: {status} (no or wrong token) while fetching {what}")
    if status == 404:
        raise PeerNotFoundError(f"{where}: 404, {what} not found")
    delay = retry_delay(response)
    if delay is not None:
        raise PeerError(
            f"{where}: HTTP {status} while fetching {what} (it asks to wait {delay:.0f} s; "
            f"modelfs waits at most {MAX_WAIT:.0f} s in all for one request)"
        )
    raise PeerError(f"{where}: HTTP {status} while fetching {what}")


async def read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    """A streamed answer's body, decoded, refused past `limit` bytes: a peer's endless or
    compressed body cannot fill memory."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise PeerError(f"{what}: more than {limit >> 20} MiB, more than it can be")
    return bytes(body)


@contextlib.contextmanager
def mapped_errors(url: str, what: str) -> Iterator[None]:
    """Map httpx's transport errors to PeerUnreachableError/PeerError, one line each."""
    try:
        yield
    except httpx.TimeoutException:
        raise PeerUnreachableError(f"{url}: timed out while fetching {what}") from None
    except httpx.ConnectError as exc:
        mismatch = pin_mismatch(exc)
        if mismatch is not None:
            raise certificate_error(url, mismatch) from None
        raise PeerUnreachableError(f"{url}: cannot connect ({_reason(exc)})") from None
    except (httpx.RemoteProtocolError, httpx.DecodingError) as exc:
        raise PeerError(f"{url}: broken response while fetching {what} ({_reason(exc)})") from None
    except httpx.TooManyRedirects:
        raise PeerError(f"{url}: too many redirects while fetching {what}") from None
    except httpx.TransportError as exc:
        raise PeerUnreachableError(f"{url}: {_reason(exc)} while fetching {what}") from None


def certificate_error(url: str, mismatch: PinMismatch) -> PeerCertificateError:
    """The one line for a peer whose certificate is not the one its `pin` names."""
    return PeerCertificateError(
        f"{url}: {UNPINNED} (it presents {mismatch.found or 'no certificate'}, the config pins "
        f"{mismatch.wanted}); nothing is taken from it"
    )


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
