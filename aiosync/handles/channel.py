"""An engine process reached over aiosync's control channel (msgspec messages, no pickle).

:class:`ChannelHandle` (trainer side) sends one typed :class:`Request` at a time and waits
for the :class:`Reply` carrying its id; :func:`serve_engine` (engine side) answers every
peer of a :class:`~aiosync.channels.base.Listener` from a local
:class:`~aiosync.handles.EngineHandle`. Messages are msgpack, decoded into fixed structs:
a peer can send nothing that turns into code or objects. A lost connection (the engine
process died) is a :class:`~aiosync.core.errors.PeerGoneError` naming the engine, an engine
that does not answer within the handle's ``timeout`` a
:class:`~aiosync.core.errors.SyncTimeoutError` naming it. A handle may be awaited from any
event loop (:mod:`aiosync.handles.links`) and dropped without ``aclose()``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import anyio
import msgspec

from aiosync.channels.base import Channel, Listener
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    ProtocolError,
    SyncTimeoutError,
    UsageError,
)
from aiosync.handles.base import CALL_TIMEOUT, EngineHandle, HealthStatus, WeightSyncResult
from aiosync.handles.links import Links
from aiosync.handles.results import MAX_TEXT

log = logging.getLogger(__name__)


class InitGroupCall(msgspec.Struct, frozen=True, tag="init_group"):
    """``init_weights_update_group``'s arguments."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"
    token: str | None = None


class UpdateDistributedCall(msgspec.Struct, frozen=True, tag="update_distributed"):
    """``update_weights_from_distributed``'s arguments."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool = True
    load_format: str | None = None
    weight_version: str | None = None


class UpdateTensorCall(msgspec.Struct, frozen=True, tag="update_tensor"):
    """``update_weights_from_tensor``'s arguments; ``text``: the entries were str (UTF-8)."""

    entries: list[bytes]
    text: bool = False
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None


class DestroyGroupCall(msgspec.Struct, frozen=True, tag="destroy_group"):
    """``destroy_weights_update_group``'s argument."""

    group_name: str


class HealthCall(msgspec.Struct, frozen=True, tag="health"):
    """``check_health()``."""


Call = InitGroupCall | UpdateDistributedCall | UpdateTensorCall | DestroyGroupCall | HealthCall

_METHODS: dict[type[Call], str] = {
    InitGroupCall: "init_weights_update_group",
    UpdateDistributedCall: "update_weights_from_distributed",
    UpdateTensorCall: "update_weights_from_tensor",
    DestroyGroupCall: "destroy_weights_update_group",
    HealthCall: "check_health",
}


class Request(msgspec.Struct, frozen=True, tag="request"):
    """One call; ``id`` comes back in its :class:`Reply`."""

    id: int
    call: Call


class Reply(msgspec.Struct, frozen=True, tag="reply"):
    """The answer to the request of ``id`` (health answers fill ``weight_version``)."""

    id: int
    success: bool
    message: str = ""
    weight_version: str | None = None


_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


class ChannelHandle(EngineHandle):
    """An engine in another process, behind a :class:`Channel` it serves with :func:`serve_engine`.

    One call is in flight at a time per event loop (later ones wait their turn), and each
    waits at most ``timeout`` seconds (queueing included) for its answer: past that it is a
    :class:`~aiosync.core.errors.SyncTimeoutError` naming the engine, and the channel stays
    usable (a late answer is recognised by its id and dropped, as is the answer to a call
    that was cancelled). ``reopen``, when given, opens another channel to the same engine,
    for each further event loop the handle is awaited from; without it the handle keeps
    ``channel``, which may move to a new loop only once its first loop is closed.
    """

    def __init__(
        self,
        channel: Channel,
        *,
        name: str | None = None,
        timeout: float = CALL_TIMEOUT,
        reopen: Callable[[], Channel] | None = None,
    ) -> None:
        if not timeout > 0:
            raise UsageError(f"a handle's timeout must be positive, got {timeout!r}")
        self._name = name or channel.peer
        self._timeout = float(timeout)
        self._links = Links(channel, name=self._name, reopen=reopen)
        self._ids = itertools.count(1)

    @classmethod
    def connect(
        cls,
        endpoint: str,
        *,
        auth: ChannelAuth | None = None,
        name: str | None = None,
        timeout: float = CALL_TIMEOUT,
    ) -> ChannelHandle:
        """A handle on the engine served at ``endpoint`` (ZMQ; ``auth`` as for channels).

        Close it with ``await handle.aclose()`` (or ``async with``) from any loop; one
        dropped without closing closes its sockets itself. Each call waits at most
        ``timeout`` seconds.
        """
        from aiosync.channels.zmq import ZmqChannel

        def reopen() -> Channel:
            return ZmqChannel.connect(endpoint, auth=auth)

        return cls(reopen(), name=name or endpoint, timeout=timeout, reopen=reopen)

    @property
    def name(self) -> str:
        """The given name, or the channel's peer name."""
        return self._name

    @property
    def timeout(self) -> float:
        """Seconds each call waits for the engine's answer."""
        return self._timeout

    async def _roundtrip(self, call: Call) -> Reply:
        try:
            return await self._exchange(call)
        except PeerGoneError as exc:
            where = f" at {exc.peer}" if exc.peer and exc.peer != self._name else ""
            raise PeerGoneError(
                f"engine unreachable{where}: {exc.reason}", peer=self._name
            ) from exc

    async def _exchange(self, call: Call) -> Reply:
        with anyio.move_on_after(self._timeout):
            link = await self._links.current()
            async with link.lock:
                return await self._ask(link.channel, call)
        raise SyncTimeoutError(
            f"no answer to {_METHODS[type(call)]}() within {self._timeout:g}s "
            "(the engine may be stuck or its process stopped)",
            peer=self._name,
        )

    async def _ask(self, channel: Channel, call: Call) -> Reply:
        request_id = next(self._ids)
        await channel.send(_encoder.encode(Request(request_id, call)))
        while True:
            data = await channel.recv()
            try:
                reply = _replies.decode(data)
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"malformed reply: {exc}", peer=self._name) from None
            if reply.id == request_id:
                return reply
            log.debug("%s: dropping a stale reply (id %d)", self._name, reply.id)

    async def _update(self, call: Call) -> WeightSyncResult:
        reply = await self._roundtrip(call)
        return WeightSyncResult(success=reply.success, message=reply.message[:MAX_TEXT])

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        *,
        token: str | None = None,
    ) -> WeightSyncResult:
        """Ask the engine process to join the group."""
        return await self._update(
            InitGroupCall(
                master_address, master_port, rank_offset, world_size, group_name, backend, token
            )
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Send one bucket's metadata; answered once the engine applied the broadcasts."""
        call = UpdateDistributedCall(
            list(names),
            list(dtypes),
            [list(shape) for shape in shapes],
            group_name,
            flush_cache,
            load_format,
            weight_version,
        )
        return await self._update(call)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Pass the opaque entries on (all bytes, or all str sent as UTF-8)."""
        entries = list(serialized_named_tensors)
        text = bool(entries) and all(isinstance(entry, str) for entry in entries)
        if not text and not all(isinstance(entry, bytes) for entry in entries):
            raise UsageError("entries must be all bytes or all str", peer=self._name)
        raw = [entry.encode() if isinstance(entry, str) else entry for entry in entries]
        call = UpdateTensorCall(raw, text, load_format, flush_cache, weight_version)
        return await self._update(call)

    async def destroy_weights_update_group(self, group_name: str) -> WeightSyncResult:
        """Ask the engine process to leave the group."""
        return await self._update(DestroyGroupCall(group_name))

    async def check_health(self) -> HealthStatus:
        """The engine's own answer; unhealthy (never raising) when it cannot be reached."""
        try:
            reply = await self._roundtrip(HealthCall())
        except AiosyncError as exc:
            return HealthStatus(healthy=False, message=exc.reason)
        return HealthStatus(reply.success, reply.message[:MAX_TEXT], reply.weight_version)

    async def aclose(self) -> None:
        """Close every channel, from any loop (the engine process keeps running); idempotent.

        Calls after it are a :class:`~aiosync.core.errors.UsageError`.
        """
        await self._links.aclose()


async def _answer(engine: EngineHandle, call: Call) -> Reply:
    """Run one call on the local engine; the reply's id is filled in by the caller."""
    if isinstance(call, InitGroupCall):
        result = await engine.init_weights_update_group(
            call.master_address,
            call.master_port,
            call.rank_offset,
            call.world_size,
            call.group_name,
            call.backend,
            token=call.token,
        )
    elif isinstance(call, UpdateDistributedCall):
        result = await engine.update_weights_from_distributed(
            call.names,
            call.dtypes,
            call.shapes,
            call.group_name,
            call.flush_cache,
            call.load_format,
            call.weight_version,
        )
    elif isinstance(call, UpdateTensorCall):
        entries: list[bytes | str] = [
            entry.decode() if call.text else entry for entry in call.entries
        ]
        result = await engine.update_weights_from_tensor(
            entries, call.load_format, call.flush_cache, call.weight_version
        )
    elif isinstance(call, DestroyGroupCall):
        result = await engine.destroy_weights_update_group(call.group_name)
    else:
        health = await engine.check_health()
        return Reply(0, health.healthy, health.message, health.weight_version)
    return Reply(0, result.success, result.message)


async def serve_peer(channel: Channel, engine: EngineHandle) -> None:
    """Answer one peer's requests in order until it leaves; malformed ones are dropped."""
    while True:
        try:
            data = await channel.recv()
        except AiosyncError:
            return  # the peer left
        try:
            request = _requests.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("engine: dropping a malformed request from %s: %s", channel.peer, exc)
            continue
        try:
            reply = await _answer(engine, request.call)
        except AiosyncError as exc:
            reply = Reply(0, False, str(exc)[:MAX_TEXT])
        try:
            await channel.send(_encoder.encode(msgspec.structs.replace(reply, id=request.id)))
        except AiosyncError:
            return


async def serve_engine(listener: Listener, engine: EngineHandle) -> None:
    """Serve ``engine`` to every peer that reaches ``listener``, until cancelled.

    Each peer is answered in its own task, one request at a time, so a health check from
    one peer is answered while another peer's update runs.
    """
    async with anyio.create_task_group() as tg:
        while True:
            channel = await listener.accept()
            tg.start_soon(serve_peer, channel, engine)
