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

from modelfs.store.digest import Digest


def _short(digest: Digest | str) -> str:
    if isinstance(digest, Digest):
        return digest.short
    return digest.removeprefix("sha256:")[:12]


def tag_id(
    digest: Digest | str,
    *,
    is_list: bool = False,
    child: Digest | str | None = None,
    runner: str | None = None,
) -> str:
    """`afc97e655288`, or for a manifest list
    `afc97e655288 (list; llamacpp child 907dc2e74c5e)` (`no child here` when none is present).

    `digest` is the tag's (the list's own for a list); `child` the list child in use here."""
    short = _short(digest)
    if not is_list:
        return short
    if child is None:
        return f"{short} (list; no child here)"
    return f"{short} (list; {runner + ' ' if runner else ''}child {_short(child)})"
