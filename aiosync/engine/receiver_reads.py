"""What an engine reads from its :class:`~aiosync.engine.receiver.WeightReceiver`.

The committed version, the failures and counters, the swap's figures, and the read leases
(:meth:`ReceiverReads.serving`) that pin one version's weights for a request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from aiosync.channels.base import Listener
from aiosync.core.engine_actions import SyncFailure
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import SyncTimeoutError, UsageError
from aiosync.core.wire import ManifestMemo
from aiosync.engine.commit import Swapper, SwapStats
from aiosync.engine.config import ReceiverConfig
from aiosync.engine.holding import Holding, holding
from aiosync.engine.leases import LeaseGate
from aiosync.engine.sinks import WeightSink


class ReceiverReads:
    """The receiver's state as an engine reads it; :class:`WeightReceiver` fills it in."""

    sink: WeightSink
    config: ReceiverConfig
    _machine: EngineSession | None
    _listener: Listener | None
    _messages: ManifestMemo
    _swapper: Swapper
    _leases: LeaseGate
    _committed: anyio.Event

    @property
    def _session(self) -> EngineSession:
        if self._machine is None:
            raise UsageError("receiver is not open; use 'async with WeightReceiver(...)'")
        return self._machine

    @property
    def current_version(self) -> int | None:
        """The last committed version (None before the first)."""
        return self._machine.current_version if self._machine else None

    @property
    def servable(self) -> bool:
        """False mid-version in place, or after the live version's ``on_live`` hook failed.

        An in-place sink holding part of an uncommitted version, or a hook that raised or
        timed out (what the engine derived from the old weights may be stale), until a
        later version commits (and its hook returns).
        """
        if self._swapper.stats.on_live_error is not None:
            return False
        return self._machine.servable if self._machine else True

    @property
    def failures(self) -> list[SyncFailure]:
        """The streams that did not commit, oldest first (the last ``max_failures``)."""
        return list(self._machine.failures) if self._machine else []

    @property
    def last_failure(self) -> SyncFailure | None:
        """The most recent stream that failed, if any."""
        return self.failures[-1] if self.failures else None

    @property
    def swap_stats(self) -> SwapStats:
        """How long versions took to go live here: waits for leases, swaps, commits."""
        return self._swapper.stats

    @property
    def protocol_errors(self) -> int:
        """Messages refused as malformed or out of order."""
        return self._machine.protocol_errors if self._machine else 0

    @property
    def withdrawn(self) -> int:
        """Begins that a sender took back before any bucket (no failures; docs/protocol.md)."""
        return self._machine.withdrawn if self._machine else 0

    @property
    def sessions(self) -> int:
        """Sender sessions open now (each holds its plane open)."""
        return len(self._machine.sessions) if self._machine else 0

    @property
    def holding(self) -> Holding:
        """What this receiver holds for its peers now: bytes queued, manifests kept."""
        queued = 0 if self._listener is None else self._listener.queued_bytes
        return holding(self._session, self._messages, queued)

    @property
    def streaming(self) -> str | None:
        """The sender whose version is being received now, if any."""
        machine = self._machine
        if machine is None or machine.owner is None:
            return None
        session = machine.sessions.get(machine.owner)
        return session.name if session is not None else None

    @property
    def endpoint(self) -> str:
        """The address senders connect to (with ``connect``: the trainer's, connected to)."""
        if self._listener is None:
            raise UsageError("receiver is not open")
        return self._listener.endpoint

    @asynccontextmanager
    async def serving(self, timeout: float | None = None) -> AsyncIterator[int | None]:
        """Pin the weights for one request or batch; yields exactly their version.

        While any lease is held no byte of a new version touches the weights: a version
        that completes meanwhile is made live at the first moment no lease is held (and its
        sender acknowledged then, or already when it was staged with
        ``ReceiverConfig(ack_at="staged")``). A lease asked for while such a swap waits,
        waits for it (at most ``timeout``, default ``swap_timeout``). Needs a staged sink:
        an in-place sink changes the weights as buckets arrive.
        """
        if not self.sink.staged:
            raise UsageError("read leases need a staged sink (ModuleSink(model, staged=True))")
        async with self._leases.lease(self.config.swap_timeout if timeout is None else timeout):
            yield self.current_version

    async def wait_for_version(self, version: int, timeout: float) -> int:
        """Wait until ``current_version >= version``; :class:`SyncTimeoutError` after timeout."""
        with anyio.move_on_after(timeout):
            while (current := self.current_version) is None or current < version:
                await self._committed.wait()
            return current
        raise SyncTimeoutError(
            f"still at version {self.current_version} after {timeout:g}s", version=version
        )
