"""One engine as the pipeline drives it: a channel, its pure session, and bounded waits.

Every wait here has the link's timeout; every reply is decoded and matched by the
:class:`~aiosync.core.trainer_session.LinkSession`, so acks of a stream that already failed
are skipped and anything out of order is a :class:`ProtocolError` naming the engine.
"""

from __future__ import annotations

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import (
    AiosyncError,
    BusyError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import Abort, Ack, Hello, Message, Ready, decode, encode


class EngineLink:
    """The sender's connection to one engine for the life of a session."""

    def __init__(self, channel: Channel, session: LinkSession, timeout: float) -> None:
        self.channel = channel
        self.session = session
        self.timeout = timeout
        self.window = anyio.Semaphore(channel.window) if channel.window else None
        self.broken: AiosyncError | None = None  # set once the session cannot be trusted
        self.events: list[bytes] = []  # the engine's CUDA IPC events, from its ready
        self.counter_word: int | None = None  # its word of the CUDA plane's counters

    @property
    def name(self) -> str:
        """The engine's name in messages and reports."""
        return self.session.peer

    def timeout_error(
        self, what: str, version: int | None, tensor: str | None = None
    ) -> SyncTimeoutError:
        """The error for a wait on this engine that ran out of time."""
        return SyncTimeoutError(
            f"no {what} within {self.timeout:g}s (is the engine alive?)",
            peer=self.name,
            version=version,
            tensor=tensor,
        )

    async def send(
        self, payload: bytes, what: str, version: int | None, tensor: str | None = None
    ) -> None:
        """Send one message, waiting at most the timeout for room on the channel."""
        with anyio.move_on_after(self.timeout):
            await self.channel.send(payload)
            return
        raise self.timeout_error(f"room to send {what}", version, tensor)

    async def _recv(self) -> Message:
        message = decode(await self.channel.recv())
        if isinstance(message, Abort):  # the engine has ended this session
            raise PeerGoneError(f"engine ended the session: {message.reason}", peer=self.name)
        return message

    async def recv_ack(self, what: str, version: int | None, tensor: str | None = None) -> Ack:
        """The next ack of the open stream; leftovers of failed streams are skipped."""
        with anyio.move_on_after(self.timeout):
            while True:
                message = await self._recv()
                if not isinstance(message, Ack):
                    raise ProtocolError(
                        f"expected an ack, got {type(message).__name__}",
                        peer=self.name,
                        version=version,
                    )
                ack = self.session.ack(message)
                if ack is not None:
                    return ack
        raise self.timeout_error(what, version, tensor)

    def refusal(self, ack: Ack, what: str) -> RejectedError:
        """The error for a refused message, with the engine's own reason and tensor."""
        kind = BusyError if ack.busy else RejectedError
        return kind(
            ack.error or f"{what} refused", peer=self.name, version=ack.version, tensor=ack.tensor
        )

    async def handshake(self, hello: Hello) -> Ready:
        """Send the hello and return the engine's ready (the session is then usable)."""
        await self.send(encode(hello), "the hello", None)
        with anyio.move_on_after(self.timeout):
            reply = await self._recv()
            if not isinstance(reply, Ready):
                raise ProtocolError(f"expected ready, got {type(reply).__name__}", peer=self.name)
            self.session.ready(reply)
            self.events = reply.events
            return reply
        raise PeerGoneError(f"no reply to hello within {self.timeout:g}s", peer=self.name)

    async def request(self, payload: bytes, seq: int, what: str, version: int) -> None:
        """Send one stream message and wait for its positive ack; raise the refusal."""
        if self.window is not None:
            await self.window.acquire()
        try:
            await self.send(payload, what, version)
            self.session.sent(seq)
            ack = await self.recv_ack(f"ack for {what}", version)
        finally:
            if self.window is not None:
                self.window.release()
        if not ack.ok:
            raise self.refusal(ack, what)
