"""Checks that an index file's data is of the shape its writer gives it (store.index.scancache,
reachcache, lazy), and the error for data that is not.

A file whose checksum is right can still hold what we never write: a hand's edit, a bug of
another version that kept the format number. Used as it is, such data raises deep in whatever
reads it (`ls`, the mount's build, GC), or answers wrongly, and at every command after, since
the stamps it is kept by still match. So what is read at a load is checked at the load, where
a failure is one log line and a full scan as for a corrupt file; what is built only when used
(a manifest, a recipe, a fact) is checked there, and the index is then dropped (scancache);
what cannot be made good where it is met raises store.errors.DamagedIndexError.

The checks go over whole columns at once (the type of every value, in C), not value by value:
a load holds some 20,000 names and 3,000 directories, and a check that cost a tenth of the
load would defeat the index.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

NoneType = type(None)
TEXT: frozenset[type] = frozenset({str})
TEXT_OR_NONE: frozenset[type] = frozenset({str, NoneType})
INT: frozenset[type] = frozenset({int})
INT_OR_NONE: frozenset[type] = frozenset({int, NoneType})


def types_in(values: Iterable[Any], allowed: frozenset[type]) -> bool:
    """Whether every value is of one of the `allowed` types (exactly: no bool for an int)."""
    return set(map(type, values)) <= allowed


def tuples_of(values: Iterable[Any], length: int) -> tuple[tuple[Any, ...], ...]:
    """`values` as a tuple of tuples of `length`; ValueError when they are not."""
    rows = tuple(values)
    if not types_in(rows, frozenset({tuple})) or not set(map(len, rows)) <= {length}:
        raise ValueError(f"not all tuples of {length}")
    return rows


def columns(rows: tuple[tuple[Any, ...], ...], length: int) -> tuple[tuple[Any, ...], ...]:
    """The columns of `rows` (tuples of `length`, per tuples_of), empty ones when none."""
    return tuple(zip(*rows, strict=True)) if rows else ((),) * length


def texts(values: Iterable[Any]) -> None:
    """TypeError unless every value is a str (a join is the cheapest look at each)."""
    "".join(values)


def nested_texts(groups: Iterable[Iterable[Any]]) -> None:
    """TypeError unless every value of every group is a str."""
    "".join(chain.from_iterable(groups))


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)
