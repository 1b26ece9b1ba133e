"""Event-loop helpers: run a coroutine on uvloop when installed, and unwrap task-group errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def uvloop_available() -> bool:
    """True when uvloop can be imported on this platform."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Callable[[], Coroutine[Any, Any, T]], *, use_uvloop: bool | None = None) -> T:
    """Run ``main()`` to completion on a fresh loop; uvloop when available unless told not to."""
    if use_uvloop is None:
        use_uvloop = uvloop_available()
    if use_uvloop:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        return runner.run(main())


def unwrap_group(exc: BaseException) -> BaseException:
    """The one meaningful error inside (nested) exception groups, or the group itself."""
    while isinstance(exc, BaseExceptionGroup):
        real = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        if len(real) != 1:
            return exc
        exc = real[0]
    return exc
