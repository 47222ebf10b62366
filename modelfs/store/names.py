"""Model names, parsed exactly as Ollama parses them (types/model/name.go).

A name is four parts, `host/namespace/model:tag`. Every part is checked against Ollama's
regexes, none of which admits `/`, `\\` or a leading `.`, so a valid name can never become a
path outside the store. Lookup is case-insensitive per part (Ollama's `getExistingName`), and
the on-disk spelling is what we show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from modelfs.store.errors import InvalidNameError

DEFAULT_HOST = "registry.ollama.ai"
# How manifests-v2/ spells the default host (Ollama's manifest-list layout). In a name and in
# manifests/, `ollama.com` is a host of its own, as at ollama/ollama fb30760
# (types/model/name.go:231-249 compares with `registry.ollama.ai` only).
DEFAULT_HOST_V2 = "ollama.com"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# Repository paths a registry serves: both spellings are the default registry there.
DEFAULT_HOSTS = frozenset({DEFAULT_HOST, DEFAULT_HOST_V2})

_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}")
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}")
_MODEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
_TAG = _MODEL
# All four at once, for the check a scan makes of every tag: no part's pattern admits `/`,
# so the three slashes are the separators and each part meets its own pattern.
_FULL = re.compile("/".join(p.pattern for p in (_HOST, _NAMESPACE, _MODEL, _TAG)))

_MISSING = ""


@dataclass(frozen=True, slots=True)
class Name:
    """A fully qualified model name. Construct with `parse_name` or `Name.from_parts`."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def from_parts(cls, host: str, namespace: str, model: str, tag: str) -> Name:
        name = cls(host, namespace, model, tag)
        name.check()
        return name

    def check(self) -> None:
        host, namespace, model, tag = self.host, self.namespace, self.model, self.tag
        # Spelled out, not all() over a generator: a scan checks every tag's name.
        if (
            type(host) is str
            and type(namespace) is str
            and type(model) is str
            and type(tag) is str
            and _FULL.fullmatch(f"{host}/{namespace}/{model}/{tag}") is not None
        ):
            return
        for part, regex, what in (
            (self.host, _HOST, "host"),
            (self.namespace, _NAMESPACE, "namespace"),
            (self.model, _MODEL, "model"),
            (self.tag, _TAG, "tag"),
        ):
            if not isinstance(part, str) or regex.fullmatch(part) is None:
                raise InvalidNameError(f"invalid {what} {part!r} in model name {self.full!r}")

    @property
    def is_default_host(self) -> bool:
        return self.host.lower() == DEFAULT_HOST

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Identity for case-insensitive lookup (Ollama's getExistingName)."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    @property
    def full(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def shortest(self) -> str:
        """Ollama's DisplayShortest: drop the default host and `library`; always `model:tag`."""
        if not self.is_default_host:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def repository(self) -> str:
        """The OCI repository: `<ns>/<model>` on the default host, `<host>/<ns>/<model>` else."""
        if self.is_default_host:
            return f"{self.namespace}/{self.model}"
        return f"{self.host}/{self.namespace}/{self.model}"

    def legacy_parts(self) -> tuple[str, str, str, str]:
        """Path parts under `manifests/`, as spelled."""
        return (self.host, self.namespace, self.model, self.tag)

    def v2_parts(self) -> tuple[str, str, str, str]:
        """Path parts under `manifests-v2/`: the default host as `ollama.com`, `:` as `%3A`.
        (A host named `ollama.com` has the same folder: that layout has one for both.)"""
        host = DEFAULT_HOST_V2 if self.is_default_host else self.host.replace(":", "%3A")
        return (host, self.namespace, self.model, self.tag)

    def with_tag(self, tag: str) -> Name:
        return Name.from_parts(self.host, self.namespace, self.model, tag)

    def __str__(self) -> str:
        return self.shortest


def _cut_last(s: str, sep: str) -> tuple[str, str, bool]:
    i = s.rfind(sep)
    if i < 0:
        return s, "", False
    return s[:i], s[i + len(sep) :], True


def parse_name_bare(s: str) -> tuple[str, str, str, str]:
    """Split without defaults, as Ollama's ParseNameBare: (host, namespace, model, tag).

    An empty piece between separators is kept empty, which later fails validation (Ollama
    puts `!MISSING!` there for the same effect).
    """
    host = namespace = model = tag = _MISSING
    # "/" cannot be in a tag, so a ':' after the last '/' starts the tag; before it, a ':' is
    # a port in the host.
    if s.rfind(":") > s.rfind("/"):
        s, tag, _ = _cut_last(s, ":")
        tag = tag or "\0"  # "model:" is invalid, not "model:latest"
    s, model, cut = _cut_last(s, "/")
    if not cut:
        return host, namespace, s, tag
    model = model or "\0"
    s, namespace, cut = _cut_last(s, "/")
    if not cut:
        return host, s or "\0", model, tag
    namespace = namespace or "\0"
    scheme, sep, rest = s.partition("://")
    host = rest if sep else scheme
    return host or "\0", namespace, model, tag


def parse_name(s: str) -> Name:
    """Parse a user-given name and fill in Ollama's defaults; raise InvalidNameError."""
    if not isinstance(s, str) or not s.strip():
        raise InvalidNameError(f"invalid model name {s!r}")
    host, namespace, model, tag = parse_name_bare(s)
    name = Name(
        host or DEFAULT_HOST,
        namespace or DEFAULT_NAMESPACE,
        model,
        tag or DEFAULT_TAG,
    )
    try:
        name.check()
    except InvalidNameError:
        raise InvalidNameError(f"invalid model name {s!r}") from None
    return name


def name_from_path_parts(parts: tuple[str, ...] | list[str], *, v2: bool) -> Name:
    """The name a manifest file stands for, from its four path parts below the manifests dir.

    Rejects the wrong depth, `.`/`..` and hidden files, as ParseNameFromFilepath does.
    """
    if len(parts) != 4:
        raise InvalidNameError(f"manifest path {'/'.join(parts)!r} is not host/ns/model/tag")
    host, namespace, model, tag = parts
    if v2:
        host = host.replace("%3A", ":").replace("%3a", ":")
        if host.lower() == DEFAULT_HOST_V2:
            host = DEFAULT_HOST
    return Name.from_parts(host, namespace, model, tag)
