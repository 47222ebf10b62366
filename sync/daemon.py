"""`modelfs sync`: the daemon. One trio nursery runs

- the OCI server over the store (sync.server, as `modelfs serve`);
- the replication loop: every `interval`, each peer's catalog and tags (each peer on its
  own, with its own back-off, so one that is down or slow holds up nobody), the names that
  `replicate` selects whose digest differs from ours, pulled with sync.pull from every peer
  that offers that digest (fail-over among them), variants by `prefer`;
- tag history (store.history): each interval, tags that moved are recorded, and the versions
  they replaced are held in this host's lease (store.leases) for `history_retention`;
- GC on its schedule (sync.gc; one host at a time through the GC lock);
- systemd's notify protocol: READY=1 once serving, STATUS= after each round, WATCHDOG=1 at
  half of $WATCHDOG_USEC, STOPPING=1 on SIGTERM. SIGHUP reloads the config.

Shutdown is cancellation: transfers stop where they are (their partial files and sidecars are
the safe point; the next start resumes them), the server finishes requests in flight for a
few seconds, and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from runtime.leasing import leased
from runtime.notify import sd_notify
from store.digest import Digest
from store.errors import LockBusyError, StoreError
from store.history import TagHistory
from store.layout import Layout
from store.leases import HEARTBEAT, LeaseKeeper
from store.names import Name
from store.scan import StoreIndex
from sync.client import PeerClient
from sync.config import ConfigError, SyncConfig, load_config
from sync.errors import PeerLiedError, SyncError
from sync.gc import GcReport, run_gc
from sync.http import make_client
from sync.pull import PullOptions, pull
from sync.serve import read_token_file, serve
from sync.server import RegistryApp
from sync.threads import run_unwrapped

log = logging.getLogger(__name__)

MAX_BACKOFF = 3600.0
LIST_TIMEOUT = 60.0  # at least; a listing may take up to the interval when that is longer


@dataclass
class PeerState:
    url: str
    failures: int = 0
    retry_at: float = 0.0  # monotonic
    last_error: str | None = None
    last_ok: float | None = None  # wall clock
    models: dict[str, str] = field(default_factory=dict)  # shortest name -> digest hex
    bytes_in: int = 0
    blobs_in: int = 0
    verify_failures: int = 0  # bytes that did not hash to the digest asked for
    scope: trio.CancelScope | None = None  # its listing task, cancelled when it leaves the config

    def failed(self, exc: BaseException, interval: float) -> None:
        self.failures += 1
        self.last_error = str(exc)
        delay = min(interval * 2 ** min(self.failures - 1, 16), MAX_BACKOFF)
        self.retry_at = time.monotonic() + delay
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "peer %s: %s (next try in %.0f s)", self.url, exc, delay)

    def succeeded(self) -> None:
        if self.failures:
            log.info("peer %s: reachable again", self.url)
        self.failures, self.last_error, self.last_ok = 0, None, time.time()


@dataclass
class Transfer:
    name: str
    digest: str
    sources: list[str]
    started: float = field(default_factory=time.time)


class Daemon:
    def __init__(self, config: SyncConfig, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self.peers: dict[str, PeerState] = {}
        self.transfers: dict[str, Transfer] = {}
        self.lag_since: dict[str, float] = {}  # name -> when a peer first had another digest
        self.rounds = 0
        self.pulled = 0
        self.pull_failures = 0
        self.gc_runs = 0
        self.gc_bytes_freed = 0
        self.gc_last: dict[str, Any] | None = None
        self.url = ""
        self.local: dict[str, str] = {}  # this store's names -> digests, at the last round
        self.keeper = LeaseKeeper(layout, "sync", ttl=config.gc.lease_ttl, host=config.host_id)
        self._wakes: dict[str, trio.Event] = {}  # one per periodic loop
        self._nursery: trio.Nursery | None = None
        self.history = TagHistory(layout, host=config.host_id)
        self.history_roots: set[Digest] = set()
        self.history_seen = False  # the first look records every tag as added: not news
        self._sync_peers()

    # -- config -------------------------------------------------------------------------------
    def _sync_peers(self) -> None:
        old = self.peers
        self.peers = {url: old.get(url) or PeerState(url) for url in self.config.peers}
        for url, peer in old.items():
            if url not in self.peers and peer.scope is not None:
                peer.scope.cancel()
        if self._nursery is not None:
            for peer in self.peers.values():
                if peer.scope is None:
                    self._nursery.start_soon(self._watch_peer, peer)

    async def reload(self) -> None:
        """SIGHUP: a new config, or the old one and an error line. What only a restart can
        change (store, listen, token, TLS) is reported and left as it is."""
        try:
            new = await trio.to_thread.run_sync(load_config, self.config.path)
        except ConfigError as exc:
            log.error("reload: %s; keeping the running config", exc)
            return
        fixed = ("store", "listen", "token_file", "tls_cert", "tls_key", "host_id")
        for key in fixed:
            if getattr(new, key) != getattr(self.config, key):
                log.warning("reload: %s changed; it takes effect at the next restart", key)
        keep = {k: getattr(self.config, k) for k in fixed}
        self.config = SyncConfig(
            **{**{k: getattr(new, k) for k in new.__dataclass_fields__}, **keep}  # type: ignore[arg-type]
        )
        self._sync_peers()
        log.info(
            "reload: %d peer(s), replicate %s", len(self.config.peers), list(self.config.replicate)
        )
        self.wake()

    # -- the whole daemon ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        token = read_token_file(config.token_file) if config.token_file else None
        self.token = token
        app = RegistryApp(
            self.layout,
            token=token,
            authorized_keys=config.authorized_keys,
            prefer=config.prefer,
            host_id=config.host_id,
        )
        self.app = app
        app.extra_status = self.status
        app.extra_metrics = self.metrics
        await app.view()
        heartbeat = min(HEARTBEAT, config.gc.lease_ttl / 4)
        async with (
            make_client(token=token) as http,
            leased(self.keeper, strict=False, heartbeat=heartbeat) as self.lease,
            trio.open_nursery() as nursery,
        ):
            self.http = http
            self.url = await nursery.start(
                lambda task_status: serve(
                    app,
                    config.listen,
                    tls_cert=config.tls_cert,
                    tls_key=config.tls_key,
                    task_status=task_status,
                )
            )
            self._nursery = nursery
            self._sync_peers()  # a listing task per peer
            nursery.start_soon(self._signals, nursery.cancel_scope)
            nursery.start_soon(self._watchdog)
            nursery.start_soon(self._every, lambda: self.config.interval, self.replicate_once)
            nursery.start_soon(self._gc_loop)
            nursery.start_soon(self._every, lambda: self.config.interval, self.remember)
            sd_notify(f"READY=1\nSTATUS=serving {self.layout.root} on {self.url}")
            log.info("sync daemon %s ready: serving on %s", config.host_id, self.url)
            task_status.started(self.url)

    async def _signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    await self.reload()
                    continue
                log.info("%s: stopping", signal.Signals(signum).name)
                sd_notify("STOPPING=1")
                scope.cancel()
                return

    async def _watchdog(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
            return
        period = int(usec) / 1e6 / 2
        while True:
            sd_notify("WATCHDOG=1")
            await trio.sleep(period)

    async def _every(
        self, interval: Callable[[], float], job: Callable[[], Awaitable[None]]
    ) -> None:
        """Run `job` every `interval()` seconds, and at once when woken (a peer's listing
        changed, a reload)."""
        key = getattr(job, "__name__", repr(job))
        while True:
            self._wakes[key] = trio.Event()
            await job()
            with trio.move_on_after(interval()):
                await self._wakes[key].wait()

    def wake(self) -> None:
        for event in self._wakes.values():
            event.set()

    def lease_age(self) -> float | None:
        """Seconds since this host's lease was last written or touched."""
        try:
            return max(time.time() - os.stat(self.keeper.path).st_mtime, 0.0)
        except OSError:
            return None

    async def index(self) -> StoreIndex:
        """The store as the server sees it: rescanned only when the store changed."""
        return (await self.app.view()).index

    # -- replication ------------------------------------------------------------------------------
    async def replicate_once(self) -> None:
        config = self.config
        self.rounds += 1
        if not config.peers:
            return
        index = await self.index()
        local = {e.name.shortest: e.digest.hex for e in index}
        self.local = local
        wanted: dict[str, tuple[str, list[str]]] = {}
        for peer in self.peers.values():  # config order: the first peer's version wins
            if peer.failures:
                continue
            for name, digest in peer.models.items():
                if not digest or not config.wants(name):
                    continue
                chosen = wanted.get(name)
                if chosen is None:
                    wanted[name] = (digest, [peer.url])
                elif chosen[0] == digest:
                    chosen[1].append(peer.url)
        for name in list(self.lag_since):
            if name not in wanted or wanted[name][0] == local.get(name):
                del self.lag_since[name]
        todo = [(n, d, s) for n, (d, s) in sorted(wanted.items()) if local.get(n) != d]
        for name, _, _ in todo:
            self.lag_since.setdefault(name, time.time())
        for name, digest, sources in todo:
            await self._pull(name, digest, sources)
        status = f"serving on {self.url}; {len(local)} model(s); round {self.rounds}"
        if todo:
            status += f": {len(todo)} to pull"
        sd_notify(f"STATUS={status}")

    async def _watch_peer(self, peer: PeerState) -> None:
        """List one peer every interval (longer after failures), on its own: a peer that is
        down or stalls delays nothing but its own listing. A change wakes the replicator."""
        with trio.CancelScope() as peer.scope:
            while True:
                before = dict(peer.models)
                with trio.move_on_after(max(self.config.interval, LIST_TIMEOUT)) as timer:
                    await self._list_peer(peer)
                if timer.cancelled_caught:
                    peer.failed(TimeoutError("listing timed out"), self.config.interval)
                if peer.models != before:
                    self.wake()
                await trio.sleep(max(peer.retry_at - time.monotonic(), self.config.interval))

    async def _list_peer(self, peer: PeerState) -> None:
        client = PeerClient(peer.url, self.http)
        try:
            names: list[Name] = await client.models()
            digests: dict[str, str] = {}
            for n in names:
                digests[n.shortest] = ""  # listed; its digest is asked only when selected
                if self.config.wants(n.shortest):
                    fetched = await client.manifest(n, n.tag)
                    digests[n.shortest] = fetched.digest.hex
        except (SyncError, StoreError, httpx.HTTPError) as exc:
            peer.failed(exc, self.config.interval)
            return
        peer.models = digests
        peer.succeeded()

    async def _pull(self, name: str, digest: str, sources: list[str]) -> None:
        self.transfers[name] = Transfer(name, digest, sources)
        options = PullOptions(prefer=self.config.prefer)
        try:
            report = await pull(self.layout, [name], sources, options=options, http=self.http)
        except (SyncError, StoreError) as exc:
            self.pull_failures += 1
            if isinstance(exc, PeerLiedError):
                self._lied(str(exc))
            log.warning("replicate %s from %s: %s", name, sources[0], exc)
            return
        finally:
            del self.transfers[name]
        self.pulled += 1
        self.lag_since.pop(name, None)
        self.local[name] = digest
        for result in report.models:
            for url in result.avoided:
                if url in self.peers:
                    self.peers[url].verify_failures += 1
            peer = self.peers.get(sources[0])
            if peer is not None:
                peer.bytes_in += result.fetched_bytes
                peer.blobs_in += result.fetched
            log.info(
                "replicated %s (%s) from %s: %d blob(s), %d bytes",
                name,
                digest[:12],
                sources[0],
                result.fetched,
                result.fetched_bytes,
            )

    def _lied(self, message: str) -> None:
        for url, peer in self.peers.items():
            if message.startswith(url):
                peer.verify_failures += 1
                return

    # -- tag history ----------------------------------------------------------------------------
    async def remember(self) -> None:
        """Record tags that moved; keep the versions they replaced (for `history_retention`)
        in this host's lease, so every host's GC leaves them alone."""
        now = time.time()
        retention = self.config.gc.history_retention
        try:
            index = await self.index()
            await trio.to_thread.run_sync(self.history.set_retention, retention)
            changes = await trio.to_thread.run_sync(self.history.observe, index, now)
            await trio.to_thread.run_sync(self.history.prune, now, retention)
            roots = await trio.to_thread.run_sync(self.history.roots, now, retention)
        except (StoreError, OSError) as exc:
            log.warning("tag history: %s", exc)
            return
        for change in changes:
            if change.kind != "added" or self.history_seen:
                log.info(
                    "tag history: %s %s (%s -> %s)",
                    change.name,
                    change.kind,
                    change.old.short if change.old else "-",
                    change.new.short if change.new else "-",
                )
        self.history_seen = True
        if roots != self.history_roots:
            await self.lease.hold(digests=roots)  # new roots on disk before old ones go
            self.lease.drop(digests=self.history_roots)
            self.history_roots = roots

    # -- GC -------------------------------------------------------------------------------------
    async def _gc_loop(self) -> None:
        while True:
            gc = self.config.gc
            await trio.sleep(gc.interval)
            if self.config.gc.enabled:
                await self.collect()

    async def collect(self) -> GcReport | None:
        try:
            report = await run_gc(self.layout, self.config.gc.policy(), host=self.config.host_id)
        except LockBusyError as exc:
            log.info("gc: skipped, another GC runs (%s)", exc)
            return None
        except (StoreError, OSError) as exc:
            log.error("gc: %s", exc)
            return None
        except Exception:
            # A bug in one GC run must not take down serving and replication.
            log.exception("gc: failed")
            return None
        self.gc_runs += 1
        self.gc_bytes_freed += report.bytes_freed
        self.gc_last = {
            "finished": report.finished,
            "ok": report.ok,
            "trashed": len(report.trashed),
            "bytes_freed": report.bytes_freed,
            "refused": [str(p) for p in report.refused][:5],
            "aborted": report.aborted,
        }
        if report.refused:
            log.warning("gc refused: %s", report.refused[0])
        return report

    # -- observability ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.time()
        return {
            "daemon": {
                "rounds": self.rounds,
                "interval": self.config.interval,
                "replicate": list(self.config.replicate),
                "models": self.local,
                "pulled": self.pulled,
                "pull_failures": self.pull_failures,
                "transfers": [
                    {"name": t.name, "digest": t.digest, "from": t.sources, "since": t.started}
                    for t in self.transfers.values()
                ],
                "lag_seconds": {n: round(now - t, 3) for n, t in sorted(self.lag_since.items())},
                "lease_age_seconds": self.lease_age(),
                "gc": {
                    "runs": self.gc_runs,
                    "bytes_freed": self.gc_bytes_freed,
                    "last": self.gc_last,
                },
            },
            "peers": [
                {
                    "url": p.url,
                    "ok": p.failures == 0 and p.last_ok is not None,
                    "last_ok": p.last_ok,
                    "error": p.last_error,
                    "models": p.models,
                    "bytes_in": p.bytes_in,
                    "blobs_in": p.blobs_in,
                    "verify_failures": p.verify_failures,
                }
                for p in self.peers.values()
            ],
        }

    def metrics(self) -> list[tuple[str, str, str, list[tuple[str, float]]]]:
        now = time.time()
        peers = list(self.peers.values())

        def label(url: str) -> str:
            return '{peer="' + url.replace("\\", "\\\\").replace('"', '\\"') + '"}'

        def name_label(n: str) -> str:
            return '{name="' + n.replace("\\", "\\\\").replace('"', '\\"') + '"}'

        return [
            (
                "peer_bytes_received_total",
                "counter",
                "Blob bytes pulled, by peer.",
                [(label(p.url), p.bytes_in) for p in peers],
            ),
            (
                "peer_blobs_received_total",
                "counter",
                "Blobs pulled, by peer.",
                [(label(p.url), p.blobs_in) for p in peers],
            ),
            (
                "verify_failures_total",
                "counter",
                "Blobs or manifests a peer sent that did not hash to their digest.",
                [(label(p.url), p.verify_failures) for p in peers],
            ),
            (
                "peer_up",
                "gauge",
                "1 when the peer's last listing succeeded.",
                [(label(p.url), 1 if p.failures == 0 and p.last_ok else 0) for p in peers],
            ),
            (
                "pull_failures_total",
                "counter",
                "Replication pulls that failed (digest mismatches included).",
                [("", self.pull_failures)],
            ),
            ("gc_runs_total", "counter", "GC runs completed here.", [("", self.gc_runs)]),
            (
                "gc_bytes_freed_total",
                "counter",
                "Bytes GC freed here.",
                [("", self.gc_bytes_freed)],
            ),
            (
                "lease_age_seconds",
                "gauge",
                "Seconds since this host's lease heartbeat.",
                [("", round(self.lease_age() or 0.0, 3))],
            ),
            (
                "replication_lag_seconds",
                "gauge",
                "Seconds a selected name has differed from the peers' version.",
                [(name_label(n), round(now - t, 3)) for n, t in sorted(self.lag_since.items())],
            ),
            ("transfers_in_flight", "gauge", "Pulls running now.", [("", len(self.transfers))]),
        ]


def run_daemon(config: SyncConfig, layout: Layout) -> None:
    """`modelfs sync`: until SIGTERM/SIGINT; exit 0."""
    daemon = Daemon(config, layout)
    run_unwrapped(daemon.run)
