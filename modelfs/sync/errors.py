"""Errors of the sync layer.

    SyncError                   base: everything `sync` raises about a transfer
    ├── PeerError               a peer answered badly (HTTP status, bad body)
    │   ├── PeerAuthError       401/403: no or wrong token
    │   ├── PeerNotFoundError   404: no such repository, tag or blob
    │   ├── PeerUnprovenError   a peer that did not prove it holds the shared token
    │   └── PeerLiedError       bytes that do not hash to the digest asked for, a wrong length
    ├── PeerUnreachableError    refused connection, DNS, TLS, timeout, stall
    └── LocalWriteError         our side: disk full, permission denied

Each message is one line naming the peer (URL) and what was asked, so the CLI prints it as is.
Store-layer errors (`store.errors.StoreError`) pass through unchanged.
"""

from __future__ import annotations


class SyncError(Exception):
    """Base of every error raised by the sync layer."""


class PeerError(SyncError):
    pass


class PeerAuthError(PeerError):
    pass


class PeerNotFoundError(PeerError):
    pass


class PeerUnprovenError(PeerError):
    pass


class PeerLiedError(PeerError):
    pass


class PeerUnreachableError(SyncError):
    pass


class LocalWriteError(SyncError):
    pass
