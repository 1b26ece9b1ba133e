"""``update_weights_from_tensor`` for :class:`~aiosync.handles.engine.AiosyncEngine`.

One call is a bucket (its parts), then the version's prepare, then its commit; versions
count on from the engine's last, whichever path committed it.

When trainer ranks share the engine's GPUs (the colocated layout, :mod:`aiosync.topology`),
they hand each bucket over as one encoded part per engine rank, naming a CUDA IPC (or, on
CPUs, shared-memory) buffer. :class:`ColocatedUpdates` reads those parts with a
:class:`~aiosync.topology.ColocatedReceiver` over the engine's own sinks, so both of the
engine's update paths write the same weights, and keeps the receiver's version numbers in
step with the engine's. Also the small helpers both paths share (answers' text, numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiosync.engine.colocated import ColocatedReceiver
from aiosync.engine.sinks import WeightSink


def error_text(exc: BaseException) -> str:
    """``exc`` as one line of text naming its type."""
    return f"{type(exc).__name__}: {exc}"


def version_number(weight_version: str | None, committed: int | None) -> int:
    """``weight_version`` as an int when it is one, else the version after ``committed``."""
    if weight_version is not None and weight_version.isdigit() and len(weight_version) < 19:
        return int(weight_version)
    return 0 if committed is None else committed + 1


@dataclass(frozen=True)
class TensorUpdate:
    """One call's outcome: the answer, the version committed, whether weights are servable.

    ``servable`` is False while an in-place sink holds part of a failed version.
    """

    success: bool
    message: str
    committed: int | None
    servable: bool


class ColocatedUpdates:
    """Colocated bucket parts into ``sinks`` (one per engine rank); opened on first use.

    Not thread-safe on its own: the engine calls it under its update lock.
    """

    def __init__(self, sinks: Sequence[WeightSink], name: str) -> None:
        self._receiver = ColocatedReceiver(list(sinks), name=name)

    def update(
        self,
        entries: Sequence[bytes | str],
        load_format: str | None,
        weight_version: str | None,
        committed: int | None,
    ) -> TensorUpdate:
        """Apply one call's parts (a bucket, the prepare or the commit of a version).

        ``committed``: the engine's version, from which an unnumbered version counts on.
        """
        receiver = self._receiver
        receiver.current_version = committed
        result = receiver.update_weights_from_tensor(
            entries, load_format=load_format, weight_version=weight_version
        )
        return TensorUpdate(
            result.success, result.message, receiver.current_version, receiver.servable
        )

    def close(self) -> None:
        """Close buffers still open and drop a version in progress (idempotent)."""
        self._receiver.close()
