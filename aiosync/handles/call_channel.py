"""A control channel to an engine that speaks SGLang's calls, for the native send loop.

The broadcast path's trainer side runs :class:`~aiosync.pipeline.stream.StreamRun` like any
sender; its links reach the engines through a :class:`CallChannel`, which turns each bucket
message into the engine's ``update_weights_from_distributed`` call (the bucket's names,
dtypes and shapes) and that call's answer into the bucket's ack. SGLang's engine has no
begin, complete or commit call (it makes a version live by itself once it holds all of
it): those are acknowledged here, and an abort is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio

from aiosync.core.errors import ProtocolError
from aiosync.core.wire import Abort, Ack, Begin, Bucket, Commit, Complete, Message, decode, encode
from aiosync.handles.base import EngineHandle


@dataclass(frozen=True)
class BucketCalls:
    """What every bucket call of one version passes besides the bucket's own metadata."""

    group_name: str
    load_format: str | None
    weight_version: str | None


class CallChannel:
    """A :class:`~aiosync.channels.base.Channel` to ``handle`` (see the module).

    :meth:`send` returns once the engine answered (its link sends one message at a time);
    ``calling`` says whether a bucket's call is awaiting that answer.
    """

    window: int | None = None
    key: bytes | None = None

    def __init__(self, handle: EngineHandle, calls: BucketCalls) -> None:
        self._handle = handle
        self._calls = calls
        self.lost = anyio.Event()
        self.calling = False
        self._acks, self._answered = anyio.create_memory_object_stream[Ack](math.inf)

    @property
    def peer(self) -> str:
        """The engine's name."""
        return self._handle.name

    async def send(self, payload: bytes) -> None:
        """Carry out one message of the stream; its answer comes from :meth:`recv`.

        Raises what reaching the engine raised (a lost engine, a call timed out).
        """
        message = decode(payload)
        if not isinstance(message, Abort):
            self._acks.send_nowait(await self._answer(message))

    async def recv(self) -> bytes:
        """The next answer, an encoded ack."""
        return encode(await self._answered.receive())

    async def aclose(self) -> None:
        """Drop answers not yet read (idempotent)."""
        self._acks.close()
        self._answered.close()

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
