"""The fleet of engines a :class:`~aiosync.trainer.sender.WeightSender` streams to.

Engines join (a handshake) and leave (a goodbye) between versions; a session over a REQ
socket is kept alive with pings; an engine whose session broke leaves the fleet and is kept
in ``lost_engines``.
"""

from __future__ import annotations

import logging
import os
import uuid

import anyio
import anyio.abc

from aiosync.channels.base import Channel
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, UsageError
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import Ping, encode
from aiosync.pipeline.links import EngineLink
from aiosync.planes import SenderPlane
from aiosync.trainer.config import SenderConfig

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 1.0  # seconds a closing sender waits for each goodbye to be acknowledged

Target = str | Channel
"""An engine to reach: an endpoint to connect to (``ipc://`` or ``tcp://``) or a channel."""


class EngineFleet:
    """The engines a sender reaches, by name; :class:`WeightSender` fills in its state."""

    config: SenderConfig
    lost_engines: dict[str, AiosyncError]
    _auth: ChannelAuth | None
    _links: dict[str, EngineLink]
    _owned: dict[str, Channel]
    _keepalives: dict[str, anyio.CancelScope]
    _plane: SenderPlane | None
    _tasks: anyio.abc.TaskGroup | None
    _sending: bool

    @property
    def engines(self) -> list[str]:
        """The engines of the fleet now, by name."""
        return list(self._links)

    @property
    def remote_versions(self) -> dict[str, int | None]:
        """Each engine's current version as last confirmed to this sender."""
        return {name: link.session.remote_version for name, link in self._links.items()}

    @property
    def remote_version(self) -> int | None:
        """The oldest version any engine holds (None if one holds none)."""
        versions = list(self.remote_versions.values())
        if not versions or any(v is None for v in versions):
            return None
        return min(v for v in versions if v is not None)

    @property
    def peer(self) -> str:
        """The engines' names, for messages."""
        return ", ".join(self._links) or "no engine"

    async def _say_goodbyes(self) -> None:
        with anyio.CancelScope(shield=True):
            for name in list(self._links):
                await self.remove_engine(name)

    async def add_engine(self, target: Target) -> str:
        """Open a session with one more engine (between versions); returns its name."""
        if self._plane is None or self._tasks is None:
            raise UsageError("sender is not open; use 'async with WeightSender(...)'")
        if self._sending:
            raise UsageError("engines may be added only between versions")
        if isinstance(target, str):
            from aiosync.channels.zmq import ZmqChannel

            channel: Channel = ZmqChannel.connect(target, auth=self._auth)
            owned = True
        else:
            channel, owned = target, False
        name = channel.peer
        if name in self._links:
            name = f"{name}#{len(self._links)}"
        link = EngineLink(channel, LinkSession(name, uuid.uuid4().hex), self.config.timeout)
        spec, link.counter_word = self._plane.spec_for_link()  # a counter word each (CUDA)
        hello = link.session.hello(self.config.name or f"pid-{os.getpid()}", spec)
        try:
            ready = await link.handshake(hello)
        except BaseException:
            if owned:
                await channel.aclose()
            raise
        self._links[name] = link
        if owned:
            self._owned[name] = channel
        if channel.window is None:  # a REQ socket must not send unasked
            scope = anyio.CancelScope()
            self._keepalives[name] = scope
            self._tasks.start_soon(self._keep_alive, link, scope)
        log.info("session open with %s (engine at version %s)", name, ready.version)
        return name

    async def remove_engine(self, name: str) -> None:
        """Say goodbye to one engine and close its channel (between versions)."""
        if self._sending:
            raise UsageError("engines may be removed only between versions")
        link = self._links.pop(name, None)
        if link is None:
            raise UsageError(f"no engine {name!r} in this sender's fleet")
        scope = self._keepalives.pop(name, None)
        if scope is not None:
            scope.cancel()
        if link.broken is None:
            with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                try:
                    await link.goodbye()
                except AiosyncError as exc:
                    log.info("goodbye to %s failed: %s", name, exc)
        channel = self._owned.pop(name, None)
        if channel is not None:
            await channel.aclose()

    async def _keep_alive(self, link: EngineLink, scope: anyio.CancelScope) -> None:
        """Tell the engine, every ``keepalive`` seconds, that this session is alive."""
        ping = encode(Ping(session=link.session.session))
        with scope:
            while link.broken is None:
                await anyio.sleep(self.config.keepalive)
                with anyio.move_on_after(self.config.timeout):
                    try:
                        await link.channel.send(ping)
                    except AiosyncError as exc:  # never let a keepalive take the session down
                        log.warning("keepalive to %s failed: %s", link.name, exc)
                        return

    async def _drop_broken(self) -> None:
        """Engines whose session broke leave the fleet; they are kept in ``lost_engines``."""
        for name, link in list(self._links.items()):
            if link.broken is not None:
                log.warning("engine %s leaves the fleet: %s", name, link.broken)
                self.lost_engines[name] = link.broken
                with anyio.CancelScope(shield=True):
                    await self.remove_engine(name)
