"""Which blobs get a llama.cpp view, remembered from one mount to the next.

Whether a GGUF needs a view is known only once its whole header is read: 0.1-0.3 s for a
Llama 3 vocabulary, for every such model at every mount start, before the mount is ready.
The answer depends on the blob's bytes alone (its digest), so it is kept in
`.modelfs/compat-decisions.json`. With it, a mount knows at once which model directories
hold a `llama.cpp/` (their link counts say so) and makes the views only when one is first
looked into. A lost, stale or damaged file costs the time to decide again and nothing else:
the views themselves are always made from the blob.

A decision is "none", "model", "model+mmproj" (a model blob whose clip tensors make an
mmproj.gguf too) or "view" (a projector blob). A blob that could not be read is decided
again at the next mount: the error may pass (an NFS hiccup).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from modelfs.store.digest import Digest
from modelfs.store.disk.fileio import open_binary
from modelfs.store.disk.owner import write_atomic
from modelfs.store.layout import Layout

log = logging.getLogger(__name__)

NAME = "compat-decisions.json"
VERSION = 1


def _rules() -> str:
    """A fingerprint of the code that decides: a release (or another host's modelfs) with
    other rules must not be trusted to have decided as this one would."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


RULES = _rules()
_VALID = ("none", "model", "model+mmproj", "view")


class Decisions:
    """The decisions file of one store: read once, written after a build that changed it."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.path = layout.state / NAME
        self._known: dict[str, str] = {}
        self._used: set[str] = set()
        self._dirty = False
        try:
            with open_binary(self.path) as f:
                data = json.loads(f.read(16 << 20))
            if (
                isinstance(data, dict)
                and data.get("version") == VERSION
                and data.get("rules") == RULES
            ):
                known = data.get("decisions")
                if isinstance(known, dict):
                    self._known = {
                        k: v
                        for k, v in known.items()
                        if isinstance(k, str) and isinstance(v, str) and v in _VALID
                    }
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.info("%s: %s; deciding again", self.path, exc)

    @staticmethod
    def _key(kind: str, digest: Digest) -> str:
        return f"{kind}:{digest.hex}"

    def get(self, kind: str, digest: Digest) -> str | None:
        key = self._key(kind, digest)
        value = self._known.get(key)
        if value is not None:
            self._used.add(key)
        return value

    def put(self, kind: str, digest: Digest, value: str) -> None:
        if value not in _VALID:
            return  # an error: decided again next time
        key = self._key(kind, digest)
        self._used.add(key)
        if self._known.get(key) != value:
            self._known[key] = value
            self._dirty = True

    def save(self) -> None:
        """Write what this mount decided, keeping only the blobs its builds met (so the file
        never outgrows the store); a store this process may not write is left alone."""
        stale = set(self._known) - self._used
        if not (self._dirty or stale):
            return
        for key in stale:
            del self._known[key]
        body = {
            "version": VERSION,
            "rules": RULES,
            "decisions": dict(sorted(self._known.items())),
        }
        try:
            write_atomic(self.path, json.dumps(body, indent=0).encode(), self.layout.root)
        except OSError as exc:
            log.debug("%s: not written: %s", self.path, exc.strerror or exc)
            return
        self._dirty = False

    def views(self) -> list[tuple[str, Digest]]:
        """(kind, digest) of the blobs the last build met that get a view."""
        out = []
        for key in sorted(self._used):
            if self._known.get(key, "none") != "none":
                kind, hex_ = key.split(":", 1)
                out.append((kind, Digest(hex_)))
        return out

    def forget_use(self) -> None:
        """A new build begins: what it meets is what the next save keeps."""
        self._used = set()
