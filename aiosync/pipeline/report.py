"""What a sync reports: progress while it runs and a per-engine account when it ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiosync.core.errors import AiosyncError, InDoubtError
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
        """Engines that committed this version now."""
        return [e.engine for e in self.engines if e.status == "committed"]

    @property
    def current(self) -> list[str]:
        """Engines that held this version already (a retry): nothing was sent to them."""
        return [e.engine for e in self.engines if e.status == "current"]

    @property
    def failed(self) -> list[EngineOutcome]:
        """Engines that are not known to hold this version, with why (``in doubt`` among them)."""
        return [e for e in self.engines if e.status not in ("committed", "current")]

    @property
    def in_doubt(self) -> list[str]:
        """Engines that went silent with the commit sent: they may hold this version."""
        return [e.engine for e in self.engines if e.status == "in doubt"]


def link_failure(
    engine: str, version: int, exc: AiosyncError, *, doubt: bool, leaves: bool
) -> AiosyncError:
    """``engine``'s failure of ``version`` as reported: naming both, saying what follows.

    ``doubt``: the engine went silent with the commit sent, so it may hold the version (an
    :class:`~aiosync.core.errors.InDoubtError`); ``leaves``: its session broke, so it
    leaves the sender's fleet.
    """
    if not (doubt or leaves or exc.peer is None or exc.version is None):
        return exc
    reason = exc.reason
    if doubt:
        reason += (
            f"; the engine may have committed version {version} (in doubt: it makes nothing "
            "live past the commit's deadline, and its version shows when it is contacted again)"
        )
    if leaves:
        reason += f"; {engine} leaves the fleet"
    kind = InDoubtError if doubt else type(exc)
    number = version if exc.version is None else exc.version
    return kind(reason, peer=exc.peer or engine, version=number, tensor=exc.tensor)
