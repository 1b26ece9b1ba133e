"""Which direct buckets an engine may apply on its event loop: those measured quick last time.

Handing a bucket to a worker thread and back costs 0.15-0.6 ms on the shared GPU hosts
(docs/benchmarks.md), about the host work of a direct bucket whose split and copies are
kept from the last version (its checks, about a microsecond a tensor, and one CUDA graph
launch), and the worker then competes with the loop for the GIL. The engine times
each direct bucket's apply (CPU time of the applying thread) by the spec list it was for:
a kept bucket arrives with the very same list every version. One that took at most
:data:`INLINE_APPLY` last time is applied on the loop this time; anything else, and any
bucket not seen before, goes to the worker thread as always. A bucket that turns slow is
measured on the loop too and goes back to the thread the next time.
"""

from __future__ import annotations

from aiosync.core.engine_actions import Apply

INLINE_APPLY = 0.5e-3
"""Seconds of host work up to which a direct bucket's apply runs on the event loop.

At most about what a hop to a worker thread costs on those hosts: inline is then never
slower, and the loop is held no longer than that.
"""

KEPT = 1024
"""Spec lists remembered at most (the oldest are forgotten first)."""


class QuickApplies:
    """The last apply's CPU seconds of each direct bucket, by the identity of its spec list."""

    def __init__(self) -> None:
        self._seconds: dict[int, tuple[object, float]] = {}  # id -> (the list, seconds)

    def quick(self, action: Apply) -> bool:
        """Whether ``action`` is a direct bucket whose last apply took at most INLINE_APPLY."""
        if not action.regions or action.held:
            return False
        seen = self._seconds.get(id(action.specs))
        return seen is not None and seen[0] is action.specs and seen[1] <= INLINE_APPLY

    def note(self, action: Apply, seconds: float) -> None:
        """Remember how long ``action``'s apply took (direct buckets only)."""
        if not action.regions or action.held:
            return
        self._seconds.pop(id(action.specs), None)  # re-inserted last: the newest
        self._seconds[id(action.specs)] = (action.specs, seconds)
        while len(self._seconds) > KEPT:
            del self._seconds[next(iter(self._seconds))]
