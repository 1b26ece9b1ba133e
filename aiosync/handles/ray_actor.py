"""An :class:`EngineHandle` on a Ray actor (the optional ``ray`` extra).

Each call is ``actor.<method>.remote(**kwargs)`` with plain data only (lists, str, int,
bool, bytes): Ray serializes the call itself, and aiosync hands it nothing it would have to
pickle on aiosync's behalf. The ObjectRef is awaited on the event loop (never ``ray.get``),
so the loop keeps running; a cancelled await asks Ray to cancel the task. A task that
raised is a failed result with the engine's text; an actor or node that died is a
:class:`~aiosync.core.errors.PeerGoneError` naming the engine, and a call not answered
within the handle's ``timeout`` a :class:`~aiosync.core.errors.SyncTimeoutError` naming it
(the task is cancelled).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import anyio

from aiosync.core.errors import PeerGoneError, SyncTimeoutError, UsageError
from aiosync.handles.base import CALL_TIMEOUT, HealthStatus, WeightSyncResult
from aiosync.handles.calling import CallingHandle, health_of
from aiosync.handles.results import MAX_TEXT, as_result

log = logging.getLogger(__name__)


def is_ray_actor(obj: object) -> bool:
    """True when ``obj`` is a Ray actor handle (never imports Ray itself)."""
    if "ray" not in sys.modules:
        return False
    from ray.actor import ActorHandle

    return isinstance(obj, ActorHandle)


def _task_text(exc: BaseException) -> str:
    """The engine's own exception text out of a Ray task error."""
    cause = getattr(exc, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    return text[:MAX_TEXT]


class RayActorHandle(CallingHandle):
    """Drives an engine that is a Ray actor (an SGLang engine actor, or any with the methods).

    Each call waits at most ``timeout`` seconds for the actor's answer.
    """

    def __init__(
        self, actor: Any, *, name: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> None:
        if not timeout > 0:
            raise UsageError(f"a handle's timeout must be positive, got {timeout!r}")
        self._actor = actor
        self._timeout = float(timeout)
        if name is None:
            actor_id = getattr(actor, "_actor_id", None)
            hexid = actor_id.hex()[:12] if actor_id is not None else f"{id(actor):x}"
            name = f"ray-actor-{hexid}"
        self._name = name

    @property
    def name(self) -> str:
        """The given name, or ``ray-actor-<id>``."""
        return self._name

    @property
    def actor(self) -> Any:
        """The wrapped Ray actor handle."""
        return self._actor

    async def _invoke(self, method: str, kwargs: dict[str, object]) -> object:
        try:
            remote = getattr(self._actor, method)
        except AttributeError:
            raise UsageError(f"the actor has no method {method}()", peer=self._name) from None
        ref = remote.remote(**kwargs)
        with anyio.move_on_after(self._timeout):
            return await self._await(ref, method)
        raise SyncTimeoutError(
            f"no answer to {method}() within {self._timeout:g}s", peer=self._name
        )

    async def _await(self, ref: Any, method: str) -> object:
        import ray
        import ray.exceptions

        try:
            return await ref
        except anyio.get_cancelled_exc_class():
            try:
                if ray.is_initialized():  # ray.cancel would start a local instance otherwise
                    ray.cancel(ref)
            except Exception as exc:  # best effort: the actor may be gone
                log.debug("%s: cancelling %s() failed: %r", self._name, method, exc)
            raise
        except ray.exceptions.RayTaskError:
            raise
        except ray.exceptions.RayError as exc:
            raise PeerGoneError(
                f"Ray actor unreachable during {method}(): {type(exc).__name__}: "
                f"{str(exc)[:MAX_TEXT]}",
                peer=self._name,
            ) from exc

    async def call(self, method: str, kwargs: dict[str, object]) -> WeightSyncResult:
        """One Ray call; a task that raised is a failed result with the engine's text."""
        import ray.exceptions

        try:
            return as_result(await self._invoke(method, kwargs))
        except ray.exceptions.RayTaskError as exc:
            return WeightSyncResult(success=False, message=_task_text(exc))

    async def check_health(self) -> HealthStatus:
        """The actor's ``check_health()`` answer; unhealthy when it is gone or raised."""
        import ray.exceptions

        try:
            return health_of(await self._invoke("check_health", {}))
        except ray.exceptions.RayTaskError as exc:
            return HealthStatus(healthy=False, message=_task_text(exc))
        except (PeerGoneError, SyncTimeoutError) as exc:
            return HealthStatus(healthy=False, message=exc.reason)
