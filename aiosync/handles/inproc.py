"""An :class:`EngineHandle` on an engine object in this process (sync or async methods).

Async methods are awaited on the caller's loop; sync ones run in a worker thread, so an
engine call that blocks (a collective receive) never stalls the loop. Whatever the engine
returns is read by :func:`aiosync.handles.results.as_result`; an exception it raises
becomes a failed result carrying its text, since the engine did answer.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import anyio.to_thread

from aiosync.core.errors import UsageError
from aiosync.handles.base import HealthStatus, WeightSyncResult
from aiosync.handles.calling import CallingHandle, health_of
from aiosync.handles.results import as_result

log = logging.getLogger(__name__)


class ObjectHandle(CallingHandle):
    """Drives an engine object living in this process through its weight-update methods."""

    def __init__(self, engine: object, *, name: str | None = None) -> None:
        self._engine = engine
        self._name = name or f"{type(engine).__name__}@{id(engine):x}"

    @property
    def name(self) -> str:
        """The given name, or the engine's class and id."""
        return self._name

    @property
    def engine(self) -> object:
        """The wrapped engine object."""
        return self._engine

    async def _invoke(self, method: str, kwargs: dict[str, object]) -> object:
        func = getattr(self._engine, method, None)
        if func is None:
            raise UsageError(f"the engine has no method {method}()", peer=self._name)
        if inspect.iscoroutinefunction(func):
            reply: Any = await func(**kwargs)
        else:
            call = functools.partial(func, **kwargs)
            reply = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        if inspect.isawaitable(reply):
            reply = await reply
        return reply

    async def call(self, method: str, kwargs: dict[str, object]) -> WeightSyncResult:
        """Call the engine's method; what it raises becomes a failed result with its text."""
        try:
            return as_result(await self._invoke(method, kwargs))
        except UsageError:
            raise
        except Exception as exc:
            log.warning("%s: %s() raised %r", self._name, method, exc)
            return WeightSyncResult(success=False, message=f"{type(exc).__name__}: {exc}")

    async def check_health(self) -> HealthStatus:
        """The engine's ``check_health()`` answer; healthy when it has no such method."""
        if getattr(self._engine, "check_health", None) is None:
            return HealthStatus(healthy=True, message="in process (no check_health method)")
        try:
            return health_of(await self._invoke("check_health", {}))
        except Exception as exc:
            return HealthStatus(healthy=False, message=f"{type(exc).__name__}: {exc}")
