"""One error out of a task group: what a context manager hosting background tasks raises.

A task group wraps whatever ends it in an :class:`ExceptionGroup`, even a single error raised
in the body of the ``async with`` that entered it. A user's ``except PeerGoneError`` (or
``except KeyError``) around the block then never matches. The rule kept here, for every public
context manager of aiosync:

- an exception raised in the body leaves the block as itself;
- failures of the library's own tasks leave as the single error that says what happened: the
  one error, or, when several engines (peers) failed at once, one :class:`FleetError` naming
  each;
- cancellation leaves as cancellation.

Errors dropped by that rule are not lost: each is added as a note on the one raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator

from aiosync.core.errors import AiosyncError, FleetError


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every exception inside a (nested) group, depth first; ``exc`` itself if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


def collapse(group: BaseException, body: BaseException | None = None) -> BaseException:
    """The one exception that explains ``group``, given the body's own exception ``body``.

    Order of choice: the body's exception when it is in the group; else the library's own
    errors (one, or a :class:`FleetError` when they name several peers); else any other error
    (a bug, or a consequence of one); else the cancellation itself.
    """
    found = list(leaves(group))
    real = [e for e in found if not isinstance(e, asyncio.CancelledError)]
    if body is not None and any(e is body for e in found):
        chosen: BaseException = body
    elif ours := [e for e in real if isinstance(e, AiosyncError)]:
        chosen = _one_error(ours)
    elif real:
        chosen = real[0]
    elif body is not None:
        chosen = body
    else:
        chosen = found[0] if found else group
    for other in real:
        if other is not chosen and not _inside(other, chosen):
            chosen.add_note(f"also raised meanwhile: {other!r}")
    return chosen


def _one_error(errors: list[AiosyncError]) -> AiosyncError:
    """The first error, or one FleetError when the errors concern more than one peer."""
    peers = {e.peer for e in errors}
    if len(peers) < 2:
        return errors[0]
    failures: dict[str, AiosyncError] = {}
    for exc in errors:
        key = exc.peer or "this process"
        while key in failures:
            key += "'"
        failures[key] = exc
    versions = {e.version for e in errors if e.version is not None}
    version = versions.pop() if len(versions) == 1 else None
    fleet = FleetError(f"{len(failures)} engines failed", failures, version=version)
    fleet.__cause__ = errors[0]
    return fleet


def _inside(exc: BaseException, fleet: BaseException) -> bool:
    return isinstance(fleet, FleetError) and any(e is exc for e in fleet.failures.values())


async def exit_as_one(exit: Awaitable[bool | None], body: BaseException | None) -> bool | None:
    """Await a task group's (or exit stack's) ``__aexit__``; a group it raises becomes one error.

    ``body`` is the exception the ``async with`` body raised (None when it ended normally), as
    handed to ``__aexit__``.
    """
    try:
        return await exit
    except BaseExceptionGroup as group:
        error = collapse(group, body)
    raise error
