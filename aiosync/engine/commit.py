"""How a receiver makes a complete version live, and when its sender hears of it.

:class:`Swapper` carries out the session's ``CommitSink`` action: it takes the lease gate
exclusively (waiting, at most ``swap_timeout``, until no read lease is held), has the sink
make the version live, and reports to the session, which then acknowledges the sender.
With ``ReceiverConfig(ack_at="staged")`` the acknowledgement goes out before the wait, as
soon as the version is staged (see :class:`~aiosync.ReceiverConfig` for what it promises).
Once the sink made the version live, and still under the gate, it runs the receiver's
``on_live`` hook (:mod:`aiosync.engine.live_hook`); the version is current once it returns,
and no lease on it is granted before.

A sink whose commit moves no bytes (``commit_quickly``: a pointer swap) is committed on the
event loop itself; anything else runs in a worker thread, as applies do (but for a bucket
measured quick, :mod:`aiosync.engine.quick_apply`).
:class:`SwapStats` records how long each step took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from aiosync.core.engine_actions import Action, CommitSink, Peer, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError, SyncTimeoutError
from aiosync.core.versions import past_deadline
from aiosync.core.wire import Ack, Message
from aiosync.engine.config import ReceiverConfig
from aiosync.engine.leases import LeaseGate
from aiosync.engine.live_hook import OnLive, call_on_live
from aiosync.engine.sinks import WeightSink

log = logging.getLogger(__name__)

SendReply = Callable[[Peer, Message], Awaitable[None]]


@dataclass
class SwapStats:
    """Seconds spent making versions live, as measured inside the receiver.

    ``last_wait``/``longest_wait``: waiting for read leases to be released; ``last_swap``:
    the sink's commit (the swap itself), and ``last_swap_cpu`` the CPU time the thread that
    ran it spent (on a loaded machine the difference is time spent waiting for a core);
    ``last_commit``: from the commit message's action to the version being live and its
    acknowledgement handed to the channel (wait included); ``last_live``: when the last
    version went live (``time.perf_counter()``); ``committed``/``dropped``: versions made
    live / not made live at this step. ``last_on_live``: how long the ``on_live`` hook took
    (leases on the new version waited for it); ``on_live_failures``: hooks that raised or
    timed out; ``on_live_error``: why the live version's hook failed (None: it returned, or
    there is no hook); while it is set the receiver is not ``servable``.
    """

    committed: int = 0
    dropped: int = 0
    last_wait: float = 0.0
    longest_wait: float = 0.0
    last_swap: float = 0.0
    last_swap_cpu: float = 0.0
    last_commit: float = 0.0
    last_live: float = 0.0
    last_on_live: float = 0.0
    on_live_failures: int = 0
    on_live_error: str | None = None


class Swapper:
    """Carries out ``CommitSink`` for one receiver (its sink, gate, config, limiter, hook)."""

    def __init__(
        self,
        sink: WeightSink,
        leases: LeaseGate,
        config: ReceiverConfig,
        limiter: anyio.CapacityLimiter,
        on_live: OnLive | None = None,
    ) -> None:
        self.sink = sink
        self.leases = leases
        self.config = config
        self.limiter = limiter
        self.on_live = on_live
        self.stats = SwapStats()

    async def commit(
        self, machine: EngineSession, action: CommitSink, reply: SendReply
    ) -> list[Action]:
        """Make ``action.version`` live; returns the session's actions (the ack among them).

        With ``ack_at="staged"`` the ack has been sent before this waits, so the actions
        returned carry no reply to this sender: a refusal after that is logged instead.
        """
        started = time.perf_counter()
        early = self.config.ack_at == "staged" and self.sink.staged
        if early:
            early = await self._ack_now(machine, action, reply)
        wait = self.config.swap_timeout if early else self._wait(machine, action)
        try:
            async with self.leases.exclusive(wait):
                waited = time.perf_counter() - started
                late = None if early else past_deadline(action.deadline, machine.clock())
                if late is not None:  # the sender gave up while leases were held
                    raise SyncTimeoutError(late, version=action.version)
                try:
                    await self._swap(action.version)
                except Exception as exc:
                    error = AiosyncError(f"engine failed to commit: {exc}", version=action.version)
                    actions = machine.commit_failed(action.peer, action.version, error)
                    self.stats.dropped += 1
                else:  # live for every lease taken from now on, and only then acknowledged
                    try:
                        await self._live(action.version)
                    finally:  # current from here on, whatever the hook did
                        self.stats.last_live = time.perf_counter()
                        now = time.monotonic()
                        actions = machine.commit_done(action.peer, action.version, now)
                        self.stats.committed += 1
        except SyncTimeoutError as exc:  # readers held on: nothing was touched
            waited = time.perf_counter() - started
            error = exc if wait >= self.config.swap_timeout else self._cut(machine, action, exc)
            actions = machine.commit_failed(action.peer, action.version, error, touched=False)
            self.stats.dropped += 1
        self.stats.last_wait = waited
        self.stats.longest_wait = max(self.stats.longest_wait, waited)
        if early:
            actions = self._without_reply(action, actions)
        self.stats.last_commit = time.perf_counter() - started
        return actions

    async def _live(self, version: int) -> None:
        """Run the ``on_live`` hook; a failure leaves the version live, the engine unservable.

        The weights are live already and cannot be taken back (a copy swap overwrote the
        old ones), so the sender still hears the version committed; the engine's derived
        state may be stale, which ``servable`` (False until a later hook returns) says.
        """
        if self.on_live is None:
            return
        started = time.perf_counter()
        try:
            await call_on_live(self.on_live, version, self.config.swap_timeout)
        except AiosyncError as exc:
            log.error("version %d is live but %s", version, exc, exc_info=exc.__cause__)
            self.stats.on_live_failures += 1
            self.stats.on_live_error = str(exc)
        else:
            self.stats.on_live_error = None
        self.stats.last_on_live = time.perf_counter() - started

    def _wait(self, machine: EngineSession, action: CommitSink) -> float:
        """How long a swap may wait for leases: ``swap_timeout``, or to the sender's deadline."""
        if action.deadline is None:
            return self.config.swap_timeout
        return max(0.0, min(self.config.swap_timeout, action.deadline - machine.clock()))

    def _cut(
        self, machine: EngineSession, action: CommitSink, exc: SyncTimeoutError
    ) -> SyncTimeoutError:
        """``exc`` of a wait the sender's deadline cut short, naming both sides' bounds."""
        session = machine.sessions.get(action.peer)
        said = session.timeout if session is not None else None
        waits = f"it waits {said:g}s" if said is not None else "its timeout"
        swap = self.config.swap_timeout
        return SyncTimeoutError(
            f"{exc.reason} (the sender's deadline came first: {waits}, under this engine's "
            f"swap_timeout of {swap:g}s)",
            version=action.version,
        )

    async def _swap(self, version: int) -> None:
        """The sink's commit: on the loop when no byte moves, else in a worker thread."""
        started, cpu = time.perf_counter(), time.thread_time()
        if self.sink.commit_quickly(version):
            self.stats.last_swap_cpu = time.thread_time() - cpu
        else:
            self.stats.last_swap_cpu = await anyio.to_thread.run_sync(
                self._commit, version, limiter=self.limiter
            )
        self.stats.last_swap = time.perf_counter() - started

    def _commit(self, version: int) -> float:
        """The sink's commit in a worker thread; returns the thread's CPU seconds."""
        cpu = time.thread_time()
        self.sink.commit(version)
        return time.thread_time() - cpu

    async def _ack_now(self, machine: EngineSession, action: CommitSink, reply: SendReply) -> bool:
        """Acknowledge the commit before it goes live; False if there is no stream to ack."""
        session = machine.sessions.get(action.peer)
        stream = session.stream if session is not None else None
        if stream is None or stream.version != action.version:
            return False
        await reply(action.peer, Ack(action.version, stream.next_seq - 1, True))
        return True

    def _without_reply(self, action: CommitSink, actions: list[Action]) -> list[Action]:
        """``actions`` less their reply to the sender already acknowledged at staging."""
        kept: list[Action] = []
        for each in actions:
            if isinstance(each, Reply) and each.peer == action.peer:
                message = each.message
                if isinstance(message, Ack) and not message.ok:
                    log.warning(
                        "version %d was acknowledged when staged but not made live: %s",
                        action.version,
                        message.error,
                    )
                continue
            kept.append(each)
        return kept
