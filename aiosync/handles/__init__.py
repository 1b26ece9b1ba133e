"""Async handles on rollout engines: one interface, adapters for where the engine lives."""

from aiosync.handles.base import EngineHandle, HealthStatus, WeightSyncResult

__all__ = ["EngineHandle", "HealthStatus", "WeightSyncResult"]
