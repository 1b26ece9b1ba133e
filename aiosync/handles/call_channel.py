"""A control channel to an engine that speaks SGLang's calls, for the native send loop.

The trainer side of the broadcast path runs :class:`~aiosync.pipeline.stream.StreamRun`
like every other sender; its links reach the engines through a :class:`CallChannel`,
which translates the stream's messages into an :class:`~aiosync.handles.EngineHandle`'s
calls: each bucket becomes the engine's ``update_weights_from_distributed`` (the bucket's
names, dtypes and shapes) and that call's answer the bucket's ack. SGLang's engine has no
begin, complete or commit call (it makes a version live by itself once it holds all of
it), so those are acknowledged here, and an abort is dropped. Messages are answered one
at a time and in order, as an engine answers them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from aiosync.core.errors import AiosyncError, PeerGoneError, ProtocolError
from aiosync.core.wire import Abort, Ack, Begin, Bucket, Commit, Complete, Message, decode, encode
from aiosync.handles.base import EngineHandle

QUEUED = 64
"""Messages (and answers) a channel holds at most; the stream keeps a few in flight."""


@dataclass(frozen=True)
class BucketCalls:
    """What every bucket call of one version passes besides the bucket's own metadata."""

    group_name: str
    load_format: str | None
    weight_version: str | None


class CallChannel:
    """A :class:`~aiosync.channels.base.Channel` to ``handle``, whose calls run in ``tasks``.

    ``on_failure`` is called once a call is refused or the engine cannot be reached.
    ``calling`` says whether a bucket's call is awaiting the engine's answer.
    """

    window: int | None = None
    key: bytes | None = None

    def __init__(
        self,
        handle: EngineHandle,
        calls: BucketCalls,
        tasks: anyio.abc.TaskGroup,
        on_failure: Callable[[], None],
    ) -> None:
        self._handle = handle
        self._calls = calls
        self._on_failure = on_failure
        self.lost = anyio.Event()
        self.calling = False
        self._inbox, inbox = anyio.create_memory_object_stream[Message](QUEUED)
        self._answers, self._out = anyio.create_memory_object_stream[Ack | AiosyncError](QUEUED)
        tasks.start_soon(self._serve, inbox)

    @property
    def peer(self) -> str:
        """The engine's name."""
        return self._handle.name

    async def send(self, payload: bytes) -> None:
        """Take one message of the stream; its answer comes from :meth:`recv`.

        An abort is dropped at once (SGLang has no call for it, and nothing answers it).
        """
        message = decode(payload)
        if isinstance(message, Abort):
            return
        try:
            await self._inbox.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise PeerGoneError("the engine's calls have ended", peer=self.peer) from None

    async def recv(self) -> bytes:
        """The next answer (an encoded ack); raises what reaching the engine raised."""
        answer = await self._out.receive()
        if isinstance(answer, AiosyncError):
            raise answer
        return encode(answer)

    async def aclose(self) -> None:
        """Stop taking messages (idempotent)."""
        await self._inbox.aclose()
        await self._out.aclose()

    async def _serve(self, inbox: MemoryObjectReceiveStream[Message]) -> None:
        async with inbox, self._answers:
            async for message in inbox:
                try:
                    answer = await self._answer(message)
                except AiosyncError as exc:
                    self.lost.set()
                    self._on_failure()
                    await self._answers.send(exc)
                    return
                if not answer.ok:
                    self._on_failure()
                await self._answers.send(answer)

    async def _answer(self, message: Message) -> Ack:
        if isinstance(message, Bucket):
            specs = message.specs
            self.calling = True
            result = await self._handle.update_weights_from_distributed(
                [spec.name for spec in specs],
                [spec.dtype for spec in specs],
                [list(spec.shape) for spec in specs],
                group_name=self._calls.group_name,
                load_format=self._calls.load_format,
                weight_version=self._calls.weight_version,
            )
            self.calling = False
            error = None if result.success else result.message or "failed without a message"
            return Ack(message.version, message.seq, result.success, error=error)
        if isinstance(message, Begin):
            return Ack(message.version, 0, True)
        if isinstance(message, Complete | Commit):
            return Ack(message.version, message.seq, True)
        raise ProtocolError(f"no SGLang call for a {type(message).__name__}", peer=self.peer)
