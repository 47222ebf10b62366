"""Run an ASGI app with hypercorn on trio, until cancelled (then shut down gracefully).

    url = await nursery.start(serve, app, "127.0.0.1:0")     # "http://127.0.0.1:40123"
    ...
    nursery.cancel_scope.cancel()    # stop accepting, let requests in flight finish (≤ grace)

    run_server(root, listen=None, token_file=None, authorized_keys=None, tls_cert=None,
               tls_key=None, ready=print)
                                     # `modelfs serve`: until SIGTERM/SIGINT, then exit 0

We bind the socket ourselves and hand hypercorn its fd (`fd://N`): a busy port is one clear
error, and the URL carries the port the kernel chose for `:0`. With TLS only HTTP/1.1 is
offered: hypercorn's h2 moved a blob at ~150 MB/s where HTTP/1.1 over TLS gave ~780 MB/s.
On plain HTTP/1.1, blob bodies go out with sendfile(2) (`sync.zerocopy`, which runs hypercorn's
connections with the ASGI zero-copy send extension).

A client that stops reading pins a send that hypercorn shields from cancellation (a sendfile
body is not shielded, but TLS bodies, headers and small answers are). The
listener's TCP_USER_TIMEOUT (inherited by every connection) drops such a client after
`STALL_TIMEOUT_MS`; on a signal, `run_server` exits after `HARD_STOP` seconds whatever is left.

Limits for clients that are slow on purpose (`make_config`): a connection must send a whole
request's headers within `HEADER_TIMEOUT` of opening or of its last answer (hypercorn's
keep-alive timer, which runs until a request's headers are complete); a head still incomplete
past `MAX_HEADER_BYTES` is answered 431 (h11 takes a larger one that came whole in one 64 KiB
read: memory is bounded all the same); a TLS handshake must end within
`HANDSHAKE_TIMEOUT`. No endpoint reads a request body: the answer is sent, and the connection
closed, without waiting for one (sync.server drains it meanwhile). Hypercorn's `read_timeout`
stays unset: it times each read of the connection, and while a client downloads a blob it
sends nothing, so any value would cut every download longer than it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config

from modelfs.runtime.groups import unwrapped
from modelfs.sync.client.credentials import read_credentials
from modelfs.sync.errors import SyncError
from modelfs.sync.registry.zerocopy import serve_hypercorn
from modelfs.sync.wire.pins import names_of_cert_file, pin_of_cert_file

log = logging.getLogger(__name__)

GRACE = 5.0  # seconds a request in flight may take to finish after shutdown begins
STALL_TIMEOUT_MS = 20_000  # unacknowledged data this old: the client is gone or stalled
HEADER_TIMEOUT = 5.0  # seconds from a connection's start (or last answer) to a whole request head
HANDSHAKE_TIMEOUT = 10.0  # seconds for a TLS handshake
MAX_HEADER_BYTES = 16 << 10  # a request head still incomplete past this: 431
# Connections waiting to be accepted: at hypercorn's 100, a burst of connects (hundreds of
# idle sockets opened at once) overflowed it, and a client whose SYN was dropped waited 1 s
# for its retry. The kernel caps it at net.core.somaxconn.
BACKLOG = 1024
HARD_STOP = GRACE + 2.0  # `modelfs serve` exits this long after a signal, whatever is left
_LISTEN = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.%\w]+)\]|(?P<host>[^\[\]:]*)):(?P<port>[0-9]{1,5})")


class ServeError(SyncError):
    """The server cannot start (address, certificate, token); one line for the user."""


def parse_listen(listen: str) -> tuple[str, int]:
    """`ADDR:PORT`, `[V6ADDR]:PORT` or `:PORT` (all IPv4 addresses) -> (host, port)."""
    m = _LISTEN.fullmatch(listen.strip())
    if m is None:
        raise ServeError(f"invalid listen address {listen!r} (expected ADDR:PORT)")
    host = m.group("v6") if m.group("v6") is not None else (m.group("host") or "0.0.0.0")
    port = int(m.group("port"))
    if port > 65535:
        raise ServeError(f"invalid port in listen address {listen!r}")
    return host, port


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bind(listen: str) -> socket.socket:
    """A listening-ready TCP socket bound to `listen`; ServeError when that fails.

    We bind, not hypercorn, so a busy port or a bad address is one clear error here, and
    the port the kernel chose for `:0` is known before the first request.
    """
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on {listen}: {exc.strerror}") from None
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            # Accepted connections inherit it: a client that stops reading (zero window) or
            # vanishes is dropped after this long, instead of pinning a send forever.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, STALL_TIMEOUT_MS)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    return sock


def url_of(sock: socket.socket, *, tls: bool) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def make_config(
    fd: int,
    *,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
) -> Config:
    """Hypercorn's settings for serving on the bound socket `fd` (which it then owns)."""
    if (tls_cert is None) != (tls_key is None):
        raise ServeError("TLS needs both a certificate and a key")
    config = Config()
    config.bind = [f"fd://{fd}"]
    if tls_cert is not None and tls_key is not None:
        config.certfile = os.fspath(tls_cert)
        config.keyfile = os.fspath(tls_key)
        # HTTP/1.1 only: a blob is one big stream, where h2's framing and flow control cost
        # throughput and buy nothing.
        config.alpn_protocols = ["http/1.1"]
    config.graceful_timeout = GRACE
    config.keep_alive_timeout = HEADER_TIMEOUT
    config.ssl_handshake_timeout = HANDSHAKE_TIMEOUT
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.h2_max_header_list_size = MAX_HEADER_BYTES
    config.backlog = BACKLOG
    config.read_timeout = None  # see the module's docstring: it would cut downloads
    config.include_server_header = False
    config.accesslog = None  # the app logs requests itself, at debug level
    # Hypercorn's own log goes through ours; its "Running on" line repeats ours, so only
    # its warnings and errors are shown unless we log at debug level.
    errorlog = logging.getLogger("hypercorn.error")
    if not log.isEnabledFor(logging.DEBUG):
        errorlog.setLevel(logging.WARNING)
    config.errorlog = errorlog
    return config


def check_tls(tls_cert: str | os.PathLike[str], tls_key: str | os.PathLike[str]) -> None:
    """Load the certificate and key once, so a bad pair is a clear error before binding:
    one line naming the file that is missing, unreadable or not what it should be."""
    for path in (tls_cert, tls_key):
        try:
            with open(path, "rb"):
                pass
        except FileNotFoundError:
            raise ServeError(f"{path}: no such file") from None
        except OSError as exc:
            raise ServeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        pin_of_cert_file(tls_cert)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(os.fspath(tls_cert), os.fspath(tls_key))
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ServeError(f"{tls_key}: not a usable key for {tls_cert} ({reason})") from None


async def serve(
    app: Any,
    listen: str,
    *,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `listen` until cancelled; report the bound URL through `task_status`.

    Cancellation starts a graceful shutdown: the listener closes at once, requests in flight
    get `GRACE` seconds to finish, then whatever is left is cut.
    """
    tls = tls_cert is not None or tls_key is not None
    if tls_cert is not None and tls_key is not None:
        check_tls(tls_cert, tls_key)
    sock = bind(listen)
    url = url_of(sock, tls=tls)
    try:
        config = make_config(sock.fileno(), tls_cert=tls_cert, tls_key=tls_key)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # hypercorn wraps the fd in its own socket object and closes it
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        # The server runs shielded, so that our cancellation reaches it as the shutdown
        # trigger (graceful) rather than as Cancelled in every connection (abrupt).
        shield = trio.CancelScope(shield=True)

        async def run(
            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            with shield:
                await serve_hypercorn(
                    app, config, shutdown_trigger=stop.wait, task_status=task_status
                )

        await nursery.start(run)
        log.info("listening on %s", url)
        task_status.started(url)
        try:
            await trio.sleep_forever()
        finally:
            log.info("shutting down")
            stop.set()
            # Past the grace period (hypercorn's own, plus a margin), stop waiting.
            shield.deadline = trio.current_time() + GRACE + 1.0


# -- `modelfs serve` ----------------------------------------------------------------------------
DEFAULT_PORT = 11500


def server_names(listen: str, tls_cert: str | os.PathLike[str] | None) -> list[str]:
    """The names a server answers to besides its hostname and the address a client reached
    (sync.realm): its listen address, unless a wildcard, and its certificate's names."""
    host, _ = parse_listen(listen)
    names = [] if host in ("0.0.0.0", "::", "") else [host]
    if tls_cert is not None:
        names += names_of_cert_file(tls_cert)
    return names


def default_listen(*, token: bool) -> str:
    """Loopback unless a token or keys guard the server: without either only loopback
    clients are served anyway, so listening wider would only expose a port that answers 403."""
    return f"0.0.0.0:{DEFAULT_PORT}" if token else f"127.0.0.1:{DEFAULT_PORT}"


def print_pin(tls_cert: str | os.PathLike[str]) -> str:
    """`modelfs serve --print-pin`: the pin of this certificate, for peers' `pin` (sync.pins)."""
    try:
        return pin_of_cert_file(tls_cert)
    except FileNotFoundError:
        raise ServeError(f"{tls_cert}: no such file") from None
    except OSError as exc:
        raise ServeError(f"{tls_cert}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def run_server(
    root: str | os.PathLike[str],
    *,
    listen: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    authorized_keys: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    prefer: Sequence[str] | None = None,
    mirror: str | None = None,
    mirror_ttl: float | None = None,
    public_urls: Sequence[str] = (),
    ready: Callable[[str], None] | None = None,
) -> None:
    """`modelfs serve`: serve the store at `root` until SIGTERM or SIGINT; with `mirror`, a
    pull-through cache of that registry (sync.mirror), signing in with docker's credentials.

    `ready(url)` is called once the socket is bound (the CLI prints `listening on URL`).
    `public_urls`: where clients reach it besides its own names (a proxy, a port forward).
    """
    from modelfs.store.layout import Layout
    from modelfs.store.scan import DEFAULT_PREFER
    from modelfs.sync.registry.server import RegistryApp
    from modelfs.sync.wire.signin import AccessConfigError

    credentials = read_credentials(token_file)
    token = credentials.secret if credentials is not None else None
    if (tls_cert is None) != (tls_key is None):
        raise ServeError("--tls-cert and --tls-key go together")
    guarded = token is not None or authorized_keys is not None
    listen = listen or default_listen(token=guarded)
    host, _ = parse_listen(listen)
    if not guarded and not is_loopback_host(host):
        log.warning(
            "no --token-file or --authorized-keys: only loopback clients will be served on %s",
            listen,
        )
    try:
        app = RegistryApp(
            Layout(root),
            token=token,
            authorized_keys=authorized_keys,
            prefer=prefer or DEFAULT_PREFER,
            names=server_names(listen, tls_cert),
            public_urls=public_urls,
        )
    except AccessConfigError as exc:
        raise ServeError(str(exc)) from None
    except ValueError as exc:  # a public URL that is not one
        raise ServeError(f"--public-url {exc}") from None
    if mirror is not None:
        from modelfs.sync.client.credentials import Logins
        from modelfs.sync.mirror.mirror import DEFAULT_TTL, Mirror

        # Docker's credentials for the upstream, never our own --token-file: that one is
        # what our clients send us.
        app.mirror = Mirror(
            app.layout,
            mirror,
            Logins(None),
            ttl=DEFAULT_TTL if mirror_ttl is None else mirror_ttl,
            prefer=app.prefer,
            changed=app.changed,
        )

    async def main() -> None:
        # Scan before listening, so the first client does not wait for it and a store
        # problem shows in the log right away.
        await app.view()
        async with trio.open_nursery() as nursery:
            if app.mirror is not None:
                await nursery.start(app.mirror.run)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                url = await nursery.start(
                    partial(serve, app, listen, tls_cert=tls_cert, tls_key=tls_key)
                )
                if ready is not None:
                    ready(url)
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    break
            # A send blocked on a client that stopped reading cannot be cancelled (hypercorn
            # shields it) and may last until the stall timeout; the process does not wait.
            hard_stop.start()
            nursery.cancel_scope.cancel()

    def exit_now() -> None:
        log.warning("requests still in flight %.0f s after the signal: exiting", HARD_STOP)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)

    hard_stop = threading.Timer(HARD_STOP, exit_now)
    hard_stop.daemon = True
    try:
        # A ServeError from start-up arrives wrapped by the nurseries it passed through.
        with unwrapped(ServeError):
            trio.run(main)
    finally:
        hard_stop.cancel()
