"""Errors of the store layer.

    StoreError                      base: everything `store` raises on bad input
    ├── InvalidNameError            a model name that breaks Ollama's rules
    ├── InvalidDigestError          not `sha256:<64 hex>` / `sha256-<64 hex>`
    ├── StoreNotFoundError          no store root where one was asked for
    ├── ModelNotFoundError          no manifest for a name
    ├── ManifestError               empty, truncated, non-JSON or ill-shaped manifest
    ├── BlobError                   a blob is missing or its bytes do not match
    │   ├── MissingBlobError
    │   └── CorruptBlobError
    ├── HeaderError                 a GGUF or safetensors header we refuse to read
    │   ├── GGUFError
    │   └── SafetensorsError
    ├── LockError                   a lock file (GC, a blob being fetched)
    │   ├── LockBusyError           held by a live owner
    │   └── LockLostError           ours no longer: removed or taken over
    ├── GcRefusedError              GC cannot know what is safe to delete
    └── DamagedIndexError           an index under `.modelfs/` not of the shape we write,
                                    found where it cannot be made good (store.index.shape)

Each message is one line that names the file or the value at fault, so the CLI can print it
as it is and the other layers can map the class to an errno or HTTP status in one place.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error raised by the store layer."""


class InvalidNameError(StoreError, ValueError):
    pass


class InvalidDigestError(StoreError, ValueError):
    pass


class StoreNotFoundError(StoreError):
    pass


class ModelNotFoundError(StoreError, LookupError):
    pass


class ManifestError(StoreError):
    pass


class BlobError(StoreError):
    pass


class MissingBlobError(BlobError):
    pass


class CorruptBlobError(BlobError):
    pass


class HeaderError(StoreError):
    pass


class GGUFError(HeaderError):
    pass


class SafetensorsError(HeaderError):
    pass


class LockError(StoreError):
    pass


class LockBusyError(LockError):
    pass


class LockLostError(LockError):
    pass


class GcRefusedError(StoreError):
    pass


class DamagedIndexError(StoreError):
    """An index's data, found at its use not to be of the shape we write, that cannot be made
    good there (a manifest of another kind than its file holds): a scan meeting it starts
    again without the index; after a scan, the command fails once, and the index is gone."""
