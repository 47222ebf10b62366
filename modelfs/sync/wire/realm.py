"""This server's own realm: what an Ollama sign-in must have been signed for to count here.

    realm = Realm("gpu-01", names=["models.internal"], public_urls=["https://models.example"])
    realm.service                              "modelfs:gpu-01", handed out in the challenge
    realm.ours("http", "gpu-01:11500", ("10.0.0.5", 11500))    a Host header naming us?
    realm.origin("http", "gpu-01:11500")       "http://gpu-01:11500", where its URLs begin

Ollama signs `GET,<realm URL with its query>,<body hash>` (ollama/ollama fb30760
server/auth.go:53-66), where the realm URL is the one our challenge gave, on the host and port
Ollama asked (auth.go:59-62), and the query holds the challenge's `service`. A server that
rebuilds that URL from the request's own `Host` header and checks nothing else takes a
signature an Ollama host made for any other registry it signs in to: the URL is the other
registry's, and so is the Host the attacker sends. So a signature counts only when

- the host and port it was made for are ours: a `public_url` (any scheme, host, port), or one
  of our names (the hostname, the listen address, the TLS certificate's names, and `names`;
  `localhost` on a loopback connection) or the very address the connection reached, on the
  port it reached;
- its `service` is ours, `modelfs:<host id>`: a host of the same fleet answers to other names
  and hands out another service, so what an Ollama host signed for it buys nothing here.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
_SERVICE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str  # lowercase, no brackets, no trailing dot
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = DEFAULT_PORTS.get(self.scheme)
        return f"{self.scheme}://{host}" + ("" if self.port == default else f":{self.port}")


def service_of(host_id: str) -> str:
    """The `service` this host hands out: its host id, in characters that need no quoting in
    a challenge or escaping in a query."""
    return "modelfs:" + (_SERVICE_CHARS.sub("-", host_id).strip("-") or "host")


def split_host(header: str, scheme: str) -> tuple[str, int] | None:
    """(host, port) of a `Host` header, normalised; None when it is no host[:port]."""
    try:
        parts = urlsplit(f"//{header}")
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").rstrip(".")
    if not host or parts.username is not None or parts.path or parts.query:
        return None
    if port is None:
        port = DEFAULT_PORTS.get(scheme, 0)
    return host.lower(), port


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_public_url(url: str) -> Origin:
    """`https://models.example[:port][/]`: ValueError with a line for the user otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{url!r}: not an http:// or https:// URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{url!r}: give only scheme, host and port (no path, query or user)")
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise ValueError(f"{url!r}: not a valid port") from None
    return Origin(parts.scheme, parts.hostname.rstrip(".").lower(), port)


class Realm:
    """The origins a sign-in may have been signed for, and the service it must name."""

    def __init__(
        self,
        host_id: str,
        *,
        names: Iterable[str] = (),
        public_urls: Iterable[str] = (),
    ) -> None:
        self.service = service_of(host_id)
        hostname = socket.gethostname()
        own = {hostname, hostname.partition(".")[0], *names}
        self.names = frozenset(n.strip("[]").rstrip(".").lower() for n in own if n)
        self.public = tuple(parse_public_url(u) for u in public_urls)

    def origin(self, scheme: str, host_header: str) -> str:
        """`scheme://<Host header>`: how the URL a client was given for that host begins, so
        what Ollama signed for it. A public URL's scheme where the header names one: behind
        a proxy that ends TLS, a request for `https://…` arrives here as plain http."""
        public = self._public(host_header)
        return f"{public.scheme if public is not None else scheme}://{host_header}"

    def ours(self, scheme: str, host_header: str, local: tuple[str, int] | None) -> bool:
        """Is the host and port in `host_header` this server's? `local` is the address and
        port the connection reached (ASGI's `server`)."""
        if self._public(host_header) is not None:
            return True
        hostport = split_host(host_header, scheme)
        if hostport is None or local is None or hostport[1] != local[1]:
            return False
        host, reached = hostport[0], _address(local[0])
        if host == "localhost":
            # Every host is its own localhost: the name is ours only on a connection that
            # came over loopback (a remote client signed it for a registry of its own).
            return reached is not None and reached.is_loopback
        addr = _address(host)
        return host in self.names or (addr is not None and addr == reached)

    def _public(self, host_header: str) -> Origin | None:
        for origin in self.public:
            # Go's URL.Host leaves out a port that is the scheme's own.
            if split_host(host_header, origin.scheme) == (origin.host, origin.port):
                return origin
        return None

    def describe(self, local: tuple[str, int] | None) -> str:
        """What this server answers to, for the log line of a refusal."""
        port = f":{local[1]}" if local is not None else ""
        where = [f"{n}{port}" for n in sorted(self.names)]
        if local is not None:
            where.append(f"{local[0]}{port}")
        where += [str(o) for o in self.public]
        return ", ".join(where)
