"""A handle's channels to one engine, one per event loop, so any loop may drive the handle.

A channel's sockets belong to the event loop that drives them: a ZMQ socket watched by two
running loops would be read from two threads. The blocking compat functions drive handles
on their own background loop, and the user's code may then await the same handle from its
own ``asyncio.run``. So a handle keeps one :class:`Link` (a channel, and the lock that keeps
one call in flight on it) per event loop. A handle that can open channels (``reopen``, as
:meth:`~aiosync.handles.ChannelHandle.connect` gives it) opens one for each new loop; one
made on a given channel keeps that channel, which moves to a new loop once the old loop is
closed. A link whose loop was closed is closed when the handle is next used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import UsageError

log = logging.getLogger(__name__)

CLOSE_WAIT = 5.0
"""Seconds :meth:`Links.aclose` waits for a link's close on another loop that still runs."""


@dataclass
class Link:
    """One channel to the engine, driven from ``loop`` (None: not used yet)."""

    channel: Channel
    loop: asyncio.AbstractEventLoop | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)


def _running_loop(name: str) -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise UsageError("engine handles need a running asyncio event loop", peer=name) from None


async def _close(link: Link, name: str) -> None:
    try:
        await link.channel.aclose()
    except Exception as exc:  # a link left behind by a closed loop: nobody to tell
        log.debug("%s: closing a channel of a closed event loop: %r", name, exc)


class Links:
    """The channels of one handle, by event loop; thread-safe, as loops run in threads."""

    def __init__(
        self, channel: Channel, *, name: str, reopen: Callable[[], Channel] | None = None
    ) -> None:
        self._name = name
        self._reopen = reopen
        self._links = [Link(channel)]
        self._closed = False
        self._guard = threading.Lock()

    async def current(self) -> Link:
        """The running loop's link: found, claimed, or opened; UsageError if none can be."""
        loop = _running_loop(self._name)
        with self._guard:
            if self._closed:
                raise UsageError("the engine handle is closed", peer=self._name)
            for link in self._links:
                if link.loop is loop:
                    return link
            stale = [link for link in self._links if link.loop and link.loop.is_closed()]
            chosen = next((link for link in self._links if link.loop is None), None)
            if chosen is None and self._reopen is None and stale:
                chosen = stale.pop()  # the one channel this handle has: it moves here
            if chosen is None and self._reopen is None:
                raise UsageError(
                    "the handle's channel is in use on another event loop that has not been "
                    "closed; a handle made by ChannelHandle.connect opens one for each loop",
                    peer=self._name,
                )
            if chosen is None:
                assert self._reopen is not None
                chosen = Link(self._reopen())
                self._links.append(chosen)
            chosen.loop = loop
            chosen.lock = anyio.Lock()
            self._links = [link for link in self._links if link not in stale]
        for link in stale:
            await _close(link, self._name)
        return chosen

    async def aclose(self) -> None:
        """Close every link: on its own loop while that runs elsewhere, here otherwise."""
        here = _running_loop(self._name)
        with self._guard:
            if self._closed:
                return
            self._closed = True
            links, self._links = self._links, []
        for link in links:
            loop = link.loop
            if loop is None or loop is here or not loop.is_running():
                await link.channel.aclose()
            else:
                await self._close_on(loop, link)

    async def _close_on(self, loop: asyncio.AbstractEventLoop, link: Link) -> None:
        """Close ``link`` on ``loop``, which runs in another thread; wait at most CLOSE_WAIT."""
        closing = link.channel.aclose()
        try:
            future = asyncio.run_coroutine_threadsafe(closing, loop)
        except RuntimeError:  # that loop closed meanwhile: nothing watches the channel now
            closing.close()
            await link.channel.aclose()
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_WAIT) as scope:
            try:
                await asyncio.wrap_future(future)
            except Exception as exc:
                log.warning("%s: closing its channel on another loop: %r", self._name, exc)
        if scope.cancelled_caught:  # the finalizer closes it once the handle is dropped
            log.warning("%s: no close on another loop within %gs", self._name, CLOSE_WAIT)
