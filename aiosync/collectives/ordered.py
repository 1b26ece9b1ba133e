"""NCCL broadcasts queued on the GPU in the order CUDA events give, watched under deadlines.

:class:`OrderedBroadcasts` queues a step's broadcasts after a CUDA event (a bucket packed,
a buffer copied out) and records an event once they are done, with no host wait: the GPU
keeps the order, and the next step is queued while this one runs.

No host thread blocks on those broadcasts, so something else must make sure they end. A
:class:`CompletionWatch` holds, per queued step, a CUDA event recorded after it and the
sync's :class:`~aiosync.collectives.executor.Deadline`. One thread sleeps until the
earliest deadline; if that step's event has not completed by then, it breaks the group
(:meth:`GroupExecutor.fail`), which aborts the NCCL communicator so the kernels end, and
every later call on the group fails at once. :meth:`CompletionWatch.settle` is the one
host wait: it returns once every watched step has completed, and raises if any of them
failed, timed out, or ended only because the group was aborted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from aiosync.collectives import ops
from aiosync.collectives.executor import Deadline, GroupExecutor
from aiosync.core.errors import AiosyncError, PeerGoneError, SyncTimeoutError

log = logging.getLogger(__name__)

FIRST_POLL = 50e-6
"""Seconds between a settling thread's first looks at an event (doubling up to LAST_POLL)."""
LAST_POLL = 200e-6
"""The longest pause between a settling thread's looks at an event."""


@dataclass(frozen=True)
class _Step:
    event: torch.cuda.Event
    deadline: Deadline
    what: str
    works: tuple[dist.Work, ...]


class CompletionWatch:
    """Steps queued on ``executor``'s group, each done once its CUDA event completes.

    ``peers`` names the other side in errors (the engines, or the trainer). Thread-safe;
    :meth:`close` stops the watching thread (idempotent).
    """

    def __init__(self, executor: GroupExecutor, peers: Sequence[str] = ()) -> None:
        self._executor = executor
        self._peers = tuple(peers)
        self._steps: list[_Step] = []
        self._failed: AiosyncError | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(
            target=self._watch, name=f"aiosync-watch-{executor.name}", daemon=True
        )
        self._thread.start()

    def add(
        self,
        event: torch.cuda.Event,
        deadline: Deadline,
        what: str,
        works: Sequence[dist.Work] = (),
    ) -> None:
        """Watch ``event`` (recorded after the step ``what``) until ``deadline``."""
        with self._wake:
            self._prune()
            self._steps.append(_Step(event, deadline, what, tuple(works)))
            self._wake.notify()

    @property
    def pending(self) -> bool:
        """True while a watched step has not completed."""
        with self._wake:
            self._prune()
            return bool(self._steps)

    def settle(self, deadline: Deadline) -> None:
        """Block until every watched step completed; raise if one failed or ``deadline`` passed.

        Past ``deadline`` (or a step's own), the group is broken and aborted first, so
        nothing is left running on the GPU for a dead peer.
        """
        pause = FIRST_POLL
        while True:
            with self._wake:
                self._prune()
                late = self._late(deadline)
                left = bool(self._steps)
            if late is not None:
                raise self._executor.fail(late)
            if not left:
                break
            # A worker thread's poll, never an event loop's: planes call settle through
            # anyio.to_thread (collective.drain, cuda_order._settled). CUDA events give no
            # blocking wait that a deadline or an abort could interrupt.
            time.sleep(pause)
            pause = min(2 * pause, LAST_POLL)
        if self._executor.broken is not None:  # an abort also completes the events
            raise self._executor.broken
        if self._failed is not None:
            raise self._executor.fail(self._failed)

    def close(self) -> None:
        """Stop watching (steps still pending are the caller's to abort).

        Waits at most the executor's ``join_timeout`` for the watching thread: one that is
        aborting a late group (an NCCL abort can block) is left behind, logged.
        """
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(self._executor.join_timeout)
            if self._thread.is_alive():
                log.warning(
                    "group %s: the watching thread is still aborting the group %.0fs after "
                    "close; leaving it behind",
                    self._executor.name,
                    self._executor.join_timeout,
                )

    # --- the watching thread ----------------------------------------------------------

    def _prune(self) -> None:
        """Drop completed steps (under the lock), noting a step whose collective failed."""
        kept = []
        for step in self._steps:
            if not step.event.query():  # type: ignore[no-untyped-call]
                kept.append(step)
                continue
            for work in step.works:
                error = _work_error(work)
                if error is not None and self._failed is None:
                    self._failed = PeerGoneError(
                        f"{step.what} failed: {error}", peer=", ".join(self._peers) or None
                    )
        self._steps = kept

    def _late(self, deadline: Deadline | None = None) -> SyncTimeoutError | None:
        """A timeout error if a pending step (or the whole ``deadline``) is past due."""
        for step in self._steps:
            over = step.deadline if step.deadline.expired else deadline
            if over is not None and over.expired:
                return SyncTimeoutError(
                    f"{step.what} on group {self._executor.name} did not finish within the "
                    f"{over.seconds:g}s deadline; the group was aborted (reconnect with a new "
                    "group)",
                    peer=", ".join(self._peers) or None,
                )
        return None

    def _watch(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
                self._prune()
                late = self._late()
                if late is None:
                    first = min((s.deadline.end for s in self._steps), default=None)
                    wait = None if first is None else max(first - time.monotonic(), 0.0)
                    self._wake.wait(wait)
                    continue
                self._steps.clear()
            log.warning("%s", late)
            self._executor.fail(late)


def _work_error(work: dist.Work) -> str | None:
    """The error a completed collective ended with, if torch recorded one."""
    try:
        error = work.exception()
    except Exception:  # a backend that keeps no errors: the event's completion is the answer
        log.debug("cannot read a collective's error", exc_info=True)
        return None
    return None if error is None else str(error)


class OrderedBroadcasts:
    """Queues a group's NCCL broadcasts on two streams of ``device``, watched by a deadline.

    Each step waits (on the GPU) for the event it is given, then broadcasts; an event
    recorded after the broadcasts marks it done and is watched by :attr:`watch`. Used on the
    group's turn (its executor thread, or a caller of
    :meth:`~aiosync.collectives.executor.GroupExecutor.call_here`): every rank issues its
    collectives in one order.
    ``peers`` names the other side in errors.
    """

    def __init__(
        self, executor: GroupExecutor, device: torch.device, peers: Sequence[str] = ()
    ) -> None:
        self.device = device
        self.issue = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.finish = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.watch = CompletionWatch(executor, peers)

    def hold(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory from reuse until the steps queued when it is freed ended."""
        tensor.record_stream(self.issue)
        tensor.record_stream(self.finish)

    def step(
        self,
        group: dist.ProcessGroup,
        tensors: list[torch.Tensor],
        after: torch.cuda.Event | None,
        deadline: Deadline,
        what: str,
        then: torch.cuda.Stream | None = None,
    ) -> torch.cuda.Event:
        """Broadcast ``tensors`` from rank 0 once ``after`` completed; returns the done event.

        ``then``: a stream made to wait for the broadcasts too (a trainer's own stream,
        whose later writes must not reach tensors still being read). No host wait.
        """
        with torch.cuda.stream(self.issue):
            if after is not None:
                self.issue.wait_event(after)
            works = ops.queue_broadcasts(group, tensors, 0, deadline)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.finish):
            for work in works:
                work.wait()  # no timeout: the finish stream, not the host, waits
            done.record(self.finish)
        if then is not None:
            then.wait_event(done)
        self.watch.add(done, deadline, what, works)
        return done

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self.watch.close()
