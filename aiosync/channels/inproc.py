"""In-process channels over anyio memory streams: the same interface, no sockets.

Tests drive whole senders and engines through these, and an engine embedded in the
trainer's own process can use them too.
"""

from __future__ import annotations

import itertools

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from aiosync.core.errors import PeerGoneError

QUEUE = 1024  # messages buffered each way
_ids = itertools.count()


class InprocChannel:
    """One end of an in-process pair."""

    def __init__(
        self,
        peer: str,
        outbox: ObjectSendStream[bytes],
        inbox: ObjectReceiveStream[bytes],
        window: int | None = None,
    ) -> None:
        self._peer = peer
        self._outbox = outbox
        self._inbox = inbox
        self._window = window
        self._lost = anyio.Event()
        self.other: InprocChannel | None = None

    @property
    def peer(self) -> str:
        """The other end's name."""
        return self._peer

    @property
    def key(self) -> bytes | None:
        """None: no CURVE in one process."""
        return None

    @property
    def window(self) -> int | None:
        """No limit unless made with one."""
        return self._window

    @property
    def lost(self) -> anyio.Event:
        """Set when the other end closes."""
        return self._lost

    async def send(self, payload: bytes) -> None:
        """Queue one message for the other end."""
        try:
            await self._outbox.send(payload)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise PeerGoneError("in-process peer closed", peer=self._peer) from None

    async def recv(self) -> bytes:
        """The next message from the other end."""
        try:
            return await self._inbox.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise PeerGoneError("in-process peer closed", peer=self._peer) from None

    async def aclose(self) -> None:
        """Close both directions; the other end sees its peer lost."""
        await self._outbox.aclose()
        await self._inbox.aclose()
        if self.other is not None:
            self.other._lost.set()


def inproc_pair(
    name: str = "inproc", window: int | None = None
) -> tuple[InprocChannel, InprocChannel]:
    """Two connected channels: (the connecting side's, the listening side's)."""
    n = next(_ids)
    a_tx, b_rx = anyio.create_memory_object_stream[bytes](QUEUE)
    b_tx, a_rx = anyio.create_memory_object_stream[bytes](QUEUE)
    a = InprocChannel(f"{name}-listener-{n}", a_tx, a_rx, window)
    b = InprocChannel(f"{name}-{n}", b_tx, b_rx)
    a.other, b.other = b, a
    return a, b


class InprocListener:
    """A listener that in-process peers reach through :meth:`connect`."""

    def __init__(self, name: str = "inproc") -> None:
        self._name = name
        self._tx, self._rx = anyio.create_memory_object_stream[InprocChannel](QUEUE)
        self._handed: list[InprocChannel] = []

    @property
    def endpoint(self) -> str:
        """A name for messages (nothing is bound)."""
        return f"inproc://{self._name}"

    def connect(self, window: int | None = None) -> InprocChannel:
        """A new peer's end; the listener's end is handed out by :meth:`accept`."""
        mine, theirs = inproc_pair(self._name, window)
        self._tx.send_nowait(theirs)
        return mine

    @property
    def queued_bytes(self) -> int:
        """0: an in-process channel's queue is bounded by its window, not counted here."""
        return 0

    async def accept(self) -> InprocChannel:
        """The next connected peer's channel."""
        channel = await self._rx.receive()
        self._handed.append(channel)
        return channel

    async def aclose(self) -> None:
        """Close the listener and every channel it handed out."""
        for channel in self._handed:
            await channel.aclose()
        await self._tx.aclose()
        await self._rx.aclose()
