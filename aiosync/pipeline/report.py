"""What a sync reports: progress while it runs and a per-engine account when it ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiosync.core.trainer_session import EngineOutcome


@dataclass(frozen=True)
class SyncProgress:
    """Progress of one version's stream, reported after every bucket all engines acked."""

    version: int
    buckets: int
    tensors: int
    bytes: int


ProgressCallback = Callable[[SyncProgress], None]
"""A plain function called on the event loop; it must return quickly."""


@dataclass(frozen=True)
class SyncReport:
    """What one sync moved, how long it took end to end, and how each engine ended.

    Direct mode: ``direct_bytes`` of ``bytes`` were read by the engines in the trainer's
    memory (the rest was packed, :attr:`packed_bytes`); ``direct_note`` says why tensors
    asked to go direct were packed instead (empty if none were).
    """

    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    engines: tuple[EngineOutcome, ...] = ()
    direct_bytes: int = 0
    direct_note: str = ""

    @property
    def packed_bytes(self) -> int:
        """Tensor bytes that went through the buffers (all of them outside direct mode)."""
        return self.bytes - self.direct_bytes

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def committed(self) -> list[str]:
        """Engines now at this version."""
        return [e.engine for e in self.engines if e.status == "committed"]

    @property
    def failed(self) -> list[EngineOutcome]:
        """Engines that did not commit this version, with why."""
        return [e for e in self.engines if e.status != "committed"]
