"""Turning what a caller holds for each rollout engine into an :class:`EngineHandle`."""

from __future__ import annotations

from collections.abc import Iterable

from aiosync.core.errors import AiosyncError
from aiosync.handles.base import EngineHandle
from aiosync.handles.inproc import ObjectHandle
from aiosync.handles.ray_actor import RayActorHandle, is_ray_actor

UPDATE_METHODS = (
    "init_weights_update_group",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
)
"""An engine object driven in process has at least one of these (a colocated engine may
have only ``update_weights_from_tensor``; calling a method it lacks is a UsageError)."""


class NotAnEngineError(AiosyncError, TypeError):
    """Something given as a rollout engine is none of the kinds aiosync can drive."""


def as_engine_handle(engine: object, *, name: str | None = None) -> EngineHandle:
    """A handle on ``engine``, whatever kind of engine it is.

    An :class:`EngineHandle` is returned as is, a Ray actor handle is wrapped in a
    :class:`RayActorHandle`, an object with a weight-update method in an
    :class:`ObjectHandle`; anything else is a :class:`NotAnEngineError` (a ``TypeError``).
    """
    if isinstance(engine, EngineHandle):
        return engine
    if is_ray_actor(engine):
        return RayActorHandle(engine, name=name)
    if any(callable(getattr(engine, method, None)) for method in UPDATE_METHODS):
        return ObjectHandle(engine, name=name)
    raise NotAnEngineError(
        f"{type(engine).__name__} is not a rollout engine: expected an aiosync EngineHandle, "
        f"a Ray actor handle, or an object with a weight-update method "
        f"({', '.join(UPDATE_METHODS)})",
        peer=name,
    )


def as_engine_handles(engines: Iterable[object]) -> list[EngineHandle]:
    """Handles for NeMo-RL's ``rollout_engines`` list; unnamed ones become ``engine <i>``."""
    out: list[EngineHandle] = []
    for i, engine in enumerate(engines):
        named = isinstance(engine, EngineHandle)
        out.append(as_engine_handle(engine, name=None if named else f"engine {i}"))
    return out
