"""Which proxy a request goes through: `HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`, `NO_PROXY`.

    rules = ProxyRules.from_environment()
    rules.proxy_for(url) -> httpx.URL | None        None: connect directly
    ProxyRouter(rules, tls, verify=…, limits=…)     the httpx transport that follows them

One decision for every request: the httpx client's transport routes each request (a
registry's, a token service's, a redirect's to a CDN) by `proxy_for`, and the large-blob
receiver (sync.client), which opens sockets of its own, asks the same `proxy_for` and speaks to
that proxy itself (absolute-form requests for http, CONNECT for https). httpx's own reading of
the environment is not used because it is not public, and the receiver must agree with it.

The variables are read as curl and Go read them: the lowercase name first, `https_proxy` for
https URLs, `http_proxy` for http ones, `all_proxy` for both when the scheme's own is unset; a
value without a scheme is `http://`. `NO_PROXY` is a comma-separated list of `*` (no proxy at
all), host names (`example.com` and `.example.com` both match it and its subdomains), IP
addresses, CIDR ranges (`10.0.0.0/8`, as Go reads them) and any of these with `:port`.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from modelfs.sync.wire.pins import PeerTls


def _env(env: Mapping[str, str], name: str) -> str:
    return (env.get(name.lower()) or env.get(name.upper()) or "").strip()


def _proxy_url(value: str) -> httpx.URL | None:
    if not value:
        return None
    return httpx.URL(value if "://" in value else f"http://{value}")


@dataclass(frozen=True, slots=True)
class ProxyRules:
    http: httpx.URL | None = None
    https: httpx.URL | None = None
    no_proxy: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> ProxyRules:
        env = os.environ if env is None else env
        every = _proxy_url(_env(env, "all_proxy"))
        http = _proxy_url(_env(env, "http_proxy")) or every
        https = _proxy_url(_env(env, "https_proxy")) or every
        entries = tuple(e.strip().lower() for e in _env(env, "no_proxy").split(",") if e.strip())
        return cls(http, https, entries)

    def proxy_for(self, url: str | httpx.URL) -> httpx.URL | None:
        u = httpx.URL(str(url))
        proxy = self.https if u.scheme == "https" else self.http if u.scheme == "http" else None
        if proxy is None or self.bypassed(u.host, u.port or (443 if u.scheme == "https" else 80)):
            return None
        return proxy

    def bypassed(self, host: str, port: int) -> bool:
        host = host.lower().strip("[]")
        try:
            address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(
                host
            )
        except ValueError:
            address = None
        for entry in self.no_proxy:
            if entry == "*":
                return True
            name, want_port = _split_port(entry)
            if want_port is not None and want_port != port:
                continue
            if address is not None:
                try:
                    if address in ipaddress.ip_network(name, strict=False):
                        return True
                except ValueError:
                    pass
                continue
            name = name.lstrip(".").lstrip("*.")
            if name and (host == name or host.endswith("." + name)):
                return True
        return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """`host:port`, `[v6]:port`, `1.2.3.4:80` -> (name, port); a bare IPv6 has no port."""
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        return name, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if entry.count(":") == 1:
        name, _, port = entry.partition(":")
        if port.isdigit():
            return name, int(port)
    return entry, None


class ProxyRouter(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request directly or through its proxy, as
    `rules.proxy_for` says (httpx's `AsyncHTTPTransport(proxy=…)` does the proxying itself:
    absolute-form requests for http, a CONNECT tunnel for https), with the TLS context
    `tls` holds for a pinned peer's origin (sync.pins), the `verify` given for the rest."""

    def __init__(self, rules: ProxyRules, tls: PeerTls | None = None, **transport: Any) -> None:
        self.rules = rules
        self.tls = tls
        self.transport = transport
        self.direct = httpx.AsyncHTTPTransport(**transport)
        self.routed: dict[tuple[str | None, ssl.SSLContext | None], httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        proxy = self.rules.proxy_for(url)
        context = None
        if self.tls is not None:
            default_port = 443 if url.scheme == "https" else 80
            context = self.tls.context_for(url.scheme, url.host, url.port or default_port)
        if proxy is None and context is None:
            return await self.direct.handle_async_request(request)
        key = (None if proxy is None else str(proxy), context)
        if key not in self.routed:
            settings = dict(self.transport)
            if context is not None:
                settings["verify"] = context
            self.routed[key] = httpx.AsyncHTTPTransport(proxy=proxy, **settings)
        return await self.routed[key].handle_async_request(request)

    async def aclose(self) -> None:
        await self.direct.aclose()
        for transport in self.routed.values():
            await transport.aclose()
