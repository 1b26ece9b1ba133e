"""One peer of a ZMQ ROUTER listener: :class:`RouterPeer`, its queue and its byte bound.

The listener (:class:`~aiosync.channels.zmq_listener.ZmqListener`) delivers each message a
peer sends into that peer's queue, at most ``PEER_QUEUE`` messages and ``max_bytes`` bytes
held (queued, or read and not yet served); beyond either bound the message is dropped, with
a throttled warning. Replies go back out through the listener's shared ROUTER.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import anyio

from aiosync.channels.base import Delivery
from aiosync.core.errors import PeerGoneError

log = logging.getLogger("aiosync.channels.zmq")  # the name it logged under before the split

PEER_QUEUE = 256
"""Messages buffered per peer of a listener; beyond that a peer's messages are dropped."""


class PeerOwner(Protocol):
    """What a :class:`RouterPeer` needs of its listener: a way out, and to be forgotten."""

    async def send_to(self, peer: RouterPeer, payload: bytes) -> None:
        """Send ``payload`` to ``peer`` without waiting."""

    async def send_parts_to(
        self, peer: RouterPeer, parts: Sequence[bytes | memoryview]
    ) -> Delivery:
        """Send one message of ``parts`` to ``peer`` without waiting or copying."""

    def forget(self, peer: RouterPeer) -> None:
        """Drop ``peer``'s channel (its next message starts a new one)."""


class Throttled:
    """A warning logged at most once per ``every`` seconds, with a count of those held back.

    Peers decide how often these happen; a flood of them must not flood the log.
    """

    def __init__(self, message: str, every: float = 10.0) -> None:
        self._message = message
        self._every = every
        self._next = 0.0
        self._held = 0

    def __call__(self, *args: object) -> None:
        """Log the warning with ``args``, unless one went out less than ``every`` ago."""
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            log.warning(self._message + " (and %d more since the last report)", *args, self._held)
        else:
            log.warning(self._message, *args)
        self._next = now + self._every
        self._held = 0


class RouterPeer:
    """One peer of a ZMQ listener: replies go out through the shared ROUTER."""

    def __init__(
        self,
        listener: PeerOwner,
        identity: bytes,
        *,
        delimited: bool,
        name: str,
        key: bytes | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self._listener = listener
        self.identity = identity  # the ZMQ routing id: for addressing only, never shown
        self.key = key  # the CURVE public key (Z85) it authenticated with; None: no CURVE
        self.envelope = (identity, b"") if delimited else (identity,)
        self._peer = name
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](PEER_QUEUE)
        self._lost = anyio.Event()
        self._dropped = False
        self._overflow = Throttled("%s sends faster than it is served; messages dropped")
        self._max_bytes = max_bytes
        self._held = 0  # bytes queued, and of the message last read until the next recv
        self._last = 0
        self.overflowed = 0  # messages dropped for a full queue

    @property
    def queued_bytes(self) -> int:
        """Bytes held for this peer: queued, and the message last read until the next recv.

        A reader that hands each message on before it reads the next (as a receiver does)
        is so held to ``max_bytes`` for everything of this peer's it has not served.
        """
        return self._held

    @property
    def peer(self) -> str:
        """``peer-<n>``, numbered by the listener (unique in this process)."""
        return self._peer

    @property
    def window(self) -> int | None:
        """No limit."""
        return None

    @property
    def lost(self) -> anyio.Event:
        """Set when a reply finds the peer gone, or the peer was dropped for not reading."""
        return self._lost

    def deliver(self, payload: bytes) -> None:
        """Queue a message from the peer; dropped (and logged) when the queue is full.

        Full: ``PEER_QUEUE`` messages, or ``max_bytes`` held with this one.
        """
        try:
            if self._max_bytes is not None and self._held + len(payload) > self._max_bytes:
                raise anyio.WouldBlock
            self._tx.send_nowait(payload)
        except anyio.WouldBlock:
            self.overflowed += 1
            self._overflow(self._peer)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        else:
            self._held += len(payload)

    def end(self, *, dropped: bool) -> None:
        """Mark the peer lost; ``dropped``: also discard what it sent and is not yet read."""
        self._dropped = self._dropped or dropped
        self._lost.set()
        self._tx.close()  # a pending recv wakes up

    async def send(self, payload: bytes) -> None:
        """Reply without waiting; :class:`PeerGoneError` if the peer left or was dropped."""
        if self._lost.is_set():
            raise PeerGoneError("peer is gone", peer=self._peer)
        await self._listener.send_to(self, payload)

    async def send_parts(self, parts: Sequence[bytes | memoryview]) -> Delivery:
        """Reply with one message of several parts, not copied (see :meth:`send`)."""
        if self._lost.is_set():
            raise PeerGoneError("peer is gone", peer=self._peer)
        return await self._listener.send_parts_to(self, parts)

    async def recv_parts(self) -> list[memoryview]:
        """The next message, as one part (a listener delivers single-part messages only)."""
        return [memoryview(await self.recv())]

    async def recv(self) -> bytes:
        """The next message the listener's accept loop delivered."""
        if self._dropped:
            raise PeerGoneError("peer was dropped", peer=self._peer)
        self._held -= self._last  # the reader is done with the last one
        self._last = 0
        try:
            payload = await self._rx.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise PeerGoneError("peer channel closed", peer=self._peer) from None
        self._last = len(payload)
        return payload

    async def aclose(self) -> None:
        """Forget the peer; a later message from the same identity makes a new channel."""
        self._listener.forget(self)
        self._tx.close()
        self._rx.close()
        self._held = self._last = 0
