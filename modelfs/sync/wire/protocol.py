"""The wire vocabulary shared by server and client: media types, repository names, paths.

`<repo>` is `<ns>/<model>` on the default host and `<host>/<ns>/<model>` otherwise (README,
"Replication over the OCI distribution API").
"""

from __future__ import annotations

from modelfs.store.errors import InvalidNameError
from modelfs.store.manifest import MEDIA_LIST, MEDIA_MANIFEST, MEDIA_OCI_MANIFEST
from modelfs.store.names import DEFAULT_HOST, Name

# What a client asks for, in order of preference; Ollama's list type first, as PR16590 does.
MANIFEST_ACCEPT = ", ".join((MEDIA_LIST, MEDIA_MANIFEST, MEDIA_OCI_MANIFEST))
DIGEST_HEADER = "Docker-Content-Digest"
API_VERSION_HEADER = ("Docker-Distribution-API-Version", "registry/2.0")
# A modelfs server names its host (`host_id`) on every answer, so a daemon shows its peers
# by name; a daemon takes it only from an answer that proved the shared token. A daemon's
# requests to its peers carry it too: a peer that has it down lists it again at once.
HOST_HEADER = "Modelfs-Host"
# A modelfs server's `tags/list` answer also gives, in step with `tags`, each model's name
# as its store spells it: the repository is lowercase (OCI), the store's names need not be.
# OCI clients ignore a field they do not know.
NAMES_FIELD = "modelfs.names"
MAX_HOST_ID = 253


def repository_of(name: Name) -> str:
    return name.repository


def name_from_repository(repo: str, tag: str) -> Name:
    """The model a `<repo>` and tag stand for; InvalidNameError for anything else.

    Two parts are `<ns>/<model>` on the default host; three are `<host>/<ns>/<model>`.
    """
    parts = repo.split("/")
    if len(parts) == 2:
        host, (namespace, model) = DEFAULT_HOST, parts
    elif len(parts) == 3:
        host, namespace, model = parts
        # `modelfs push` writes a port's ':' as '__' (sync/wire/registry_names.py); no real host
        # holds '__', so reading it back is unambiguous and both spellings reach one model.
        host = host.replace("__", ":")
    else:
        raise InvalidNameError(f"repository {repo!r} is not <ns>/<model> or <host>/<ns>/<model>")
    return Name.from_parts(host, namespace, model, tag)
