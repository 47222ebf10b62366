"""The daemon's TOML config (README, "The sync daemon"), checked whole before anything starts.

Every mistake is one line naming the file and the key: an unknown key (a typo must not be
silently ignored), a wrong type, a bad value. Defaults are the README's; the store falls back
to the discovery rules of modelfs/store/layout.py when the key is absent.
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from modelfs.store.collect.gc import GcPolicy, grace_problem
from modelfs.store.disk.fileio import read_file
from modelfs.store.errors import InvalidNameError
from modelfs.store.leases import DEFAULT_TTL
from modelfs.store.lockfile import host_id
from modelfs.store.scan import DEFAULT_PREFER
from modelfs.store.units import parse_duration
from modelfs.sync.errors import SyncError
from modelfs.sync.mirror.mirror import DEFAULT_TTL as MIRROR_TTL
from modelfs.sync.registry.serve import DEFAULT_PORT, ServeError, parse_listen
from modelfs.sync.wire.pins import parse_pin
from modelfs.sync.wire.realm import parse_public_url

T = TypeVar("T")
MAX_CONFIG_BYTES = 1 << 20
MAX_TRANSFERS = 3  # names pulled at once by default, so a small change never waits for a big one


class ConfigError(SyncError):
    """A config file the daemon will not start with; one line naming the key."""


@dataclass(frozen=True, slots=True)
class GcSettings:
    enabled: bool = True
    interval: float = 3600.0
    grace: float = 3600.0
    lease_ttl: float = DEFAULT_TTL
    trash_retention: float = 86400.0
    history_retention: float = 7 * 86400.0
    grace_below_floor: bool = False

    def policy(self) -> GcPolicy:
        return GcPolicy(
            grace=self.grace,
            trash_retention=self.trash_retention,
            below_floor=self.grace_below_floor,
        )


DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"
DEFAULT_CONFIG = Path("/etc/modelfs/config.toml")  # where the packaged unit points `--config`


@dataclass(frozen=True, slots=True)
class SyncConfig:
    path: Path
    store: Path | None = None
    host_id: str = field(default_factory=host_id)
    listen: str = DEFAULT_LISTEN
    token_file: Path | None = None
    authorized_keys: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Where clients reach this host besides its own names (serve --public-url).
    public_urls: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    pins: Mapping[str, str] = field(default_factory=dict)  # peer URL -> its pin (sync.pins)
    registries: tuple[str, ...] = ()  # OCI registries: sources that prove no modelfs token
    replicate: tuple[str, ...] = ()
    prefer: tuple[str, ...] = DEFAULT_PREFER
    interval: float = 60.0
    max_transfers: int = MAX_TRANSFERS
    # `mirror`: the server is a pull-through cache of this registry (sync.mirror);
    # `docker_config`: the docker config.json whose credentials go to registries.
    mirror: str | None = None
    mirror_ttl: float = MIRROR_TTL
    docker_config: Path | None = None
    gc: GcSettings = field(default_factory=GcSettings)

    @property
    def local_url(self) -> str:
        """Where a client on this host reaches the daemon: its `listen` address, a wildcard
        one (all addresses) as loopback."""
        host, port = parse_listen(self.listen)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls_cert is not None else 'http'}://{host}:{port}"

    @property
    def sources(self) -> tuple[str, ...]:
        """Every URL listed and pulled from: the peers, then the registries."""
        return self.peers + tuple(u for u in self.registries if u not in self.peers)

    def wants(self, name: str) -> bool:
        """Does `replicate` select this model name (its shortest form, `model:tag`)?"""
        return any(fnmatch.fnmatchcase(name.lower(), pattern.lower()) for pattern in self.replicate)


class _Reader:
    def __init__(self, path: Path, table: dict[str, Any], prefix: str = "") -> None:
        self.path = path
        self.table = table
        self.prefix = prefix
        self.used: set[str] = set()

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.prefix}{key}: {message}")

    def get(self, key: str, kind: type[T] | tuple[type, ...], default: T) -> T:
        self.used.add(key)
        if key not in self.table:
            return default
        value = self.table[key]
        # bool is an int in Python; a `true` where a number belongs is still a mistake.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise self.fail(
                key, f"expected {_toml_kind(names)}, got {_toml_kind(type(value).__name__)}"
            )
        return value  # type: ignore[return-value]

    def convert(self, key: str, default: T, parse: Callable[[Any], T], kind: type = str) -> T:
        raw = self.get(key, kind, None)
        if raw is None:
            return default
        try:
            return parse(raw)
        except (ValueError, ServeError, InvalidNameError) as exc:
            raise self.fail(key, str(exc)) from None

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(key, list, None)
        if value is None:
            return default
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip():
                raise self.fail(f"{key}[{i}]", "expected a non-empty string")
        return tuple(v.strip() for v in value)

    def check_unknown(self, sections: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        for key in self.table:
            if key not in self.used and key not in sections:
                raise self.fail(key, "unknown key")


def _toml_kind(python: str) -> str:
    return {
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "list": "a list",
        "dict": "a table",
    }.get(python, python)


def _duration(text: str) -> float:
    return parse_duration(text)


def _positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError(f"expected a positive duration, got {text!r}")
    return value


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
        raise ValueError(f"expected http://HOST[:PORT] or https://HOST[:PORT], got {text!r}")
    return text.rstrip("/")


def _public_url(text: str) -> str:
    parse_public_url(text)  # ValueError, said for the key
    return text


def _pattern(text: str) -> str:
    """A glob over model names (`gemma4:*`, `hf.co/*`), matched against the shortest form."""
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"a name or glob holds no spaces or control characters: {text!r}")
    return text


def load_config(path: str | os.PathLike[str]) -> SyncConfig:
    """Read and check the whole file; ConfigError (one line) on the first problem."""
    path = Path(path)
    try:
        raw = read_file(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None

    r = _Reader(path, table)
    store = r.convert("store", None, lambda s: Path(s).expanduser())
    host = r.convert("host_id", host_id(), _host_id)
    listen = r.convert("listen", DEFAULT_LISTEN, _listen)
    token_file = r.convert("token_file", None, Path)
    authorized_keys = r.convert("authorized_keys", None, lambda s: Path(s).expanduser())
    tls_cert = r.convert("tls_cert", None, Path)
    tls_key = r.convert("tls_key", None, Path)
    if (tls_cert is None) != (tls_key is None):
        raise r.fail("tls_cert", "tls_cert and tls_key go together")
    public_urls = tuple(_checked(r, "public_urls", _public_url))
    peers, pins = _peers(r)
    registries = tuple(_checked(r, "registries", _url))
    replicate = tuple(_checked(r, "replicate", _pattern))
    prefer = tuple(p.lower() for p in r.strings("prefer", DEFAULT_PREFER))
    interval = r.convert("interval", 60.0, _positive_duration)
    max_transfers = r.get("max_transfers", int, MAX_TRANSFERS)
    if not 1 <= max_transfers <= 64:
        raise r.fail("max_transfers", f"expected 1 to 64, got {max_transfers}")
    mirror = r.convert("mirror", None, _url)
    mirror_ttl = r.convert("mirror_ttl", MIRROR_TTL, _duration)
    docker_config = r.convert("docker_config", None, lambda s: Path(s).expanduser())

    gc_table = r.get("gc", dict, {})
    g = _Reader(path, gc_table, "gc.")
    gc = GcSettings(
        enabled=g.get("enabled", bool, True),
        interval=g.convert("interval", 3600.0, _positive_duration),
        grace=g.convert("grace", 3600.0, _duration),
        lease_ttl=g.convert("lease_ttl", DEFAULT_TTL, _positive_duration),
        trash_retention=g.convert("trash_retention", 86400.0, _duration),
        history_retention=g.convert("history_retention", 7 * 86400.0, _duration),
        grace_below_floor=g.get("grace_below_floor", bool, False),
    )
    problem = grace_problem(gc.grace, gc.grace_below_floor, "grace_below_floor = true")
    if problem is not None:
        raise g.fail("grace", problem)
    g.check_unknown()
    r.check_unknown()
    return SyncConfig(
        path=path,
        store=store,
        host_id=host,
        listen=listen,
        token_file=token_file,
        authorized_keys=authorized_keys,
        tls_cert=tls_cert,
        tls_key=tls_key,
        public_urls=public_urls,
        peers=peers,
        pins=pins,
        registries=registries,
        replicate=replicate,
        prefer=prefer,
        interval=interval,
        max_transfers=max_transfers,
        mirror=mirror,
        mirror_ttl=mirror_ttl,
        docker_config=docker_config,
        gc=gc,
    )


def _peers(r: _Reader) -> tuple[tuple[str, ...], dict[str, str]]:
    """`peers`: each a URL, or a table `{ url = "https://…", pin = "sha256:…" }` whose
    certificate must be the pinned one (sync.pins)."""
    value = r.get("peers", list, [])
    urls: list[str] = []
    pins: dict[str, str] = {}
    for i, item in enumerate(value):
        where = f"peers[{i}]"
        if isinstance(item, dict):
            entry = _Reader(r.path, item, f"{where}.")
            url = entry.get("url", str, "")
            pin = entry.get("pin", str, "")
            entry.check_unknown()
            if not url:
                raise entry.fail("url", "missing (a peer table needs url and pin)")
            try:
                url = _url(url)
            except ValueError as exc:
                raise entry.fail("url", str(exc)) from None
            if not pin:
                raise entry.fail("pin", "missing (without a pin, write the URL alone)")
            try:
                pins[url] = parse_pin(pin)
            except ValueError as exc:
                raise entry.fail("pin", str(exc)) from None
            if not url.startswith("https://"):
                raise entry.fail("pin", f"a pinned peer is reached by https://, not {url}")
        elif isinstance(item, str) and item.strip():
            try:
                url = _url(item.strip())
            except ValueError as exc:
                raise r.fail(where, str(exc)) from None
        else:
            raise r.fail(where, "expected a URL or a table { url = …, pin = … }")
        urls.append(url)
    return tuple(urls), pins


def _checked(r: _Reader, key: str, parse: Callable[[str], str]) -> list[str]:
    out = []
    for i, item in enumerate(r.strings(key, ())):
        try:
            out.append(parse(item))
        except (ValueError, InvalidNameError) as exc:
            raise r.fail(f"{key}[{i}]", str(exc)) from None
    return out


def _host_id(text: str) -> str:
    text = text.strip()
    if not text or len(text) > 253 or any(c.isspace() or c in "/\\" for c in text):
        raise ValueError(f"expected a host name without spaces or slashes, got {text!r}")
    return text


def _listen(text: str) -> str:
    parse_listen(text)
    return text
