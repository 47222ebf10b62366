"""The httpx client every outgoing request uses, and the one place its errors become SyncErrors."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator

import httpx

from modelfs.sync.credentials import Credentials
from modelfs.sync.errors import (
    PeerAuthError,
    PeerError,
    PeerNotFoundError,
    PeerUnreachableError,
)

USER_AGENT = "modelfs/0.1"
# A stalled peer is one that sends nothing for this long; a slow one that keeps sending is fine.
READ_TIMEOUT = 30.0


def make_client(
    credentials: Credentials | None = None,
    *,
    read_timeout: float = READ_TIMEOUT,
    verify: bool | str | ssl.SSLContext = True,
) -> httpx.AsyncClient:
    """An httpx client that sends `credentials` with every request (httpx drops the header
    on a redirect to another host, such as a registry's blob storage)."""
    headers = {"User-Agent": USER_AGENT}
    if credentials is not None:
        headers["Authorization"] = credentials.authorization
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(connect=10.0, read=read_timeout, write=read_timeout, pool=None),
        follow_redirects=True,
        verify=verify,
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
    )


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
    raise PeerError(f"{where}: HTTP {status} while fetching {what}")


@contextlib.contextmanager
def mapped_errors(url: str, what: str) -> Iterator[None]:
    """Map httpx's transport errors to PeerUnreachableError/PeerError, one line each."""
    try:
        yield
    except httpx.TimeoutException:
        raise PeerUnreachableError(f"{url}: timed out while fetching {what}") from None
    except httpx.ConnectError as exc:
        raise PeerUnreachableError(f"{url}: cannot connect ({_reason(exc)})") from None
    except httpx.RemoteProtocolError as exc:
        raise PeerError(f"{url}: broken response while fetching {what} ({_reason(exc)})") from None
    except httpx.TransportError as exc:
        raise PeerUnreachableError(f"{url}: {_reason(exc)} while fetching {what}") from None


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
