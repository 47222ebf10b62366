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

The index's data is checked as it is built (store.index.shape): the digest table whole, when
first used; a layer's row and a manifest's tuple, when each is. Data of a shape we never write
is no error to the caller: the manifest is read afresh from where the index says it came from
(a tag file's path, a blob's name), by the `recover` the index gives its tables (scancache),
which also drops the index. The checks are plain type tests inline: `ls` builds 9,000
manifests, and a call more for each was a percent of it.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable
from typing import Any

from modelfs.store.digest import Digest
from modelfs.store.index.shape import (
    TEXT_OR_NONE,
    check,
    tuples_of,
)
from modelfs.store.manifest import Layer, ListChild, Manifest, ManifestList

Parsed = Manifest | ManifestList
# (where the manifest came from, why its data cannot be built, the class it must be): the
# manifest read afresh (scancache._Recovery).
Recover = Callable[[str, str, type[Parsed]], Parsed]
_HEX_LINES = b"0123456789abcdef\n"


def digest_of_hex(hex_: str) -> Digest:
    if not isinstance(hex_, str) or len(hex_) != 64:
        raise ValueError("not a digest")
    return _digest(hex_)


def _digest(hex_: str) -> Digest:
    # Not Digest(hex_): its pattern check is a tenth of a load, and the file is ours and
    # checksummed (a file that is not is never decoded); the table is checked whole instead.
    d = object.__new__(Digest)
    object.__setattr__(d, "hex", hex_)
    return d


class Tables:
    """The index file's tables of digests (their hex, one a line) and layers (marshal data),
    unpacked and checked when a manifest is first built, and each object made once, when
    asked (ValueError, TypeError, IndexError for data not of their shape). `recover`: see the
    module's text."""

    __slots__ = ("_digests", "_hex_text", "_hexes", "_layer_data", "_layers", "_rows", "recover")

    def __init__(self, hex_text: str, layer_data: bytes, recover: Recover) -> None:
        if not isinstance(hex_text, str) or not isinstance(layer_data, bytes):
            raise TypeError("tables")
        self._hex_text = hex_text
        self._layer_data = layer_data
        self.recover = recover
        self._hexes: list[str] | None = None
        self._rows: tuple[tuple[Any, ...], ...] | None = None
        self._digests: dict[int, Digest] = {}
        self._layers: dict[int, Layer] = {}

    def digest(self, i: int) -> Digest:
        d = self._digests.get(i)
        if d is None:
            d = self._digests[i] = _digest(self.hex(i))
        return d

    def hex(self, i: int) -> str:
        """The hex of digest number `i`, no Digest made (IndexError for a number the table does
        not hold, or any when the table is not of its shape)."""
        if type(i) is not int or i < 0:
            raise IndexError("a digest's number")
        hexes = self._hexes
        if hexes is None:
            hexes = self._hexes = _checked_hexes(self._hex_text)
        return hexes[i]

    def layer(self, i: int) -> Layer:
        layer = self._layers.get(i)
        if layer is None:
            if type(i) is not int or i < 0:
                raise IndexError("a layer's number")
            rows = self._rows
            if rows is None:
                rows = self._rows = _unpacked_rows(self._layer_data)
            media, d, size, name, from_ = rows[i]
            if not (
                type(media) is str
                and type(size) is int
                and size >= 0
                and (name is None or type(name) is str)
                and (from_ is None or type(from_) is str)
            ):
                raise TypeError("a layer's fields")
            layer = self._layers[i] = Layer(media, self.digest(d), size, name, from_)
        return layer

    def manifest(
        self, kind: int, data: bytes | tuple[Any, ...], source: str
    ) -> Manifest | ManifestList:
        """The manifest the index's data stands for (its tuple, or that tuple in marshal
        data: a load then makes one object of it), to be built when first used; `source`:
        its key in the index (a tag file's path, a blob's name), where it is read again
        should the data not be of its shape."""
        lazy: Manifest | ManifestList
        if kind == 1:
            lazy = object.__new__(LazyManifestList)
            _LIST_RAW.__set__(lazy, (self, data, source))
        elif kind == 0:
            lazy = object.__new__(LazyManifest)
            _RAW.__set__(lazy, (self, data, source))
        else:
            raise TypeError("not a manifest")
        return lazy


def _checked_hexes(text: str) -> list[str]:
    """The digest table's lines, each 64 lowercase hex digits (Digest's own check, for the
    whole table at once: per digest, it was a tenth of a load); none when one is not, so that
    every manifest is read afresh, each without checking the table again."""
    hexes = text.split("\n")
    try:
        ok = set(map(len, hexes)) == {64} and not text.encode("ascii").translate(None, _HEX_LINES)
    except UnicodeEncodeError:
        ok = False
    return hexes if ok else []


def _unpacked_rows(data: bytes) -> tuple[Any, ...]:
    """The layer table's rows, each (media type, digest's number, size, name or None, origin
    or None), checked one by one when first used (`ls` uses under half of them); none when
    the table is not a tuple (as for _checked_hexes)."""
    try:
        rows = marshal.loads(data)
    except Exception:  # whatever marshal makes of it
        return ()
    return rows if type(rows) is tuple else ()


def _unpacked(data: bytes | tuple[Any, ...], kind: int, length: int) -> tuple[Any, ...]:
    """A manifest's tuple, of its kind (the first item) and `length`."""
    t: Any = marshal.loads(data) if type(data) is bytes else data
    if type(t) is not tuple or len(t) != length or t[0] != kind:
        raise ValueError("not a manifest's tuple")
    return t


def _plain(tables: Tables, data: bytes | tuple[Any, ...]) -> tuple[bytes, tuple[Any, ...]]:
    """A plain manifest's raw bytes and its other fields (_FIELDS) from its tuple."""
    t: Any = marshal.loads(data) if type(data) is bytes else data  # _unpacked, inline
    if type(t) is not tuple or len(t) != 8 or t[0] != 0:
        raise ValueError("not a manifest's tuple")
    _, raw, d, media, config, layers, runner, fmt = t
    if not (
        type(raw) is bytes
        and type(media) is str
        and type(config) is int
        and config >= -1
        and type(layers) is tuple
        and (runner is None or type(runner) is str)
        and (fmt is None or type(fmt) is str)
    ):
        raise TypeError("a manifest's fields")
    values = (
        tables.digest(d),
        media,
        None if config < 0 else tables.layer(config),
        tuple(map(tables.layer, layers)),
        runner,
        fmt,
    )
    return raw, values


def _listed(tables: Tables, data: bytes | tuple[Any, ...]) -> tuple[bytes, tuple[Any, ...]]:
    """A manifest list's raw bytes and its other fields (_LIST_FIELDS) from its tuple; an
    inline child is built with it, so that its data is checked with the list's."""
    _, raw, d, media, children = _unpacked(data, 1, 5)
    check(type(raw) is bytes and type(media) is str, "a list's fields")
    kids = []
    for c, runner, fmt, inline in tuples_of(children, 4):
        check(type(runner) in TEXT_OR_NONE and type(fmt) in TEXT_OR_NONE, "a child's fields")
        child = None
        if inline is not None:
            child = object.__new__(Manifest)
            _set(child, _SLOTS, _RAW, *_plain(tables, inline))
        kids.append(ListChild(tables.digest(c), runner, fmt, child))
    return raw, (tables.digest(d), tuple(kids), media)


_FIELDS = ("digest", "media_type", "config", "layers", "runner", "format")
_SLOTS = [Manifest.__dict__[f] for f in _FIELDS]
_DIGEST, _MEDIA, _CONFIG, _LAYERS, _RUNNER, _FORMAT = _SLOTS
_RAW = Manifest.__dict__["raw"]
_LIST_FIELDS = ("digest", "children", "media_type")
_LIST_SLOTS = [ManifestList.__dict__[f] for f in _LIST_FIELDS]
_LIST_RAW = ManifestList.__dict__["raw"]


def _set(m: object, slots: list[Any], raw_slot: Any, raw: bytes, values: tuple[Any, ...]) -> None:
    for slot, value in zip(slots, values, strict=True):
        slot.__set__(m, value)
    raw_slot.__set__(m, raw)  # last: see the module's text


def _recovered(
    held: tuple[Tables, Any, str], exc: Exception, cls: type[Parsed], fields: tuple[str, ...]
) -> tuple[bytes, tuple[Any, ...]]:
    """For data of a shape we never write: the fields of the manifest read where it came
    from (see the module's text)."""
    tables, _, source = held
    got = tables.recover(source, f"a manifest ({type(exc).__name__})", cls)
    return got.raw, tuple(getattr(got, f) for f in fields)


def _fill_manifest(m: Manifest) -> None:
    held = _RAW.__get__(m)
    if type(held) is tuple:
        try:
            raw, values = _plain(held[0], held[1])
        except Exception as exc:
            raw, values = _recovered(held, exc, Manifest, _FIELDS)
        digest, media, config, layers, runner, fmt = values  # _set, inline: 9,000 a listing
        _DIGEST.__set__(m, digest)
        _MEDIA.__set__(m, media)
        _CONFIG.__set__(m, config)
        _LAYERS.__set__(m, layers)
        _RUNNER.__set__(m, runner)
        _FORMAT.__set__(m, fmt)
        _RAW.__set__(m, raw)
    object.__setattr__(m, "__class__", Manifest)


def _fill_list(m: ManifestList) -> None:
    held = _LIST_RAW.__get__(m)
    if type(held) is tuple:
        try:
            raw, values = _listed(held[0], held[1])
        except Exception as exc:
            raw, values = _recovered(held, exc, ManifestList, _LIST_FIELDS)
        _set(m, _LIST_SLOTS, _LIST_RAW, raw, values)
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
        tables, data, _ = held
        try:
            t: Any = marshal.loads(data) if type(data) is bytes else data
            return str(tables.hex(t[2]))
        except Exception:  # not of its shape: made whole, it is read afresh (see above)
            pass
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
