"""The ID of a tag, one spelling for every command and log line.

A tag's ID is the first 12 hex digits of the digest of the bytes it names: the manifest for a
plain tag, the manifest list's own bytes for a list. That digest is what peers compare, so it
is the same on every host whatever each one prefers. For a list, the child this host uses
(the mount, `ls`, a pull by `prefer`) is shown beside it, labelled, since that child's
digest is what differs between hosts.

`ollama list` prints the same 12 digits for a plain tag (the sha256 of the manifest file,
ollama/ollama fb30760 manifest/manifest.go:35-37 and server/model_list_cache.go:311-330).
For a list tag it prints the digest of the legacy anchor in `manifests/`, the only file
that Ollama reads (manifest/manifest.go:175-227); the anchor is a local file, not the tag
that hosts share.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelfs.store.digest import Digest


def _short(digest: Digest | str) -> str:
    if isinstance(digest, Digest):
        return digest.short
    return digest.removeprefix("sha256:")[:12]


@dataclass(frozen=True, slots=True)
class TagId:
    """A tag's ID as values (`--json` gives these fields); str() is the sentence a table shows."""

    id: str
    list: bool = False
    child: str | None = None  # for a list: the runner of the child in use here
    child_id: str | None = None  # for a list: that child's ID (its manifest's digest)

    def __str__(self) -> str:
        if not self.list:
            return self.id
        if self.child_id is None:
            return f"{self.id} (list; no child here)"
        return f"{self.id} (list; {self.child + ' ' if self.child else ''}child {self.child_id})"


def tag_ids(
    digest: Digest | str,
    *,
    is_list: bool = False,
    child: Digest | str | None = None,
    runner: str | None = None,
) -> TagId:
    """`digest` is the tag's (the list's own for a list); `child` the list child in use here.
    str() of it: `afc97e655288`, or for a list `afc97e655288 (list; llamacpp child
    907dc2e74c5e)` (`no child here` when none is present)."""
    if not is_list:
        return TagId(_short(digest))
    if child is None:
        return TagId(_short(digest), True)
    return TagId(_short(digest), True, runner or None, _short(child))
