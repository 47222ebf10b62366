"""What the sync daemon knows of each peer and each name it follows: a peer's state and its
back-off after failures (`PeerState`, `backoff`), why a failed peer is untrusted rather than
down (`distrust`), a transfer under way (`Transfer`) and a name behind its peers (`Behind`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import trio

from modelfs.store.units import format_duration
from modelfs.sync.errors import PeerAuthError, PeerCertificateError, PeerUnprovenError
from modelfs.sync.pull.progress import TallyProgress
from modelfs.sync.wire.pins import UNPINNED

log = logging.getLogger(__name__)

MAX_BACKOFF = 3600.0
SEEN_AGAIN_EVERY = 1.0  # seconds: a peer down and seen up since is listed at most this often


def backoff(failures: int, interval: float) -> float:
    """Seconds from a failure to the next try, after `failures` in a row: the interval,
    doubled each time, at most MAX_BACKOFF."""
    return min(interval * 2.0 ** min(failures - 1, 16), MAX_BACKOFF)


def delay_text(delay: float) -> str:
    return format_duration(round(delay, 1))


@dataclass
class PeerState:
    url: str
    host_id: str | None = None  # as its proven listings name it (protocol.HOST_HEADER)
    failures: int = 0
    failed_at: float = 0.0  # trio clock, of the last failure
    listed_at: float = 0.0  # trio clock, when the last listing began
    seen_at: float = -math.inf  # trio clock, when it was last up by another path than listing
    last_error: str | None = None
    last_ok: float | None = None  # wall clock
    models: dict[str, str] = field(default_factory=dict)  # shortest name -> digest hex
    blobs_in: int = 0
    verify_failures: int = 0  # bytes that did not hash to the digest asked for
    registry: bool = False  # an OCI registry (`registries`): no proof of the token asked
    token: bool = False  # a peer that must hold this host's token (not a registry; a token_file)
    unproven: int = 0  # answers that did not prove the shared token (impostors)
    untrusted: str | None = None  # why its last answer was not trusted (`distrust`)
    scope: trio.CancelScope | None = None  # its listing task, cancelled when it leaves the config

    def next_try(self, interval: float) -> float:
        """When to list it next (trio clock), by the interval in force now. A peer down and
        seen up since by another path (its daemon called us, it sent a blob) is listed at
        once, not after the rest of its back-off (at most once a second)."""
        if self.failures:
            due = self.failed_at + backoff(self.failures, interval)
            if self.seen_at > self.failed_at:
                due = min(due, max(self.seen_at, self.listed_at + SEEN_AGAIN_EVERY))
            return due
        return self.listed_at + interval

    def failed(self, exc: BaseException, interval: float) -> None:
        if isinstance(exc, PeerUnprovenError):
            self.unproven += 1
        self.untrusted = distrust(exc, token=self.token)
        if self.untrusted is not None:
            self.models = {}  # whatever it listed before is not to be trusted either
            self.host_id = None  # nor the name: who answers there now is not the peer
        self.failures += 1
        # Sync errors start with the peer's URL; the log line and status name it once.
        message = str(exc).removeprefix(f"{self.url}: ")
        self.last_error = message
        self.failed_at = trio.current_time()
        delay = delay_text(backoff(self.failures, interval))
        if self.failures == 1:
            log.warning("peer %s: %s (next try in %s)", self.url, message, delay)
        else:
            log.info(
                "peer %s: %s (%d failures in a row; next try in %s)",
                self.url,
                message,
                self.failures,
                delay,
            )

    def succeeded(self) -> None:
        if self.failures:
            log.info("peer %s: reachable again", self.url)
        self.failures, self.last_error, self.last_ok = 0, None, time.time()
        self.untrusted = None


def distrust(exc: BaseException, *, token: bool) -> str | None:
    """Why a peer that failed so is UNTRUSTED rather than DOWN (None: it is only DOWN). A
    peer that must hold the shared `token` and answers 401/403 refuses it: it has another
    token, or is not one of ours."""
    if isinstance(exc, PeerCertificateError):
        return UNPINNED
    if isinstance(exc, PeerUnprovenError):
        return "no proof of the shared token"
    if isinstance(exc, PeerAuthError) and token:
        return "refuses the shared token"
    return None


@dataclass
class Transfer:
    name: str
    digest: str
    sources: list[str]
    started: float = field(default_factory=time.time)
    pulling: bool = False  # False while it waits for one of the `max_transfers` slots
    progress: TallyProgress = field(default_factory=TallyProgress)


@dataclass
class Behind:
    """A selected name whose version here is not the peers' (or lacks its preferred
    variant): why, since when, and when it is tried again after failures."""

    digest: str  # what the peers have
    reason: str
    since: float = field(default_factory=time.time)  # wall clock
    error: str | None = None  # the last try's
    failures: int = 0
    sources: tuple[str, ...] = ()  # of the last failed try; others are tried at once
    retry_at: float = 0.0  # trio clock
