"""Shared pieces of the channel tests: a listener served in the background, bounded receives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from aiosync.channels.base import Channel
from aiosync.channels.zmq import RouterPeer, ZmqListener

GUARD = 30  # seconds: a hang guard only, never a measured bound


class Served:
    """A bound listener whose accept loop runs in the background (it delivers every
    known peer's messages too); new peers come out of :meth:`next_peer`."""

    def __init__(self, listener: ZmqListener) -> None:
        self.listener = listener
        self.endpoint = listener.endpoint
        self._tx, self._rx = anyio.create_memory_object_stream[RouterPeer](64)

    async def accept_forever(self) -> None:
        while True:
            self._tx.send_nowait(await self.listener.accept())

    async def next_peer(self) -> RouterPeer:
        with anyio.fail_after(GUARD):
            return await self._rx.receive()

    def pending(self) -> int:
        """New peers accepted and not yet taken."""
        return self._rx.statistics().current_buffer_used


@asynccontextmanager
async def serving(listener: ZmqListener) -> AsyncIterator[Served]:
    """``listener`` served in the background, closed on exit."""
    served = Served(listener)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(served.accept_forever)
            yield served
            tg.cancel_scope.cancel()
    finally:
        await listener.aclose()


async def recv(channel: Channel) -> bytes:
    """The next message on ``channel``, within the hang guard."""
    with anyio.fail_after(GUARD):
        return await channel.recv()
