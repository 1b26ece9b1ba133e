"""What an engine states to each sender in its ``ready``, beyond its limits."""

from __future__ import annotations

from dataclasses import dataclass

from aiosync.core.limits import Limits
from aiosync.core.wire import PROTOCOL, Ready


@dataclass(frozen=True)
class ReadyTerms:
    """How long a commit may wait for read leases, and when it is answered.

    ``swap_timeout``: the most a staged commit waits for read leases (None: not stated);
    ``ack_at``: ``"live"`` or ``"staged"``, when a commit is answered (None: not stated).
    An :class:`~aiosync.core.engine_session.EngineSession` with no receiver's config behind
    it states neither.
    """

    swap_timeout: float | None = None
    ack_at: str | None = None

    def ready(self, session: str, current: int | None, limits: Limits, *, staged: bool) -> Ready:
        """The ``ready`` of ``session``; an engine that applies in place waits for no lease."""
        waits = self.swap_timeout if staged else None
        return Ready(session, PROTOCOL, current, limits, swap_timeout=waits, ack_at=self.ack_at)
