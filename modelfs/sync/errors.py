"""Errors of the sync layer.

    SyncError                   base: everything `sync` raises (the CLI prints it as one line)
    ├── PeerError               a peer answered badly (HTTP status, bad body)
    │   ├── PeerAuthError       401/403: no or wrong token
    │   ├── PeerNotFoundError   404: no such repository, tag or blob
    │   ├── PeerUnprovenError   a peer that did not prove it holds the shared token
    │   │   └── PeerCertificateError   its TLS certificate is not the one its `pin` names
    │   └── PeerLiedError       bytes that do not hash to the digest asked for, a wrong length
    ├── PeerUnreachableError    refused connection, DNS, TLS, timeout, stall
    ├── LocalWriteError         our side: disk full, permission denied
    └── elsewhere in sync/: ConfigError, CredentialsError, PushError, ServeError (the server
        cannot start), AccessConfigError (an unusable keys file)

Each message is one line naming the peer (URL) and what was asked, so the CLI prints it as is.
Store-layer errors (`store.errors.StoreError`) pass through unchanged. `local_error` turns an
OSError of writing into the store into the `LocalWriteError` that names the store.
"""

from __future__ import annotations

import errno

from modelfs.store.layout import Layout


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


class PeerCertificateError(PeerUnprovenError):
    pass


class PeerLiedError(PeerError):
    pass


class PeerUnreachableError(SyncError):
    pass


class LocalWriteError(SyncError):
    pass


def local_error(exc: OSError, layout: Layout, what: str) -> LocalWriteError:
    """`exc`, raised writing `what` into the store at `layout`, as one line naming the store."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LocalWriteError(f"no space left on device for {what} in the store {layout.root}")
    if exc.errno == errno.EXDEV:
        return LocalWriteError(
            f"{layout.tmp} and {layout.blobs} are on different filesystems; cannot write {what}"
        )
    why = exc.strerror or str(exc)
    return LocalWriteError(f"cannot write {what} in the store {layout.root}: {why}")
