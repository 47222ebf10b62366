"""Ollama model names <-> OCI repository names, for pushing to and pulling from registries.

An OCI repository is one or more `/`-separated path components, each matching
`[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*`, at most 255 characters in all. Tags are
`[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`. Ollama's parts are wider (uppercase, a leading `_`,
separators side by side or at the end, `:` in a host), so some names need a rule:

    host/ns/model:tag                   repository                          tag
    registry.ollama.ai/library/gemma4:26b   library/gemma4                  26b
    someuser/tiny:q8                    someuser/tiny                       q8
    ollama.com/library/qwen3:0.6b       ollama.com/library/qwen3            0.6b
    hf.co/bartowski/SmolLM2-GGUF:Q4_K_M hf.co/bartowski/smollm2-gguf        Q4_K_M
    localhost:5000/me/m:1               localhost__5000/me/m                1
    registry.ollama.ai/library/_x:1     refused: '_x' cannot start an OCI component

- The default host (`registry.ollama.ai`) is left out: `<ns>/<model>`. Any other host is the
  first of three components, `ollama.com` too: it is a host of its own in Ollama's names
  (ollama/ollama fb30760 types/model/name.go:231-249).
- A name pushed to or pulled from **its own host's registry** is `<ns>/<model>` there
  (`own_repository`; `docker.io` is served by registry-1.docker.io), as docker names images; a
  pull then tries the three-component form too, where earlier versions pushed such a name.
- **Case is folded to lowercase** in the repository. Ollama's own identity of a name is
  case-insensitive per part (`getExistingName`), so `SmolLM2` and `smollm2` are one model and
  this loses nothing Ollama distinguishes; the spelling on disk comes from the name given to
  `modelfs pull`; a catalog-driven pull takes a modelfs peer's spelling from its `tags/list`
  answer (protocol.NAMES_FIELD) and a registry's lowercase one. Tags are valid OCI
  tags as they are, so they keep their case.
- **A port's `:` in a host becomes `__`** (`localhost:5000` -> `localhost__5000`), and `__`
  in the host component becomes `:` again. DNS names never hold `_`, so this is reversible for
  every real host; a host that already contains `__` is refused.
- Everything else an OCI component cannot hold (a leading `_`, `..`, `_.`, `___`, a trailing
  separator, more than 255 characters) is **refused** with one line naming the part.

Why refuse instead of escaping: every string that is a valid OCI component is also a valid
Ollama model or tag part, so no escape can leave ordinary names readable *and* be reversible
(an escaped `_x` would have to land on some valid component `y`, which is also the name of
the model `y`). Such names are unusual, and `ollama cp` gives a model a pushable name.

Round trip, property-tested: for every name that maps, `name_for(repository_for(n), n.tag)`
has the same `key` as `n` (equal for a lowercase name); for every 2- or 3-component
repository that decodes, `repository_for(name_for(r, t)) == r`, except that a 3-component
repository whose host is Ollama's default host reads as the 2-component one.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from modelfs.store.errors import InvalidNameError
from modelfs.store.names import DEFAULT_HOST, Name

COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
MAX_REPOSITORY = 255

_PORT_OCI = "__"


class RegistryNameError(InvalidNameError):
    """A model name with no OCI repository name, or a repository that is no Ollama name."""


def _component(part: str, what: str, name: Name, mapped: str | None = None) -> str:
    lowered = (mapped if mapped is not None else part).lower()
    if COMPONENT.fullmatch(lowered) is None:
        raise RegistryNameError(
            f"cannot push {name.shortest!r} to a registry: {what} {part!r} is not a valid OCI "
            "repository component (lowercase letters and digits, joined by '.', '_', '__' or "
            "'-'); give the model another name with `ollama cp`"
        )
    return lowered


def repository_for(name: Name) -> str:
    """The OCI repository a model is pushed to; RegistryNameError if it has none."""
    parts: list[str] = []
    if not name.is_default_host:
        host = name.host.lower()
        if _PORT_OCI in host:
            raise RegistryNameError(
                f"cannot push {name.shortest!r} to a registry: host {name.host!r} contains "
                "'__', which stands for a port's ':' in a repository name"
            )
        parts.append(_component(name.host, "host", name, host.replace(":", _PORT_OCI)))
    parts.append(_component(name.namespace, "namespace", name))
    parts.append(_component(name.model, "model", name))
    repo = "/".join(parts)
    if len(repo) > MAX_REPOSITORY:
        raise RegistryNameError(
            f"cannot push {name.shortest!r} to a registry: repository {repo[:40]!r}… is "
            f"{len(repo)} characters, more than the {MAX_REPOSITORY} OCI allows"
        )
    return repo


# Docker's own names: `docker.io/<ns>/<model>` is served by these hosts as `<ns>/<model>`.
_HOST_ALIASES = {"docker.io": ("docker.io", "registry-1.docker.io", "index.docker.io")}


def own_repository(name: Name, url: str) -> str | None:
    """The repository a registry at `url` holds `name` under when the name's host is that
    registry's own (`ghcr.io/org/m` on https://ghcr.io is `org/m`, `docker.io/ai/m` on
    Docker Hub `ai/m`), as docker names images; None when the hosts differ."""
    if name.is_default_host:
        return None
    u = urlsplit(url)
    host = name.host.lower()
    if (u.netloc.lower() or "-") not in _HOST_ALIASES.get(host, (host,)):
        return None
    repo = f"{_component(name.namespace, 'namespace', name)}/"
    return repo + _component(name.model, "model", name)


def tag_for(name: Name) -> str:
    """The OCI tag: Ollama's tag as it is (every Ollama tag is a valid OCI tag)."""
    if TAG.fullmatch(name.tag) is None:  # cannot happen for a checked Name; stay explicit
        raise RegistryNameError(f"tag {name.tag!r} of {name.shortest!r} is not a valid OCI tag")
    return name.tag


def reference_for(name: Name) -> tuple[str, str]:
    """(repository, tag) for a model name."""
    return repository_for(name), tag_for(name)


def name_for(repository: str, tag: str) -> Name:
    """The model a registry repository and tag stand for; RegistryNameError otherwise.

    Two components are `<ns>/<model>` on the default host, three are `<host>/<ns>/<model>`,
    with `__` in the host read back as `:`.
    """
    parts = repository.split("/")
    if len(parts) not in (2, 3) or any(COMPONENT.fullmatch(p) is None for p in parts):
        raise RegistryNameError(
            f"repository {repository!r} is not <ns>/<model> or <host>/<ns>/<model>"
        )
    if len(parts) == 2:
        host, (namespace, model) = DEFAULT_HOST, parts
    else:
        host_part, namespace, model = parts
        host = host_part.replace(_PORT_OCI, ":")
    try:
        return Name.from_parts(host, namespace, model, tag)
    except InvalidNameError as exc:
        raise RegistryNameError(
            f"repository {repository!r} tag {tag!r} is not an Ollama model name ({exc})"
        ) from None


def repositories(name: Name, url: str | None = None) -> list[str]:
    """The repository names to ask a peer or registry for a model, in order.

    First, when the name's host is the registry's at `url` (`ghcr.io/org/m` from
    https://ghcr.io), the repository without the host, as other clients push it there. Then the
    lowercase OCI spelling that push uses (`repository_for`); a modelfs peer looks names up
    case-insensitively either way. The plain form (`name.repository`) follows when it differs
    (a host with a port).
    """
    out: list[str] = []
    try:
        own = own_repository(name, url) if url is not None else None
        out += [own] if own is not None else []
        out.append(repository_for(name))
    except InvalidNameError:
        pass
    if name.repository not in out:
        out.append(name.repository)
    return out
