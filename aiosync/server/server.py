"""The weight server: publishers send versions to it, engines subscribe and take them.

Embed it (``async with WeightServer() as server``) or run ``aiosync serve``. Towards a
publisher it is an engine: an ordinary :class:`~aiosync.engine.receiver.WeightReceiver`
(every check, limit and key of a receiver applies) whose sink retains each version in
shared memory, so a trainer's ``send`` returns once the server holds the version. Towards
each subscriber it is a sender (:mod:`aiosync.server.feed`): it streams the newest retained
version whole from that memory, at the subscriber's pace, so a slow engine never slows the
publisher beyond the retention bound and a late joiner is served at once. Publishers and
subscribers are separate roles by key (:mod:`aiosync.server.roles`), and a subscriber
proves it owns the receiver it names before anything is sent there
(:mod:`aiosync.server.admission`).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import AsyncExitStack, suppress
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

import aiosync.server.messages as m
from aiosync.channels.base import Channel, PartsChannel
from aiosync.core.errors import (
    AiosyncError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
    UsageError,
)
from aiosync.core.exception_groups import exit_as_one
from aiosync.core.shares import Holder, half_of, holder, over_share
from aiosync.engine.receiver import WeightReceiver
from aiosync.planes.shm import ShmSegment
from aiosync.runtime import require_asyncio
from aiosync.server.admission import admit
from aiosync.server.config import ServerConfig
from aiosync.server.feeds import SubscriberFeeds
from aiosync.server.fleet import FleetBook, SubscriberState, subscription_problem
from aiosync.server.probe import HELLO_BOUND, probe, probe_segment
from aiosync.server.relay import Relay, RelayDesk
from aiosync.server.roles import SHARED
from aiosync.server.store import RetainingSink, RetentionStore

log = logging.getLogger(__name__)

REPLY_TIMEOUT = 10.0
CONTROLS_PER_SUBSCRIBER = 4  # control channels open at once, per subscriber allowed


class WeightServer(SubscriberFeeds):
    """Retains published versions in shared memory and streams them to subscribers.

    Use as ``async with``, entered and left in one task. Leaving it (or cancelling its
    task, as ``aiosync serve`` does on SIGTERM) aborts transfers in flight, tells every
    subscriber, and releases sockets, private directories and shared memory.
    """

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self._keys = self.config.role_auth
        self.store = RetentionStore(
            self.config.retention, memory_timeout=self.config.memory_timeout
        )
        self.fleet = FleetBook()
        self.relays = RelayDesk(self.store, lambda: self._changed)
        self.relay: Relay | None = None  # pulling from the upstream, when one is configured
        self.metrics: Any = None
        self._receiver: WeightReceiver | None = None
        self._listener: Any = None
        self._controls: dict[str, Channel] = {}
        self._holders: dict[str, Holder] = {}  # whose share each control channel takes
        self._probe: ShmSegment | None = None  # the one-page plane new receivers are probed on
        self._changed = anyio.Event()
        self._stack: AsyncExitStack | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._http: Any = None
        self._begun: dict[str, float] = {}

    # --- what a publisher and an operator read ------------------------------------------

    @property
    def publish_endpoint(self) -> str:
        """Where publishers' ``WeightSender`` connects."""
        if self._receiver is None:
            raise UsageError("server is not open; use 'async with WeightServer(...)'")
        return self._receiver.endpoint

    @property
    def control_endpoint(self) -> str:
        """Where subscribers and clients connect."""
        if self._listener is None:
            raise UsageError("server is not open; use 'async with WeightServer(...)'")
        return str(self._listener.endpoint)

    @property
    def metrics_address(self) -> str | None:
        """``http://127.0.0.1:port`` when the metrics endpoint is on."""
        return None if self._http is None else str(self._http.address)

    @property
    def newest(self) -> int | None:
        """The newest retained version (None until the first commits: not ready)."""
        return self.store.newest

    @property
    def ready(self) -> bool:
        """Whether the server holds a version to serve."""
        return self.store.newest is not None

    def status(self) -> m.Status:
        """Newest and retained versions, and each engine's version, bound and lag."""
        engines = [m.engine_status(s, self.fleet.lag(s.name)) for s in self.fleet.books]
        return m.Status(self.store.newest, self.store.versions, engines)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail) for a health check: ready once a version is retained."""
        return m.health(self.status())

    async def wait_within_bounds(self, timeout: float) -> m.Status:
        """Wait until every subscriber lags no more than its bound."""
        return await self._wait(self.fleet.all_within_bounds, timeout, "engines within bounds")

    async def wait_for(
        self, version: int, timeout: float, engines: list[str] | None = None
    ) -> m.Status:
        """Wait until every engine in ``engines`` (default: all) holds ``version`` or newer."""
        return await self._wait(
            lambda: self.fleet.have(version, engines), timeout, f"engines at version {version}"
        )

    async def wait_engines(self, count: int, timeout: float) -> m.Status:
        """Wait until exactly ``count`` subscribers are connected."""
        return await self._wait(
            lambda: len(self.fleet.subscribers) == count, timeout, f"{count} engines connected"
        )

    async def _wait(self, condition: Any, timeout: float, what: str) -> m.Status:
        with anyio.move_on_after(timeout):
            while not condition():
                await self._changed.wait()
            return self.status()
        raise SyncTimeoutError(f"no {what} within {timeout:g}s ({self.status()})")

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> WeightServer:
        require_asyncio("WeightServer")
        stack = AsyncExitStack()
        try:
            stack.callback(self.store.close)
            self._probe = probe_segment()
            stack.callback(self._probe.close)
            from aiosync.server.metrics import open_metrics

            self.metrics, self._http = open_metrics(stack, self.config, self.health)
            from aiosync.channels.zmq import ZmqListener

            if self._keys.shared:
                log.warning("every key allowed here may both publish and subscribe: %s", SHARED)
            self._listener = ZmqListener.open(
                self.config.control_endpoint,
                auth=self._keys.control,
                max_message_bytes=m.MAX_CONTROL_BYTES,
            )
            stack.push_async_callback(self._listener.aclose)
            receiver = WeightReceiver(
                RetainingSink(self.store),
                self.config.publish_endpoint,
                config=self.config.receiver,
                on_commit=self._committed_thread,
                auth=self._keys.publish,
            )
            self._receiver = await stack.enter_async_context(receiver)
            self._tasks = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._shut_down)
            self._tasks.start_soon(self._accept)
            if self.config.upstream is not None:
                relay = Relay(
                    self.config.upstream,
                    self.store,
                    self._published,
                    auth=self.config.upstream_auth,
                    timeout=self.config.timeout,
                    resume_dir=self.config.resume_dir,
                    limits=self.config.upstream_limits,
                )
                self.relay = relay
                self._tasks.start_soon(relay.run)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        log.info("publish at %s, subscribe at %s", self.publish_endpoint, self.control_endpoint)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await exit_as_one(stack.__aexit__(exc_type, exc, tb), exc)
        self._receiver = self._listener = self._tasks = None

    async def _shut_down(self) -> None:
        """Tell subscribers, then stop every task (transfers in flight are aborted)."""
        with anyio.CancelScope(shield=True):
            for channel in list(self._controls.values()):
                await self._reply(channel, m.Closing("server shutting down"))
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()

    # --- publishers -------------------------------------------------------------------

    def _committed_thread(self, version: int) -> None:
        anyio.from_thread.run_sync(self._published, version)

    def _published(self, version: int) -> None:
        self.fleet.publish(version)
        log.info("version %d retained (%s)", version, self.store.versions)
        if self.metrics is not None:
            self.metrics.published.inc()
            self.metrics.newest.set(version)
            self.metrics.bytes_in.inc(self.store.book.bytes_of(version))
            if self.store.last_publish_seconds is not None:
                self.metrics.latency.labels("publish").observe(self.store.last_publish_seconds)
        self._notify()

    # --- control channel --------------------------------------------------------------

    async def _accept(self) -> None:
        assert self._tasks is not None
        assert self._listener is not None
        while True:
            channel = await self._listener.accept()
            self._tasks.start_soon(self._control, channel)

    async def _reply(self, channel: Channel, message: m.Reply) -> None:
        with anyio.move_on_after(REPLY_TIMEOUT), suppress(AiosyncError):
            await channel.send(m.encode(message))  # a peer gone meanwhile: nothing to do

    async def _control(self, channel: PartsChannel) -> None:
        """Serve one client's requests in order; a malformed one ends its channel."""
        most = CONTROLS_PER_SUBSCRIBER * self.config.max_subscribers
        who = holder(channel.peer, channel.key)
        over = over_share(self._holders.values(), who, half_of(most))
        if len(self._controls) >= most or over is not None:
            await self._reply(channel, m.Refused(f"too many control channels ({over or most})"))
            return await channel.aclose()
        self._controls[channel.peer], self._holders[channel.peer] = channel, who
        subscriber: SubscriberState | None = None
        try:
            while True:
                # a client that went quiet is forgotten (a ROUTER never hears it leave); its
                # next request opens a new channel. A subscriber's ends with its receiver.
                payload = None
                with anyio.move_on_after(math.inf if subscriber else self.config.timeout):
                    payload = await channel.recv()
                if payload is None:
                    return
                try:
                    request = m.decode_request(payload)
                except ProtocolError as exc:
                    log.warning("control peer %s sent garbage: %s", channel.peer, exc)
                    await self._reply(channel, m.Refused(str(exc)))
                    return
                refusal = self._keys.roles.refusal(request, channel.key)
                if refusal is not None:
                    await self._reply(channel, m.Refused(refusal))
                    continue
                if isinstance(request, m.Subscribe):
                    if subscriber is not None:
                        await self._reply(channel, m.Refused("this channel already subscribed"))
                        continue
                    subscriber = await self._subscribe(channel, request)
                    if subscriber is None:  # refused: nothing more to say on this channel
                        return
                    continue
                if isinstance(request, m.Pull):
                    reply: m.Reply | None = await self.relays.pull(
                        channel, request, self.config.max_wait
                    )
                elif isinstance(request, m.Get):
                    reply = await self.relays.get(channel, request, self.config.timeout)
                else:
                    reply = await self._answer(request, subscriber)
                if reply is not None:
                    await self._reply(channel, reply)
        except AiosyncError as exc:
            log.debug("control channel %s ended: %s", channel.peer, exc)
        finally:
            self.relays.release(channel.peer)
            self._controls.pop(channel.peer, None)
            self._holders.pop(channel.peer, None)
            with anyio.CancelScope(shield=True):
                await channel.aclose()

    async def _answer(self, request: m.Request, subscriber: SubscriberState | None) -> m.Reply:
        if isinstance(request, m.StatusRequest):
            return self.status()
        if isinstance(request, m.Wait):
            timeout = m.bounded_wait(request.timeout, self.config.max_wait)
            engines = request.engines[: self.config.max_subscribers] if request.engines else None
            try:
                if request.version is None:
                    return await self.wait_within_bounds(timeout)
                return await self.wait_for(request.version, timeout, engines)
            except SyncTimeoutError as exc:
                return m.Refused(str(exc))
        if subscriber is None:
            return m.Refused("fetch and follow need a subscription on this channel")
        if isinstance(request, m.Fetch):
            if request.version not in self.store.versions:
                return m.Refused(f"version {request.version} is not retained")
            subscriber.follow, subscriber.target = False, request.version
        else:
            subscriber.follow, subscriber.target = True, None
        self._notify()
        return self.status()

    async def _subscribe(self, control: Channel, request: m.Subscribe) -> SubscriberState | None:
        """Admit the subscriber (it owns the receiver it names), then start feeding it."""
        assert self._tasks is not None
        name = request.name or control.peer
        bounds = self.fleet, name, request.endpoint, request.max_lag, self.config.max_subscribers
        problem = subscription_problem(*bounds)
        if problem is None:
            own, wait = self.config.subscriber_auth, self.config.timeout
            try:
                channel = await admit(control, request, own=own, timeout=wait, reply=self._reply)
            except RejectedError as exc:
                problem = exc.reason
            else:
                problem = await self._probed(channel, name) or subscription_problem(*bounds)
                if problem is not None:  # (another may have come meanwhile)
                    await channel.aclose()
        if problem is not None:
            await self._reply(control, m.Refused(problem))
            return None
        state = self.fleet.add(name, request.max_lag, follow=request.follow)
        state.resume, state.held = request.resume, m.held_digests(request.held)
        self._tasks.start_soon(self._feed, state, channel, control)
        log.info("subscriber %s at %s (max lag %d)", name, request.endpoint, request.max_lag)
        self._notify()
        await self._reply(control, self.status())
        return state

    async def _probed(self, channel: Channel, name: str) -> str | None:
        """Why ``name``'s receiver may not hold a slot: it did not answer a hello promptly."""
        assert self._probe is not None
        sender = self.config.name or f"server-{os.getpid()}"
        wait = min(self.config.timeout, HELLO_BOUND)
        return await probe(channel, name, self._probe, sender=sender, timeout=wait)
