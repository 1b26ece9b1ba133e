"""The server's side of each subscription: one task per subscriber, a version at a time.

:class:`SubscriberFeeds` is a part of :class:`~aiosync.server.server.WeightServer`: the
loop that sends a subscriber each version it should have (:func:`feed_version`), counts
what it served, and tells the server's waiters when anything changed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import AiosyncError
from aiosync.server.config import ServerConfig
from aiosync.server.feed import counter, feed_version, gone_while_idle, is_refusal, retried
from aiosync.server.fleet import FleetBook, SubscriberState
from aiosync.server.store import RetentionStore

log = logging.getLogger(__name__)

__all__ = ["SubscriberFeeds"]


class SubscriberFeeds:
    """Feeds each subscriber from the retention store; the server's state, declared here."""

    config: ServerConfig
    store: RetentionStore
    fleet: FleetBook
    metrics: Any
    _changed: anyio.Event
    _begun: dict[str, float]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        if self.metrics is not None:
            self.metrics.update(self.fleet, self.store.held_bytes)

    async def _feed(self, state: SubscriberState, channel: Channel, control: Channel) -> None:
        """Send ``state`` each version it should have, until its receiver is gone."""
        sender = self.config.name or f"server-{os.getpid()}"
        refused: int | None = None
        try:
            while not channel.lost.is_set():
                target = self.fleet.next_version(state.name, self.store.versions)
                if target is not None and not state.transfers:  # late_join counts from here
                    self._begun.setdefault(state.name, time.perf_counter())
                retained = None if target in (None, refused) else self.store.pin(target)
                if retained is None:
                    if await gone_while_idle(self._changed, channel):
                        return
                    continue
                started = time.perf_counter()
                try:
                    done = await feed_version(
                        channel,
                        state,
                        retained,
                        sender=sender,
                        timeout=self.config.timeout,
                        window=self.config.window,
                        counted=counter(state, self.metrics),
                    )
                except AiosyncError as exc:
                    if await retried(exc, channel):  # busy: the same version, a moment later
                        continue
                    state.last_error = str(exc)
                    log.warning("transfer to %s failed: %s", state.name, exc)
                    if self.metrics is not None:
                        self.metrics.failures.inc()
                    if channel.lost.is_set() or not is_refusal(exc):
                        return
                    refused = retained.version  # not again: wait for a newer one
                    continue
                finally:
                    self.store.unpin(retained.version)
                self._served(state, done.version, done.buckets_sent, started)
        finally:
            self.fleet.remove(state.name)
            self._begun.pop(state.name, None)
            if self.metrics is not None:
                self.metrics.forget([state.name])
            self._notify()
            with anyio.CancelScope(shield=True):
                await channel.aclose()
                await control.aclose()  # ends its control loop too
            log.info("subscriber %s left", state.name)

    def _served(
        self, state: SubscriberState, version: int | None, buckets: int, began: float
    ) -> None:
        state.version, state.transfers = version, state.transfers + 1
        if self.metrics is not None and buckets:  # bytes are counted as they go
            self.metrics.served.inc()
            self.metrics.latency.labels("transfer").observe(time.perf_counter() - began)
            joined = self._begun.pop(state.name, None)
            if joined is not None:
                self.metrics.latency.labels("late_join").observe(time.perf_counter() - joined)
        self._notify()
