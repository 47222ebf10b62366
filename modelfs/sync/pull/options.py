"""What a pull is asked to do (`PullOptions`) and what it did for one model (`ModelResult`).

Below the puller, the blob transfers and the fast path, which all take them, so none of those
imports another to name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.scan import DEFAULT_PREFER
from modelfs.sync.client.http import READ_TIMEOUT

MiB = 1 << 20


@dataclass(frozen=True)
class PullOptions:
    prefer: tuple[str, ...] = DEFAULT_PREFER
    all_variants: bool = False
    # When no peer has the preferred child of a list: take the next one some peer has (a
    # pull by hand), or fail and write nothing (the sync daemon: the old version stays
    # rather than the tag switching to a variant this host did not choose).
    fallback: bool = True
    read_timeout: float = READ_TIMEOUT
    small_max: int = 8 * MiB  # blobs below this are fetched whole, in memory
    parallel_min: int = 256 * MiB  # blobs from this size on may use several connections:
    workers: int = 4  # up to this many,
    parallel_below: float = 256e6  # when one brings less than this many bytes/s
    chunk: int = 16 * MiB  # one receive buffer; one ranged GET when several connections
    max_blobs: int = 4  # blobs in flight at once
    checkpoint_every: float = 1.0
    rounds: int = 2  # tries per source and blob, for transient failures
    # While blobs are fetched, those of the model already here get a fresh mtime this often:
    # Ollama's prune spares what is under an hour old, and it does not read our leases.
    freshen_every: float = 15 * 60.0


@dataclass
class ModelResult:
    name: str
    digest: Digest
    written: list[str] = field(default_factory=list)
    fetched: int = 0
    fetched_bytes: int = 0
    present: int = 0
    avoided: dict[str, str] = field(default_factory=dict)  # peer URL -> what it did

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest.hex,
            "written": self.written,
            "fetched": self.fetched,
            "fetched_bytes": self.fetched_bytes,
            "present": self.present,
            "avoided": self.avoided,
        }
