"""`modelfs sync`: the daemon. One trio nursery runs

- the OCI server over the store (sync.server, as `modelfs serve`);
- the replication loop: every `interval`, each peer's catalog and tags (each peer on its
  own, with its own back-off, so one that is down or slow holds up nobody), the names that
  `replicate` selects whose digest differs from ours, pulled with sync.pull from every peer
  that offers that digest (fail-over among them), up to `max_transfers` names at once, so a
  small change is not stuck behind a large one;
- variants by `prefer`: of a manifest list, the child `prefer` ranks first
  (store.scan.rank_children, the ranking the mount shows by). A list whose child that is
  not here is behind as much as another digest is; while no peer has that child, the old
  version stays (nothing is written: the tag never switches to a variant this host did not
  choose) and the name is retried with back-off, resuming its partial download;
- tag history (store.history): each interval, tags that moved are recorded, and the versions
  they replaced are held in this host's lease (store.leases) for `history_retention`;
- GC on its schedule (sync.gc; one host at a time through the GC lock), the first run a few
  seconds after the start;
- systemd's notify protocol: READY=1 once serving, STATUS= after each round, WATCHDOG=1 at
  half of $WATCHDOG_USEC, STOPPING=1 on SIGTERM. SIGHUP reloads the config; every loop
  asleep wakes and reckons its next run by the new intervals.

Shutdown is cancellation: transfers stop where they are (their partial files and sidecars are
the safe point; the next start resumes them), the server finishes requests in flight for a
few seconds, and the process exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from modelfs.runtime.leasing import LiveLease, leased
from modelfs.runtime.notify import sd_notify
from modelfs.store.digest import Digest
from modelfs.store.errors import InvalidNameError, LockBusyError, StoreError
from modelfs.store.history import TagHistory
from modelfs.store.layout import Layout
from modelfs.store.leases import HEARTBEAT, LeaseKeeper
from modelfs.store.names import Name, parse_name
from modelfs.store.scan import StoreIndex, child_runner
from modelfs.store.tagid import TagId, tag_ids
from modelfs.store.units import counted
from modelfs.sync.client.credentials import Logins, read_credentials
from modelfs.sync.client.peer import peer_session
from modelfs.sync.client.threads import run_unwrapped
from modelfs.sync.daemon.config import ConfigError, SyncConfig, load_config
from modelfs.sync.daemon.gc import GcReport, run_gc
from modelfs.sync.daemon.peers import (
    Behind,
    PeerState,
    Transfer,
    backoff,
    delay_text,
    distrust,
)
from modelfs.sync.errors import (
    LocalWriteError,
    PeerLiedError,
    PeerUnprovenError,
    SyncError,
)
from modelfs.sync.mirror.mirror import Mirror
from modelfs.sync.pull.options import PullOptions
from modelfs.sync.pull.puller import pull, pull_lease
from modelfs.sync.registry.serve import serve, server_names
from modelfs.sync.registry.server import RegistryApp
from modelfs.sync.wire.pins import pin_of_cert_file

log = logging.getLogger(__name__)

LIST_TIMEOUT = 60.0  # at least; a listing may take up to the interval when that is longer
GC_FIRST_DELAY = 5.0  # the first GC after a start (at most gc.interval): soon, once serving


class Daemon:
    def __init__(self, config: SyncConfig, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self.peers: dict[str, PeerState] = {}
        self.transfers: dict[str, Transfer] = {}
        self.behind: dict[str, Behind] = {}
        self._transfer_slots = trio.CapacityLimiter(config.max_transfers)
        self.pull_lease: LiveLease | None = None  # one for every pull: its file is per process
        self._reloaded = trio.Event()  # set (and replaced) by each reload
        self.rounds = 0
        self.pulled = 0
        self.pull_failures = 0
        self.gc_runs = 0
        self.gc_bytes_freed = 0
        self.gc_last: dict[str, Any] | None = None
        self.url = ""
        self.pin: str | None = None  # of this host's own certificate, for its peers' configs
        self.local: dict[str, str] = {}  # this store's names -> digests, at the last round
        # The same names -> their IDs as `ls`/`show` give them (store.tagid).
        self.ids: dict[str, TagId] = {}
        self.spelling: dict[tuple[str, str, str, str], str] = {}  # Name.key -> the name here
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
        self.peers = {url: old.get(url) or PeerState(url) for url in self.config.sources}
        for url, peer in self.peers.items():
            peer.registry = url not in self.config.peers
            peer.token = not peer.registry and self.config.token_file is not None
        if hasattr(self, "session"):  # a reload: registries and pins take effect now
            self.session.unproved = self._registries()
            self.session.tls.update(self.config.pins)
        for url, peer in old.items():
            if url not in self.peers and peer.scope is not None:
                peer.scope.cancel()
        if self._nursery is not None:
            for peer in self.peers.values():
                if peer.scope is None:
                    self._nursery.start_soon(self._watch_peer, peer)

    def _registries(self) -> frozenset[str]:
        """The sources asked for no proof of the token: registries that are not also peers."""
        return frozenset(u for u in self.config.sources if u not in self.config.peers)

    async def reload(self) -> None:
        """SIGHUP: a new config, or the old one and an error line. What only a restart can
        change (store, listen, token, TLS) is reported and left as it is."""
        try:
            new = await trio.to_thread.run_sync(load_config, self.config.path)
        except ConfigError as exc:
            log.error("reload: %s; keeping the running config", exc)
            return
        fixed = (
            "store",
            "listen",
            "token_file",
            "tls_cert",
            "tls_key",
            "public_urls",
            "host_id",
            "mirror",
            "mirror_ttl",
            "docker_config",
        )
        for key in fixed:
            if getattr(new, key) != getattr(self.config, key):
                log.warning("reload: %s changed; it takes effect at the next restart", key)
        keep = {k: getattr(self.config, k) for k in fixed}
        self.config = SyncConfig(
            **{**{k: getattr(new, k) for k in new.__dataclass_fields__}, **keep}
        )
        self._transfer_slots.total_tokens = self.config.max_transfers
        self._sync_peers()
        log.info(
            "reload: %s, replicate %s",
            counted(len(self.config.sources), "peer"),
            list(self.config.replicate),
        )
        self._reckon()
        self.wake()

    def _reckon(self) -> None:
        """Sleeping loops reckon their next run again (a reload, a peer seen up again)."""
        self._reloaded.set()
        self._reloaded = trio.Event()

    def seen(self, url: str) -> None:
        """The peer at `url` is up, by another path than its listing: if it is down here,
        it is listed again now rather than at the end of its back-off."""
        peer = self.peers.get(url)
        if peer is not None and peer.failures:
            peer.seen_at = trio.current_time()
            self._reckon()

    def contacted(self, host_id: str) -> None:
        """A request came from the sync daemon of `host_id`: that peer is up."""
        for peer in self.peers.values():
            if peer.host_id == host_id and not peer.registry:
                self.seen(peer.url)

    # -- the whole daemon ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        # One file: the token this host serves with and proves to its peers that it holds.
        credentials = read_credentials(config.token_file)
        token = credentials.secret if credentials is not None else None
        app = RegistryApp(
            self.layout,
            token=token,
            authorized_keys=config.authorized_keys,
            prefer=config.prefer,
            host_id=config.host_id,
            names=server_names(config.listen, config.tls_cert),
            public_urls=config.public_urls,
        )
        self.app = app
        app.extra_status = self.status
        app.extra_metrics = self.metrics
        app.on_contact = self.contacted
        if config.mirror is not None:
            # The upstream gets docker's credentials (`docker_config`), never our token.
            app.mirror = Mirror(
                self.layout,
                config.mirror,
                Logins(None, docker_config=config.docker_config),
                ttl=config.mirror_ttl,
                prefer=config.prefer,
                changed=app.changed,
            )
        await app.view()
        heartbeat = min(HEARTBEAT, config.gc.lease_ttl / 4)
        async with (
            peer_session(
                # Peers are sent proofs of the token, never the token; registries docker's
                # credentials when they ask.
                Logins(None, docker_config=config.docker_config),
                proof_token=token,
                unproved=self._registries(),
                pins=self.config.pins,
                daemon_host=config.host_id,
            ) as self.session,
            leased(self.keeper, strict=False, heartbeat=heartbeat) as self.lease,
            contextlib.AsyncExitStack() as stack,
        ):
            try:
                self.pull_lease = await stack.enter_async_context(pull_lease(self.layout))
            except LocalWriteError as exc:
                log.warning("%s; pulls cannot write here", exc)
            async with trio.open_nursery() as nursery:
                if app.mirror is not None:
                    await nursery.start(app.mirror.run)
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
                if config.tls_cert is not None:  # serving: the certificate loaded
                    self.pin = await trio.to_thread.run_sync(pin_of_cert_file, config.tls_cert)
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

    async def _sleep_until(self, when: Callable[[], float]) -> None:
        """Sleep until the trio clock reaches `when()`; a reload wakes it to reckon again, so
        new intervals apply at once."""
        while (left := when() - trio.current_time()) > 0:
            with trio.move_on_after(left):
                await self._reloaded.wait()

    def wake(self, key: str | None = None) -> None:
        """Run the periodic loops now (or the one named `key`)."""
        for k, event in self._wakes.items():
            if key is None or k == key:
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
        """Start a transfer for each selected name that is behind and not in flight, unless it
        failed lately from the same peers (back-off); it does not wait for them."""
        config = self.config
        self.rounds += 1
        if not config.sources:
            return
        index = await self.index()
        local = {e.name.shortest: e.digest.hex for e in index}
        self.local = local
        self.ids = {e.name.shortest: e.tag_ids(config.prefer) for e in index}
        self.spelling = {e.name.key: e.name.shortest for e in index}
        wanted: dict[str, tuple[str, list[str]]] = {}
        for peer in self.peers.values():  # config order: the first peer's version wins
            if peer.failures:
                continue
            for listed, digest in peer.models.items():
                name = self._spelled_here(listed)
                if not digest or not config.wants(name):
                    continue
                chosen = wanted.get(name)
                if chosen is None:
                    wanted[name] = (digest, [peer.url])
                elif chosen[0] == digest:
                    chosen[1].append(peer.url)
        todo: dict[str, tuple[str, list[str], str]] = {}
        for name, (digest, sources) in sorted(wanted.items()):
            if local.get(name) != digest:
                why = f"the peers have {tag_ids(digest)}" if name in local else "not here yet"
            else:
                child = index.lacks_wanted(index.lookup(name), config.prefer)
                if child is None:
                    continue
                runner = child_runner(child) or child.digest.short
                why = f"its {runner} variant is not here"
            todo[name] = (digest, sources, why)
        for name in list(self.behind):
            if name not in todo:
                del self.behind[name]
        now = trio.current_time()
        for name, (digest, sources, why) in todo.items():
            behind = self.behind.get(name)
            if behind is None or behind.digest != digest:
                since = behind.since if behind is not None else time.time()
                behind = self.behind[name] = Behind(digest, why, since)
            behind.reason = why
            if name in self.transfers:
                continue
            if behind.failures and behind.sources == tuple(sources) and now < behind.retry_at:
                continue
            transfer = self.transfers[name] = Transfer(name, digest, sources)
            assert self._nursery is not None
            self._nursery.start_soon(self._pull, transfer)
        status = f"serving on {self.url}; {counted(len(local), 'model')}; round {self.rounds}"
        if todo:
            status += f": {len(todo)} behind, {len(self.transfers)} in flight"
        sd_notify(f"STATUS={status}")

    async def _watch_peer(self, peer: PeerState) -> None:
        """List one peer every interval (longer after failures), on its own: a peer that is
        down or stalls delays nothing but its own listing. A change wakes the replicator."""
        with trio.CancelScope() as peer.scope:
            while True:
                before, was_down = dict(peer.models), peer.failures > 0
                peer.listed_at = trio.current_time()
                with trio.move_on_after(max(self.config.interval, LIST_TIMEOUT)) as timer:
                    await self._list_peer(peer)
                if timer.cancelled_caught:
                    peer.failed(TimeoutError("listing timed out"), self.config.interval)
                if peer.models != before or (was_down and not peer.failures):
                    self.wake()  # back up: what waited for it is tried at once
                await self._sleep_until(lambda: peer.next_try(self.config.interval))

    def _spelled_here(self, listed: str) -> str:
        """A peer's name as this store spells that model (listed before this round knew)."""
        try:
            return self.spelling.get(parse_name(listed).key, listed)
        except InvalidNameError:
            return listed

    async def _list_peer(self, peer: PeerState) -> None:
        client = self.session.peer(peer.url)
        try:
            names: list[Name] = await client.models()
            digests: dict[str, str] = {}
            for n in names:
                # One model, one row: Ollama folds case, so a peer's `smollm2` is our `SmolLM2`.
                shown = self.spelling.get(n.key, n.shortest)
                digests[shown] = ""  # listed; its digest is asked only when selected
                if self.config.wants(shown):
                    fetched = await client.manifest(n, n.tag)
                    digests[shown] = fetched.digest.hex
        except (SyncError, StoreError, httpx.HTTPError) as exc:
            peer.failed(exc, self.config.interval)
            return
        peer.models = digests
        peer.host_id = client.host_id or peer.host_id
        peer.succeeded()

    async def _pull(self, t: Transfer) -> None:
        name, digest, sources = t.name, t.digest, t.sources
        # A list's variant is the one `prefer` ranks first, or none: never another.
        options = PullOptions(prefer=self.config.prefer, fallback=False)
        try:
            async with self._transfer_slots:
                t.pulling, t.started = True, time.time()
                report = await pull(
                    self.layout,
                    [name],
                    sources,
                    options=options,
                    progress=t.progress,
                    session=self.session,
                    lease=self.pull_lease,
                )
        except (SyncError, StoreError) as exc:
            self.pull_failures += 1
            if isinstance(exc, PeerLiedError):
                self._lied(str(exc))
            if isinstance(exc, PeerUnprovenError):
                self._unproven(exc)
            delay = backoff(1, self.config.interval)
            behind = self.behind.get(name)
            if behind is not None and behind.digest == digest:
                behind.failures += 1
                behind.error, behind.sources = str(exc), tuple(sources)
                delay = backoff(behind.failures, self.config.interval)
                behind.retry_at = trio.current_time() + delay
                assert self._nursery is not None
                self._nursery.start_soon(self._retry, delay)
            log.warning(
                "replicate %s from %s: %s (next try in %s)",
                name,
                ", ".join(sources),
                exc,
                delay_text(delay),
            )
            return
        finally:
            del self.transfers[name]
        self.app.changed()  # the next round sees what the pull wrote
        self.pulled += 1
        for url in sources:
            self.seen(url)  # it sent a model: up, whatever its last listing met
        self.behind.pop(name, None)
        self.local[name] = digest
        try:
            shown = (await self.index()).lookup(name).tag_ids(self.config.prefer)
        except StoreError:  # gone again already: the digest is all there is to show
            shown = tag_ids(digest)
        self.ids[name] = shown
        for result in report.models:
            for url in result.avoided:
                if url in self.peers:
                    self.peers[url].verify_failures += 1
            peer = self.peers.get(sources[0])
            if peer is not None:
                peer.blobs_in += result.fetched
            log.info(
                "replicated %s %s from %s: %s, %d bytes",
                name,
                shown,
                sources[0],
                counted(result.fetched, "blob"),
                result.fetched_bytes,
            )
        self.wake()  # the peers may have moved on meanwhile

    async def _retry(self, delay: float) -> None:
        """Wake the replicator when a back-off ends, so the next try is when the log said."""
        await trio.sleep(delay)
        self.wake(self.replicate_once.__name__)

    def _lied(self, message: str) -> None:
        peer = self._named_in(message)
        if peer is not None:
            peer.verify_failures += 1

    def _unproven(self, exc: PeerUnprovenError) -> None:
        peer = self._named_in(str(exc))
        if peer is not None:
            peer.unproven += 1
            peer.untrusted = distrust(exc, token=peer.token)
            peer.models = {}

    def _named_in(self, message: str) -> PeerState | None:
        """The peer an error message names (each starts with the peer's URL)."""
        for url, peer in self.peers.items():
            if message.startswith(url):
                return peer
        return None

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
        """The first run soon after the start, then each `gc.interval` after the last one
        ended, by the interval in force (a reload reckons again)."""
        first = trio.current_time()
        last: float | None = None

        def due() -> float:
            interval = self.config.gc.interval
            return first + min(GC_FIRST_DELAY, interval) if last is None else last + interval

        while True:
            await self._sleep_until(due)
            if self.config.gc.enabled:
                await self.collect()
            last = trio.current_time()

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
        now, clock = time.time(), trio.current_time()
        return {
            "daemon": {
                "rounds": self.rounds,
                "pin": self.pin,
                "interval": self.config.interval,
                "replicate": list(self.config.replicate),
                "models": self.local,
                "ids": {n: dataclasses.asdict(i) for n, i in self.ids.items()},
                "pulled": self.pulled,
                "pull_failures": self.pull_failures,
                "max_transfers": self.config.max_transfers,
                "transfers": [
                    {
                        "name": t.name,
                        "digest": t.digest,
                        "from": t.sources,
                        "since": t.started,
                        "state": "pulling" if t.pulling else "waiting",
                        "bytes": t.progress.totals.completed,
                        "total_bytes": t.progress.totals.total,
                    }
                    for t in self.transfers.values()
                ],
                "behind": {
                    n: {
                        "digest": b.digest,
                        "reason": b.reason,
                        "since": b.since,
                        "error": b.error,
                        "failures": b.failures,
                        "next_try_seconds": (
                            round(max(b.retry_at - clock, 0.0), 3) if b.failures else None
                        ),
                    }
                    for n, b in sorted(self.behind.items())
                },
                "lag_seconds": {n: round(now - b.since, 3) for n, b in sorted(self.behind.items())},
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
                    "host_id": p.host_id,
                    "ok": p.failures == 0 and p.last_ok is not None,
                    "last_ok": p.last_ok,
                    "error": p.last_error,
                    "models": p.models,
                    "bytes_in": self.session.received(p.url),
                    "blobs_in": p.blobs_in,
                    "verify_failures": p.verify_failures,
                    "proof": self._proof(p),
                    "pin": self.config.pins.get(p.url),
                    "untrusted": p.untrusted,
                    "unproven": p.unproven,
                }
                for p in self.peers.values()
            ],
        }

    def _proof(self, peer: PeerState) -> str:
        """What a peer must show before its answers are used (README, "TLS peers")."""
        if peer.registry:
            return "registry"
        token = "token" if self.session.proof_token else None
        pin = "pin" if peer.url in self.config.pins else None
        return " and ".join(p for p in (pin, token) if p) or "none (no token_file)"

    def lag(self, now: float) -> dict[str, float]:
        """Every selected name here or behind: seconds it has lagged the peers, 0 in step (so
        a dashboard tells "in step" from "not measured")."""
        lag = {n: 0.0 for n in self.local if self.config.wants(n)}
        lag.update({n: round(now - b.since, 3) for n, b in self.behind.items()})
        return lag

    def metrics(self) -> list[tuple[str, str, str, list[tuple[str, float]]]]:
        now = time.time()
        peers = list(self.peers.values())

        def labels(**values: str) -> str:
            quoted = (
                f'{k}="' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                for k, v in values.items()
            )
            return "{" + ",".join(quoted) + "}"

        def label(url: str, **more: str) -> str:
            return labels(peer=url, **more)

        def name_label(n: str) -> str:
            return labels(name=n)

        return [
            (
                "peer_bytes_received_total",
                "counter",
                "Blob bytes received, by peer (of blobs finished or not).",
                [(label(p.url), self.session.received(p.url)) for p in peers],
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
                "peer_unproven_total",
                "counter",
                "Answers from a peer that did not prove it holds the shared token.",
                [(label(p.url), p.unproven) for p in peers],
            ),
            (
                "peer_untrusted",
                "gauge",
                "1 when the peer's last answer was not trusted; the reason is a label.",
                [
                    (label(p.url), 0)
                    if p.untrusted is None
                    else (label(p.url, reason=p.untrusted), 1)
                    for p in peers
                ],
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
                "Seconds a selected name has differed from the peers' version; 0 in step.",
                [(name_label(n), lag) for n, lag in sorted(self.lag(now).items())],
            ),
            (
                "transfers_in_flight",
                "gauge",
                "Pulls running now.",
                [("", sum(t.pulling for t in self.transfers.values()))],
            ),
            (
                "transfer_bytes",
                "gauge",
                "Bytes of each pull in flight that are here so far.",
                [
                    (name_label(t.name), t.progress.totals.completed)
                    for t in self.transfers.values()
                ],
            ),
        ]


def run_daemon(config: SyncConfig, layout: Layout) -> None:
    """`modelfs sync`: until SIGTERM/SIGINT; exit 0."""
    daemon = Daemon(config, layout)
    run_unwrapped(daemon.run)
