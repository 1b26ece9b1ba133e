"""The control-channel interface: small messages between a sender and one engine.

A :class:`Channel` carries encoded messages to and from exactly one peer. A
:class:`Listener` hands out a channel for each peer that reaches a bound address. Either
role may bind or connect: an engine usually listens and trainers connect, and a server that
engines reach turns it around. Tensor bytes never travel here; data planes carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import anyio


class Channel(Protocol):
    """A message pipe to one peer."""

    @property
    def peer(self) -> str:
        """A name for the peer, unique among this process's channels, for messages."""

    @property
    def window(self) -> int | None:
        """How many messages may await a reply at once (1 for REQ sockets), None: no limit."""

    @property
    def lost(self) -> anyio.Event:
        """Set once the peer is known to be gone (its process died or it disconnected)."""

    @property
    def key(self) -> bytes | None:
        """The CURVE public key (Z85) the peer authenticated with; None without CURVE."""

    async def send(self, payload: bytes) -> None:
        """Send one message; :class:`~aiosync.core.errors.PeerGoneError` if the peer left."""

    async def recv(self) -> bytes:
        """The next message from the peer."""

    async def aclose(self) -> None:
        """Close this end (idempotent); pending messages are dropped."""


class Delivery(Protocol):
    """What a zero-copy send returns: whether the transport is done with the parts' memory."""

    @property
    def done(self) -> bool:
        """True once the transport no longer reads the memory the parts were sent from."""


class PartsChannel(Channel, Protocol):
    """A channel that also carries messages of several parts (frames), none of them copied.

    A relay's chunk is such a message: a small header, then bucket bytes sent straight from
    the retained segment and received as a view of the transport's own buffer.
    """

    async def send_parts(self, parts: Sequence[bytes | memoryview]) -> Delivery:
        """Send one message of ``parts`` without copying them.

        The parts are referenced, not copied, until the returned :class:`Delivery` is
        ``done`` (their memory stays alive that long): what changes in them before then may
        be what is sent.
        """

    async def recv_parts(self) -> list[memoryview]:
        """The next message's parts, as views of the transport's buffers (no copy)."""


class Listener(Protocol):
    """A bound address that yields a :class:`Channel` per peer."""

    @property
    def endpoint(self) -> str:
        """The address peers connect to."""

    async def accept(self) -> Channel:
        """The channel of the next new peer."""

    @property
    def queued_bytes(self) -> int:
        """Bytes of its peers' messages held here, not yet served."""

    async def aclose(self) -> None:
        """Stop listening and close every channel handed out (idempotent)."""
