"""Which buckets an engine may apply on its event loop: those measured quick last time.

Handing a bucket to a worker thread and back costs 0.15-0.6 ms on the shared GPU hosts
(docs/benchmarks.md), about the host work of a bucket whose copies are kept from the last
version (its checks, about a microsecond a tensor, and its copies queued by address or as
one CUDA graph), and the worker then competes with the loop for the GIL. Only a sink that
says so takes part (``applies_quickly()``: :class:`~aiosync.ModuleSink`'s own by-address
copies, never a user's code, which may block or need a worker thread). The engine times
each bucket's apply by its spec list, the very same list object every version while the
stream replays the last one (a direct split kept, or a ring bucket of the same layout):
one that took at most :data:`~aiosync.core.where_to_run.LOOP_SECONDS` last time (CPU time
in a worker; on the loop, the longer of CPU and wall time) is applied on the loop this
time, on the stream a worker thread would use (:func:`worker_stream`). A bucket not seen
before, one that turned slow (a CPU bucket's bytes copied by the CPU, say), one whose
apply failed, one the engine holds or keeps by digest for a resume (its store may write a
file) go to the worker thread as always. And only a plane that says its views never wait
on the host takes part (:func:`views_at_once`): a collective plane's view joins a
broadcast, which may block for its whole deadline, and a worker's CPU time would not show
that wait. For ring buckets each hop saved is on the version's critical path: the trainer
refills a buffer only once its ack is back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aiosync.core.engine_actions import Apply
from aiosync.core.where_to_run import on_loop
from aiosync.planes.base import ReceiverPlane

KEPT = 1024
"""Spec lists remembered at most (the oldest are forgotten first)."""


class QuickApplies:
    """How long each bucket's last apply took, by the identity of its spec list."""

    def __init__(self) -> None:
        self._seconds: dict[int, tuple[object, float]] = {}  # id -> (the list, seconds)

    def quick(self, action: Apply) -> bool:
        """Whether ``action``'s bucket took at most LOOP_SECONDS last time (:func:`on_loop`).

        Never one held or kept by digest for a resume.
        """
        if _for_resume(action):
            return False
        seen = self._seconds.get(id(action.specs))
        return seen is not None and seen[0] is action.specs and on_loop(measured_seconds=seen[1])

    def forget(self, action: Apply) -> None:
        """``action``'s apply failed: its bucket goes to the worker thread from now on."""
        self._seconds.pop(id(action.specs), None)

    def note(self, action: Apply, seconds: float) -> None:
        """Remember how long ``action``'s apply took (not for one held or kept by digest)."""
        if _for_resume(action):
            return
        self._seconds.pop(id(action.specs), None)  # re-inserted last: the newest
        self._seconds[id(action.specs)] = (action.specs, seconds)
        while len(self._seconds) > KEPT:
            del self._seconds[next(iter(self._seconds))]


def _for_resume(action: Apply) -> bool:
    """Whether the engine's resume store reads (held) or may write (digest) the bucket."""
    return action.held or action.digest is not None


def views_at_once(plane: ReceiverPlane | type[ReceiverPlane]) -> bool:
    """Whether ``plane``'s buckets may be applied on the loop: its views never wait on the host.

    Opt-in (:attr:`~aiosync.planes.base.ReceiverPlane.views_at_once` on the plane's class):
    shared memory, CUDA planes ordered by events, direct mode. Not a collective plane,
    whose view joins a broadcast.
    """
    return plane.views_at_once


@contextmanager
def worker_stream(device: torch.device) -> Iterator[None]:
    """Run the block on the CUDA stream a worker thread would use: ``device``'s default one.

    Current streams are per thread in torch; the loop's may be an application's own (a
    ``torch.cuda.stream`` block around the serving loop), and the sink's commit, in a worker
    thread, waits for the default stream. Nothing changes for a CPU device.
    """
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.default_stream(device)):
        yield
