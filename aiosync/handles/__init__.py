"""Async handles on rollout engines: one interface, adapters for where the engine lives.

- :class:`EngineHandle`: the interface (SGLang's weight-update methods, plain-data answers).
- :class:`ObjectHandle` (an engine object in this process), :class:`RayActorHandle` (a Ray
  actor; the ``ray`` extra), :class:`ChannelHandle` (an engine process behind aiosync's
  control channel, served by :func:`serve_engine`); :func:`as_engine_handle` picks one.
- :class:`AiosyncEngine`: the engine side built on aiosync (sinks, side group; its versions
  an :class:`~aiosync.core.engine_session.EngineSession` fed by SGLang's calls).
- :mod:`aiosync.handles.fleet`: the trainer side of connect / broadcast / disconnect (a
  version streams through :class:`~aiosync.pipeline.stream.StreamRun`).
"""

from aiosync.handles.base import EngineHandle, HealthStatus, WeightSyncResult
from aiosync.handles.channel import ChannelHandle, serve_engine
from aiosync.handles.inproc import ObjectHandle
from aiosync.handles.ray_actor import RayActorHandle
from aiosync.handles.resolve import NotAnEngineError, as_engine_handle, as_engine_handles

__all__ = [
    "ChannelHandle",
    "EngineHandle",
    "HealthStatus",
    "NotAnEngineError",
    "ObjectHandle",
    "RayActorHandle",
    "WeightSyncResult",
    "as_engine_handle",
    "as_engine_handles",
    "serve_engine",
]
