"""One engine as the pipeline drives it: a channel, its pure session, and bounded waits.

Every wait here has the link's timeout; every reply is decoded and matched by the
:class:`~aiosync.core.trainer_session.LinkSession`, so acks of a stream that already failed
are skipped and anything out of order is a :class:`ProtocolError` naming the engine. Once a
commit went out, the link waits at least its timeout from then for every answer still due
(the engine refuses that commit past its deadline, a little earlier: see
:meth:`EngineLink.commit_deadline`), so the engine never decides after the sender gave up.
"""

from __future__ import annotations

import logging
import time

import anyio
import msgspec

from aiosync.channels.base import Channel
from aiosync.core.errors import (
    AiosyncError,
    BusyError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.core.hello import uncovered
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    GOODBYE_SEQ,
    Abort,
    Ack,
    Goodbye,
    Hello,
    Message,
    Ready,
    decode,
    encode,
)

log = logging.getLogger(__name__)

COMMIT_GRACE = 1.0
"""Seconds (at most a quarter of the timeout) between a commit's deadline and the end of
the sender's wait for its answer: room for the engine's swap and ack to arrive, and for
the engines' clock to lag the sender's."""


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
        self._held_until: float | None = None  # (loop clock) waits last this long at least

    @property
    def name(self) -> str:
        """The engine's name in messages and reports."""
        return self.session.peer

    def timeout_error(
        self,
        what: str,
        version: int | None,
        tensor: str | None = None,
        waited: float | None = None,
    ) -> SyncTimeoutError:
        """The error for a wait on this engine that ran out (``waited``: if not the timeout)."""
        seconds = self.timeout if waited is None else round(waited, 2)
        return SyncTimeoutError(
            f"no {what} within {seconds:g}s (is the engine alive?)",
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

    def commit_deadline(self) -> float:
        """The deadline (``time.time()``) of a commit about to be sent on this link.

        From now on, while the commit is unanswered, every wait for an ack on this link
        lasts until at least one timeout from now; the deadline is a grace earlier, so an
        engine that takes the commit in time has that grace to make it live and answer.
        """
        self._held_until = anyio.current_time() + self.timeout
        grace = min(COMMIT_GRACE, self.timeout / 4)
        return time.time() + self.timeout - grace

    def _wait(self) -> float:
        """How long the next wait for an ack lasts: the timeout, or to a commit's hold."""
        held = self._held_until
        if held is None or not self.session.commit_pending:
            return self.timeout
        return max(self.timeout, held - anyio.current_time())

    async def recv_ack(self, what: str, version: int | None, tensor: str | None = None) -> Ack:
        """The next ack of the open stream; leftovers of failed streams are skipped."""
        wait = self._wait()
        with anyio.move_on_after(wait):
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
        raise self.timeout_error(what, version, tensor, None if wait == self.timeout else wait)

    def refusal(self, ack: Ack, what: str) -> RejectedError:
        """The error for a refused message, with the engine's own reason and tensor."""
        kind = BusyError if ack.busy else RejectedError
        return kind(
            ack.error or f"{what} refused", peer=self.name, version=ack.version, tensor=ack.tensor
        )

    async def handshake(self, hello: Hello) -> Ready:
        """Send the hello and return the engine's ready (the session is then usable).

        An engine whose commits may wait for read leases as long as this link's timeout or
        longer is warned of (naming both values): it waits only to the commit's deadline,
        and a version still held back by leases then is refused, not made live later.
        """
        if hello.timeout is None:  # the engine learns how long this side waits
            hello = msgspec.structs.replace(hello, timeout=self.timeout)
        await self.send(encode(hello), "the hello", None)
        reply: Message | None = None
        with anyio.move_on_after(self.timeout):
            reply = await self._recv()
        if reply is None:
            raise PeerGoneError(f"no reply to hello within {self.timeout:g}s", peer=self.name)
        if not isinstance(reply, Ready):
            raise ProtocolError(f"expected ready, got {type(reply).__name__}", peer=self.name)
        self.session.ready(reply)
        self.events = reply.events
        problem = uncovered(self.timeout, reply)
        if problem is not None:
            log.warning("engine %s: %s", self.name, problem)
        return reply

    async def goodbye(self) -> None:
        """End the session and wait for its ack, skipping acks of abandoned streams.

        Unbounded: the caller bounds it (a goodbye missed ends at the engine's timeout).
        """
        await self.channel.send(encode(Goodbye(session=self.session.session)))
        while True:
            reply = decode(await self.channel.recv())
            if isinstance(reply, Ack) and reply.seq == GOODBYE_SEQ:
                return

    async def request(
        self, payload: bytes, seq: int, what: str, version: int, *, commit: bool = False
    ) -> None:
        """Send one stream message and wait for its positive ack; raise the refusal.

        ``commit``: the message is the stream's commit (:meth:`commit_deadline` made it).
        """
        if self.window is not None:
            await self.window.acquire()
        try:
            await self.send(payload, what, version)
            if commit:
                self.session.sent_commit(seq)
            else:
                self.session.sent(seq)
            ack = await self.recv_ack(f"ack for {what}", version)
        finally:
            if self.window is not None:
                self.window.release()
        if not ack.ok:
            raise self.refusal(ack, what)
