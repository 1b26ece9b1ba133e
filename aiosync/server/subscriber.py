"""An engine's side of a server: :class:`Subscriber`, and :class:`ServerClient` for anyone.

A subscriber wraps an ordinary :class:`~aiosync.engine.receiver.WeightReceiver`
(:attr:`Subscriber.receiver`: its sink, leases, checks and limits unchanged) and adds a
control channel on which it asks the server to feed it: the newest version as it appears
(within ``max_lag``), or a named retained one. Versions arrive as weight streams from the
server to the receiver's endpoint.

A subscriber that resumes keeps the buckets of a version until it commits, by digest
(:class:`~aiosync.engine.held.HeldBuckets`: in memory, or files in ``resume_dir``); when
it subscribes again (:meth:`Subscriber.resubscribe`, or a new process with the same
directory) it tells the server which it holds, and the server sends only the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType

import anyio

import aiosync.server.messages as m
from aiosync.channels.base import Channel, Listener
from aiosync.channels.keys import ChannelAuth
from aiosync.core.engine_actions import SyncFailure
from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.core.exception_groups import exit_as_one
from aiosync.engine.commit import SwapStats
from aiosync.engine.config import ReceiverConfig
from aiosync.engine.held import HeldBuckets
from aiosync.engine.live_hook import OnLive
from aiosync.engine.receiver import WeightReceiver
from aiosync.engine.sinks import WeightSink
from aiosync.runtime import require_asyncio

log = logging.getLogger(__name__)


class ServerClient:
    """Requests to a server's control endpoint, one at a time, each bounded by a timeout.

    Use as ``async with``. A server that is shutting down is a :class:`PeerGoneError`.
    """

    def __init__(
        self, endpoint: str, *, auth: ChannelAuth | None = None, timeout: float = 30.0
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._auth = auth
        self._channel: Channel | None = None
        self._lock = anyio.Lock()
        self.closing: str | None = None  # the server's reason, once it said it is closing

    async def __aenter__(self) -> ServerClient:
        require_asyncio("ServerClient")
        from aiosync.channels.zmq import ZmqChannel

        self._channel = ZmqChannel.connect(self.endpoint, auth=self._auth)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            with anyio.CancelScope(shield=True):
                await channel.aclose()

    async def request(self, message: m.Request, timeout: float | None = None) -> m.Status:
        """Send one request and return the server's status; refusals raise RejectedError."""
        reply = await self.ask(message, timeout)
        if not isinstance(reply, m.Status):
            raise ProtocolError(
                f"expected a status, got {type(reply).__name__}", peer=self.endpoint
            )
        return reply

    async def ask(self, message: m.Request, timeout: float | None = None) -> m.Status | m.Prove:
        """:meth:`request`, where the answer may also be ``prove`` (to a ``subscribe``)."""
        if self._channel is None:
            raise AiosyncError("client is not open", peer=self.endpoint)
        wait = self.timeout if timeout is None else timeout
        async with self._lock:
            with anyio.move_on_after(wait):
                await self._channel.send(m.encode(message))
                while True:
                    reply = m.decode_reply(await self._channel.recv())
                    if isinstance(reply, m.Closing):
                        self.closing = reply.reason
                        raise PeerGoneError(f"server closing: {reply.reason}", peer=self.endpoint)
                    if isinstance(reply, m.Refused):
                        raise RejectedError(reply.reason, peer=self.endpoint)
                    if not isinstance(reply, m.Status | m.Prove):
                        raise ProtocolError(
                            f"expected a status, got {type(reply).__name__}", peer=self.endpoint
                        )
                    return reply
        raise SyncTimeoutError(
            f"no answer to {type(message).__name__} within {wait:g}s", peer=self.endpoint
        )

    async def reconnect(self) -> None:
        """Close the control channel and open a new one (the server sees a new client)."""
        from aiosync.channels.zmq import ZmqChannel

        async with self._lock:
            old, self._channel = self._channel, None
            if old is not None:
                with anyio.CancelScope(shield=True):
                    await old.aclose()
            self._channel = ZmqChannel.connect(self.endpoint, auth=self._auth)

    async def status(self) -> m.Status:
        """Newest and retained versions, and every engine's version and lag."""
        return await self.request(m.StatusRequest())

    async def wait_within_bounds(self, timeout: float) -> m.Status:
        """Wait until every engine is within its lag bound (SyncTimeoutError past timeout)."""
        return await self._wait(m.Wait(timeout), timeout)

    async def wait_for(
        self, version: int, timeout: float, engines: list[str] | None = None
    ) -> m.Status:
        """Wait until every engine in ``engines`` (default: all) holds ``version`` or newer."""
        return await self._wait(m.Wait(timeout, version, engines), timeout)

    async def _wait(self, message: m.Wait, timeout: float) -> m.Status:
        try:
            return await self.request(message, timeout + self.timeout)
        except RejectedError as exc:
            raise SyncTimeoutError(exc.reason, peer=self.endpoint) from None


class Subscriber:
    """An engine fed by a server: a receiver into ``sink`` and a subscription for it.

    ``server`` is the server's control endpoint; ``max_lag`` how many versions this engine
    may lag (the server reports it, and publishers may wait on it); ``follow=False``
    subscribes without taking versions until :meth:`fetch` or :meth:`follow`. ``endpoint``
    is where the receiver binds (default: ``ipc://`` in a private directory; a ``tcp://``
    one takes ``receiver_auth``); ``auth`` reaches the server's control endpoint. Subscribing
    proves to the server that the receiver is this engine's: the server's challenge reaches
    it there and the subscriber sends it back (:mod:`aiosync.server.admission`).
    ``on_commit(version)`` runs in a worker thread after each commit; ``on_live(version)``
    runs under the swap, before any lease on the new version (the receiver's, see
    :class:`~aiosync.WeightReceiver`). What an engine reads of its receiver is here too
    (:attr:`current_version`, :attr:`servable`, :attr:`failures`, :attr:`swap_stats`,
    :attr:`endpoint`, :meth:`serving`); the rest is on :attr:`receiver`.

    ``resume=True`` keeps the buckets of a version in host memory until it commits (by
    content digest, which the server then sends with each bucket), so that after a broken
    transfer :meth:`resubscribe` is sent only the buckets missing; ``resume_dir`` keeps
    them as files there instead (a private directory, 0700; one engine per directory), so
    a new process subscribing with the same directory is sent only the missing ones too.
    ``resume_bytes`` bounds what is kept (besides: the buckets of two versions at most).
    A held bucket is checked against its digest when read back; one that fails is sent
    again. ``resume`` may also be a :class:`HeldBuckets` to share between subscribers
    made one after another.
    """

    def __init__(
        self,
        server: str,
        sink: WeightSink,
        *,
        name: str = "",
        max_lag: int = 0,
        follow: bool = True,
        endpoint: str | Listener | None = None,
        config: ReceiverConfig | None = None,
        auth: ChannelAuth | None = None,
        receiver_auth: ChannelAuth | None = None,
        timeout: float = 30.0,
        on_commit: Callable[[int], object] | None = None,
        resume: bool | HeldBuckets = False,
        resume_dir: str | os.PathLike[str] | None = None,
        resume_bytes: int | None = None,
        on_live: OnLive | None = None,
    ) -> None:
        self.server = server
        if isinstance(resume, HeldBuckets):
            self.held: HeldBuckets | None = resume
        elif resume or resume_dir is not None:
            self.held = HeldBuckets(resume_dir, max_bytes=resume_bytes, reuse=True)
        else:
            self.held = None
        self.name = name
        self.max_lag = max_lag
        self._follow = follow
        self._receiver_auth = receiver_auth
        self._stack: AsyncExitStack | None = None
        self._user_on_commit = on_commit
        self._committed = anyio.Event()
        self.receiver = WeightReceiver(
            sink,
            endpoint,
            config=config,
            auth=receiver_auth,
            on_commit=self._on_commit,
            held=self.held,
            on_live=on_live,
        )
        self.client = ServerClient(server, auth=auth, timeout=timeout)

    def _on_commit(self, version: int) -> None:  # a worker thread
        anyio.from_thread.run_sync(self._bump)
        if self._user_on_commit is not None:
            self._user_on_commit(version)

    def _bump(self) -> None:
        self._committed.set()
        self._committed = anyio.Event()

    @property
    def current_version(self) -> int | None:
        """The version this engine serves (None: not ready yet)."""
        return self.receiver.current_version

    @property
    def servable(self) -> bool:
        """The receiver's :attr:`~aiosync.WeightReceiver.servable`."""
        return self.receiver.servable

    @property
    def failures(self) -> list[SyncFailure]:
        """The versions that did not commit here, oldest first (the receiver's)."""
        return self.receiver.failures

    @property
    def swap_stats(self) -> SwapStats:
        """How long versions took to go live here (the receiver's)."""
        return self.receiver.swap_stats

    @property
    def endpoint(self) -> str:
        """Where this engine's receiver is bound (the server streams versions to it)."""
        return self.receiver.endpoint

    @property
    def ready(self) -> bool:
        """Whether a first version has committed (an engine is not ready before)."""
        return self.receiver.current_version is not None

    @asynccontextmanager
    async def serving(self, timeout: float | None = None) -> AsyncIterator[int | None]:
        """The receiver's read lease: pins the weights for one request, yields their version."""
        async with self.receiver.serving(timeout) as version:
            yield version

    async def __aenter__(self) -> Subscriber:
        stack = AsyncExitStack()
        try:
            await stack.enter_async_context(self.receiver)
            await stack.enter_async_context(self.client)
            await self._subscribe()
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def _subscribe(self) -> None:
        """Subscribe, proving this engine owns its receiver: the server's challenge to it."""
        reply = await self.client.ask(await self._subscription())
        if isinstance(reply, m.Prove):
            challenges, wait = self.receiver.challenges, self.client.timeout
            token = await challenges.wait(reply.ref, wait, endpoint=self.receiver.endpoint)
            await self.client.request(m.Proof(token))

    async def _subscription(self) -> m.Subscribe:
        key = self._receiver_auth.public_key if self._receiver_auth else None
        held = self.held
        return m.Subscribe(
            self.name,
            self.receiver.endpoint,
            self.max_lag,
            self._follow,
            key=None if key is None else key.decode("ascii"),
            resume=held is not None,
            held=[] if held is None else await anyio.to_thread.run_sync(held.digests),
            held_version=None if held is None else held.version,
        )

    async def subscribed(self) -> bool:
        """Whether the server counts this (named) engine now; False: it was dropped."""
        status = await self.client.status()
        return any(engine.name == self.name for engine in status.engines)

    async def resubscribe(self, timeout: float) -> None:
        """Subscribe again, on a new control channel, saying which buckets are held.

        For an engine the server dropped (a transfer to it broke): the server then sends
        the version again without the buckets this engine kept. While the server still
        counts the old subscription (it has not noticed yet) it refuses; this retries
        until ``timeout`` and then raises the last refusal.
        """
        refusal: AiosyncError = SyncTimeoutError(f"not subscribed again within {timeout:g}s")
        with anyio.move_on_after(timeout):
            while True:
                await self.client.reconnect()
                try:
                    await self._subscribe()
                    return
                except RejectedError as exc:
                    refusal = exc
                await anyio.sleep(0.05)
        raise refusal

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await exit_as_one(stack.__aexit__(exc_type, exc, tb), exc)

    async def wait_for_version(self, version: int, timeout: float) -> int:
        """Wait until this engine holds ``version`` or newer."""
        return await self.receiver.wait_for_version(version, timeout)

    async def wait_for_newer(self, timeout: float) -> int:
        """Wait for a version newer than the one held (the first one when none is)."""
        current = self.current_version
        return await self.wait_for_version(0 if current is None else current + 1, timeout)

    async def fetch(self, version: int, timeout: float) -> int:
        """Take the retained ``version`` and stay on it (an older one needs ``allow_rebase``)."""
        await self.client.request(m.Fetch(version))
        with anyio.move_on_after(timeout):
            while self.current_version != version:
                await self._committed.wait()
            return version
        raise SyncTimeoutError(f"version {version} not received within {timeout:g}s")

    async def follow(self) -> None:
        """Follow the newest version again (after :meth:`fetch`)."""
        await self.client.request(m.Follow())
