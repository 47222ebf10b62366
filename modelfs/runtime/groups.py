"""Exception groups, as trio's nurseries raise them: the lone failure inside, as itself.

    sole(group) -> the one exception inside nested single-member groups (else the group)
    with unwrapped(ServeError): ...   a lone failure of that class re-raised as itself

A failure in a task passes through every nursery above it and arrives wrapped once per
nursery; callers that show one line for one failure (the CLI, `modelfs serve`) want it bare.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside nested single-member groups; the group itself otherwise."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@contextmanager
def unwrapped(kind: type[BaseException] = BaseException) -> Iterator[None]:
    """Raise a group's lone failure as itself when it is a `kind`; any other group as is."""
    try:
        yield
    except BaseExceptionGroup as group:
        exc = sole(group)
        if exc is group or not isinstance(exc, kind):
            raise
        raise exc from None
