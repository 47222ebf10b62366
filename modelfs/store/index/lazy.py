"""Manifests from the scan index, made whole when first used.

A warm scan of 5,000 models takes some 9,000 manifests from the index and, with the entry
records it keeps (scancache), looks inside none of them: their layers, configs and digests
are for whoever asks next (`ls` does, a mount's build does, `modelfs rm` asks of one). So a
manifest loaded from the index is a `LazyManifest` (or `LazyManifestList`): the same frozen
class to every caller (`isinstance`, equality, hashing, pickling all answer as the plain one),
holding only the index's tuple for it until a field is read. The first read builds every
field, digests and layers made once each from the index's tables, and turns the object into a
plain Manifest (`__class__` assignment: the subclass adds no slot, so the layout is the same),
after which reads cost what they always did.

Made whole twice at once (two threads), both build the same values and the last write wins:
every field but `raw` is written first, and `raw` (which holds the tuple until then) last.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.manifest import Layer, ListChild, Manifest, ManifestList


def digest_of_hex(hex_: str) -> Digest:
    if not isinstance(hex_, str) or len(hex_) != 64:
        raise ValueError("not a digest")
    # Not Digest(hex_): its pattern check is a tenth of a load, and the file is ours and
    # checksummed (a file that is not is never decoded).
    d = object.__new__(Digest)
    object.__setattr__(d, "hex", hex_)
    return d


class Tables:
    """The index file's tables of digests (their hex, one a line) and layers (marshal data),
    unpacked when a manifest is first built, and each object made once, when asked."""

    __slots__ = ("_digests", "_hex_text", "_hexes", "_layer_data", "_layers", "_rows")

    def __init__(self, hex_text: str, layer_data: bytes) -> None:
        if not isinstance(hex_text, str) or not isinstance(layer_data, bytes):
            raise TypeError("tables")
        self._hex_text = hex_text
        self._layer_data = layer_data
        self._hexes: list[str] | None = None
        self._rows: tuple[tuple[Any, ...], ...] | None = None
        self._digests: dict[int, Digest] = {}
        self._layers: dict[int, Layer] = {}

    def digest(self, i: int) -> Digest:
        d = self._digests.get(i)
        if d is None:
            hexes = self._hexes
            if hexes is None:
                hexes = self._hexes = self._hex_text.split("\n")
            d = self._digests[i] = digest_of_hex(hexes[i])
        return d

    def hex(self, i: int) -> str:
        hexes = self._hexes
        if hexes is None:
            hexes = self._hexes = self._hex_text.split("\n")
        h = hexes[i]
        if type(h) is not str or len(h) != 64:
            raise ValueError("not a digest")
        return h

    def layer(self, i: int) -> Layer:
        layer = self._layers.get(i)
        if layer is None:
            rows = self._rows
            if rows is None:
                rows = self._rows = marshal.loads(self._layer_data)
            media, d, size, name, from_ = rows[i]
            layer = self._layers[i] = Layer(media, self.digest(d), size, name, from_)
        return layer

    def manifest(self, kind: int, data: bytes | tuple[Any, ...]) -> Manifest | ManifestList:
        """The manifest the index's data stands for (its tuple, or that tuple in marshal
        data: a load then makes one object of it), to be built when first used."""
        lazy: Manifest | ManifestList
        if kind == 1:
            lazy = object.__new__(LazyManifestList)
            _LIST_RAW.__set__(lazy, (self, data))
        elif kind == 0:
            lazy = object.__new__(LazyManifest)
            _RAW.__set__(lazy, (self, data))
        else:
            raise TypeError("not a manifest")
        return lazy


def _unpacked(data: bytes | tuple[Any, ...]) -> tuple[Any, ...]:
    t = marshal.loads(data) if type(data) is bytes else data
    if type(t) is not tuple:
        raise TypeError("not a manifest")
    return t


_FIELDS = ("digest", "media_type", "config", "layers", "runner", "format")
_SLOTS = [Manifest.__dict__[f] for f in _FIELDS]
_RAW = Manifest.__dict__["raw"]
_LIST_FIELDS = ("digest", "children", "media_type")
_LIST_SLOTS = [ManifestList.__dict__[f] for f in _LIST_FIELDS]
_LIST_RAW = ManifestList.__dict__["raw"]


def _fill_manifest(m: Manifest) -> None:
    held = _RAW.__get__(m)
    if type(held) is tuple:
        tables, data = held
        _, raw, d, media, config, layers, runner, fmt = _unpacked(data)
        values = (
            tables.digest(d),
            media,
            None if config < 0 else tables.layer(config),
            tuple(map(tables.layer, layers)),
            runner,
            fmt,
        )
        for slot, value in zip(_SLOTS, values, strict=True):
            slot.__set__(m, value)
        _RAW.__set__(m, raw)
    object.__setattr__(m, "__class__", Manifest)


def _fill_list(m: ManifestList) -> None:
    held = _LIST_RAW.__get__(m)
    if type(held) is tuple:
        tables, data = held
        _, raw, d, media, children = _unpacked(data)
        kids = []
        for c, runner, fmt, inline in children:
            child = None
            if inline is not None:
                if inline[0] != 0:
                    raise TypeError("a list inside a list")
                child = tables.manifest(0, inline)
                assert isinstance(child, Manifest)
            kids.append(ListChild(tables.digest(c), runner, fmt, child))
        for slot, value in zip(_LIST_SLOTS, (tables.digest(d), tuple(kids), media), strict=True):
            slot.__set__(m, value)
        _LIST_RAW.__set__(m, raw)
    object.__setattr__(m, "__class__", ManifestList)


def _fill_any(obj: object) -> None:
    if type(obj) is LazyManifest:
        _fill_manifest(obj)
    elif type(obj) is LazyManifestList:
        _fill_list(obj)


def _lazy_class(base: type[Any], fill: Callable[[Any], None]) -> type[Any]:
    """`base` with every field a property that builds the whole object first (see the
    module's text), and equality, hashing, repr and pickling as the plain object's."""

    def eq(self: Any, other: object) -> bool:
        fill(self)
        _fill_any(other)
        return bool(self == other)

    def hash_(self: Any) -> int:
        fill(self)
        return hash(self)

    def repr_(self: Any) -> str:
        fill(self)
        return repr(self)

    def reduce_ex(self: Any, protocol: Any) -> Any:
        fill(self)
        return self.__reduce_ex__(protocol)

    def field(slot: Any) -> property:
        def get(self: Any) -> Any:
            fill(self)
            return slot.__get__(self)

        return property(get)

    namespace: dict[str, Any] = {
        "__slots__": (),  # none added: the plain class's layout, for __class__ assignment
        "__doc__": f"A {base.__name__} from the scan index, built when first used.",
        "__eq__": eq,
        "__hash__": hash_,
        "__repr__": repr_,
        "__reduce_ex__": reduce_ex,
    }
    for name in base.__dataclass_fields__:
        namespace[name] = field(base.__dict__[name])
    return type(f"Lazy{base.__name__}", (base,), namespace)


LazyManifest: type[Manifest] = _lazy_class(Manifest, _fill_manifest)
LazyManifestList: type[ManifestList] = _lazy_class(ManifestList, _fill_list)


def manifest_hex(m: Manifest | ManifestList) -> str:
    """The hex of a manifest's digest, without making the manifest whole when it came from the
    index (a mount's build names 9,000 of them by digest before it looks inside any)."""
    if type(m) is LazyManifest:
        held = _RAW.__get__(m)
    elif type(m) is LazyManifestList:
        held = _LIST_RAW.__get__(m)
    else:
        return m.digest.hex
    if type(held) is tuple:  # else made whole meanwhile, by another thread
        tables, data = held
        return str(tables.hex(_unpacked(data)[2]))
    return m.digest.hex


class HexOf:
    """`manifest_hex`, worked out once per manifest (by identity: held meanwhile, so that no
    other object takes its id)."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[int, tuple[object, str]] = {}

    def __call__(self, m: Manifest | ManifestList) -> str:
        got = self._memo.get(id(m))
        if got is None:
            got = self._memo[id(m)] = (m, manifest_hex(m))
        return got[1]
