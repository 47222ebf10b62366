"""Where things live in a store root, and how the root is found (README: `--store`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from modelfs.store.digest import Digest
from modelfs.store.errors import StoreNotFoundError
from modelfs.store.names import Name

log = logging.getLogger(__name__)

SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")


class Layout:
    """Paths of one store root. Pure arithmetic; nothing here touches the disk."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.manifests_v2 = self.root / "manifests-v2"
        self.state = self.root / ".modelfs"
        self.tmp = self.state / "tmp"
        # manifests-v2 links are made here, then renamed into place: as deep in the store as
        # the folder of a v2 tag (manifests-v2/<host>/<ns>/<model>/), so the relative target
        # they will have there resolves here too. A client that follows links (sshfs
        # `follow_symlinks`) takes a link that resolves nowhere for none, and can neither
        # rename nor remove it.
        self.links = self.tmp / "links" / "v2"
        self.leases = self.state / "leases"
        self.trash = self.state / "trash"
        self.quarantine = self.state / "quarantine"
        self.history = self.state / "history"
        self.compat = self.state / "compat"  # computed tensors of llama.cpp views

    def blob(self, digest: Digest) -> Path:
        return self.blobs / digest.blob_name

    def legacy_manifest(self, name: Name) -> Path:
        return self.manifests.joinpath(*name.legacy_parts())

    def v2_manifest(self, name: Name) -> Path:
        return self.manifests_v2.joinpath(*name.v2_parts())

    def __repr__(self) -> str:
        return f"Layout({str(self.root)!r})"


def find_store_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--store`, else $OLLAMA_MODELS, else ~/.ollama/models, else the system install.

    An explicit or environment root must exist; the home default is used when it exists, the
    system one after it. The choice is always logged, because "my models vanished" is most often
    a different HOME or OLLAMA_MODELS.
    """
    if explicit is not None:
        root, why = Path(explicit), "--store"
    elif (env := os.environ.get("OLLAMA_MODELS", "").strip().strip("\"'")) != "":
        root, why = Path(env), "$OLLAMA_MODELS"
    else:
        home = Path.home() / ".ollama" / "models"
        if home.is_dir() or not SYSTEM_STORE.is_dir():
            root, why = home, "home default"
        else:
            root, why = SYSTEM_STORE, "system install"
    # Absolute, so symlinks made from it (`--data symlink`) resolve from anywhere.
    root = Path(os.path.abspath(root.expanduser()))
    if not root.is_dir():
        if explicit is None and why != "$OLLAMA_MODELS":
            raise StoreNotFoundError(
                f"no model store at {root} or {SYSTEM_STORE} ($OLLAMA_MODELS is unset); "
                "give one with --store DIR or $OLLAMA_MODELS, or write a demo one with "
                "`modelfs demo-store DIR`"
            )
        raise StoreNotFoundError(f"no model store at {root} ({why})")
    log.info("store: %s (%s)", root, why)
    return root
