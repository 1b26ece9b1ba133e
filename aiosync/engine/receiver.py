"""The engine's side: serves weight streams into a sink from the event loop.

Embed it in an async rollout loop::

    async with WeightReceiver(ModuleSink(model), endpoint) as receiver:
        while True:
            await generate(model)            # new versions are applied meanwhile
            print(receiver.current_version)

This module only moves bytes: every decision (accept, refuse, apply, commit, expire) is
the :class:`~aiosync.core.engine_session.EngineSession`'s, and this loop carries out the
actions it returns. ``current_version`` changes only on a commit, after the whole version
was checked and every engine the sender needs had prepared it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiosync.channels.base import Channel, Listener
from aiosync.channels.endpoints import check_endpoint
from aiosync.channels.keys import ChannelAuth
from aiosync.core.engine_actions import (
    Action,
    Apply,
    ClosePlane,
    CommitSink,
    Committed,
    Discard,
    Note,
    OpenPlane,
    Peer,
    Reply,
)
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError, ProtocolError, UsageError
from aiosync.core.exception_groups import exit_as_one
from aiosync.core.ready_terms import ReadyTerms
from aiosync.core.where_to_run import on_loop, walks_tensors
from aiosync.core.wire import Ack, Begin, Challenge, ManifestMemo, Message, encode, split_begin
from aiosync.engine.challenges import Challenges
from aiosync.engine.commit import Swapper
from aiosync.engine.config import ReceiverConfig
from aiosync.engine.held import HeldBuckets, held_or_parts
from aiosync.engine.leases import LeaseGate
from aiosync.engine.live_hook import OnLive
from aiosync.engine.quick_apply import QuickApplies, views_at_once, worker_stream
from aiosync.engine.receiver_reads import ReceiverReads
from aiosync.engine.sink_shape import SinkShape, as_weight_sink
from aiosync.engine.sink_tools import apply_error
from aiosync.engine.sinks import WeightSink
from aiosync.planes import ReceiverPlane, open_receiver_plane, view_parts
from aiosync.planes.cuda_order import ordered_apply, receive_through_plane, with_plane_events
from aiosync.runtime import require_asyncio

log = logging.getLogger(__name__)

IDLE_POLL = 1.0  # seconds between housekeeping checks while no deadline is nearer
INBOX = 0  # messages waiting for the serving loop: each pump hands its own over in turn


def _accepted(actions: list[Action], peer: Peer) -> bool:
    """Whether ``actions`` (a ``begin``'s) accept it: an ``ack`` of seq 0 that says ok."""
    return any(
        isinstance(a, Reply)
        and a.peer == peer
        and isinstance(a.message, Ack)
        and a.message.seq == 0
        and a.message.ok
        for a in actions
    )


class WeightReceiver(ReceiverReads):
    """Serves weight streams from any number of senders into one sink, one stream at a time.

    ``endpoint`` is an address to bind (default: ``ipc://`` in a new private directory; read
    :attr:`endpoint` for the address to give senders) or a ready :class:`Listener`; or, with
    ``connect``, the address a trainer's socket binds (NeMo-RL's policy worker binds its REQ
    socket), which the receiver connects to, serving it as it would serve a bound one. Use as
    ``async with``, entered and left in one task: the serving tasks live inside the block and
    are cancelled, with every socket and buffer released, when it ends. While one sender
    streams, another's version is refused as busy (it may retry). ``on_commit(version)`` runs
    in a worker thread after each commit. ``held`` keeps buckets named by digest until a commit.
    :attr:`challenges` keeps what weight servers' challenges said (for a subscriber's proof).

    ``on_live(version)`` runs under the swap, the moment the sink made a version live and
    before any read lease on it is granted: leases asked for meanwhile wait for it, and with
    ``ack_at="live"`` so does the sender's acknowledgement; ``current_version`` (and
    :meth:`wait_for_version`) turn to the new version as it returns.
    Drop what was computed from the old weights there (a prefix or KV cache). A function runs
    in a worker thread, an ``async def`` on the loop; either is waited for at most
    ``swap_timeout``. If it raises or times out, the version stays live (its weights cannot
    be taken back; the sender hears it committed), the error is logged and kept in
    ``swap_stats.on_live_error``, and :attr:`servable` is False until a later version's hook
    returns (:mod:`aiosync.engine.live_hook`).

    ``sink`` is a :class:`WeightSink`, or an object of its shape that does not subclass it
    (then :attr:`sink` is that object in a :class:`~aiosync.engine.sink_shape.SinkAdapter`).
    """

    def __init__(
        self,
        sink: WeightSink | SinkShape,
        endpoint: str | Listener | None = None,
        *,
        config: ReceiverConfig | None = None,
        on_commit: Callable[[int], object] | None = None,
        auth: ChannelAuth | None = None,
        held: HeldBuckets | None = None,
        on_live: OnLive | None = None,
        connect: str | None = None,
    ) -> None:
        if connect is not None and endpoint is not None:
            raise UsageError(f"bind {endpoint!r} or connect to {connect!r}, not both")
        if isinstance(endpoint, str):
            check_endpoint(endpoint, binding=True)
        sink = as_weight_sink(sink)  # a duck-typed sink is adapted (refused if it lacks a member)
        self._connect = connect
        self.sink, self.held = sink, held
        self._auth = auth
        self.config = config or ReceiverConfig()
        self._endpoint = endpoint
        self._on_commit = on_commit
        self._machine: EngineSession | None = None
        self._listener: Listener | None = None
        self._channels: dict[Peer, Channel] = {}
        self._planes: dict[Peer, ReceiverPlane] = {}
        self._limiter = anyio.CapacityLimiter(1)
        self._quick = QuickApplies()  # buckets measured quick: applied on the loop
        self._messages = ManifestMemo()  # decodes; an unchanged manifest is not decoded again
        self._quick_sink = sink.applies_quickly()
        self._committed = anyio.Event()
        self._leases = LeaseGate()
        self._swapper = Swapper(sink, self._leases, self.config, self._limiter, on_live)
        self._task_group: anyio.abc.TaskGroup | None = None
        self.challenges = Challenges()

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> WeightReceiver:
        require_asyncio("WeightReceiver")
        expectations = await anyio.to_thread.run_sync(self.sink.expectations)
        await anyio.to_thread.run_sync(self.sink.reserve)  # room to stage a version
        self._machine = EngineSession(
            expectations=expectations,
            staged=self.sink.staged,
            stream_timeout=self.config.stream_timeout,
            session_timeout=self.config.session_timeout,
            limits=self.config.limits,
            terms=ReadyTerms(self.config.swap_timeout, self.config.ack_at),
            key_of=self._key_of,
        )
        if isinstance(self._endpoint, str | None):
            from aiosync.channels.zmq import ZmqListener

            self._listener = ZmqListener.open(
                self._endpoint,
                auth=self._auth,
                max_message_bytes=self.config.limits.max_message_bytes,
                connect=self._connect,
            )
        else:
            self._listener = self._endpoint
        inbox_tx, inbox_rx = anyio.create_memory_object_stream[tuple[Peer, bytes]](INBOX)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._accept, inbox_tx)
        self._task_group.start_soon(self._serve, inbox_rx)
        log.info("receiving weights at %s", self.endpoint)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._task_group is not None:
                self._task_group.cancel_scope.cancel()
                await exit_as_one(self._task_group.__aexit__(exc_type, exc, tb), exc)
        finally:
            self._task_group = None
            if self._machine is not None:
                with anyio.CancelScope(shield=True):
                    await self._perform(self._machine.close(), replies=False)
            if self._listener is not None and self._listener is not self._endpoint:
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()

    def _key_of(self, peer: Peer) -> bytes | None:
        """The CURVE key ``peer``'s channel came with (None: no CURVE)."""
        channel = self._channels.get(peer)
        return None if channel is None else channel.key

    # --- the loops --------------------------------------------------------------------

    async def _accept(self, inbox: MemoryObjectSendStream[tuple[Peer, bytes]]) -> None:
        assert self._listener is not None
        async with inbox, anyio.create_task_group() as tg:
            while True:
                channel = await self._listener.accept()
                self._channels[channel.peer] = channel
                tg.start_soon(self._pump, channel, inbox.clone())

    async def _pump(
        self, channel: Channel, inbox: MemoryObjectSendStream[tuple[Peer, bytes]]
    ) -> None:
        """Forward one peer's messages to the serving loop until its channel closes."""
        async with inbox:
            try:
                while True:
                    await inbox.send((channel.peer, await channel.recv()))
            except AiosyncError as exc:
                log.debug("channel %s ended: %s", channel.peer, exc)
            finally:
                self._channels.pop(channel.peer, None)

    async def _serve(self, inbox: MemoryObjectReceiveStream[tuple[Peer, bytes]]) -> None:
        machine = self._session
        async with inbox:
            while True:
                deadline = machine.next_deadline()
                wait = IDLE_POLL if deadline is None else deadline - time.monotonic()
                item = None
                with anyio.move_on_after(min(max(wait, 0.0), IDLE_POLL)):
                    item = await inbox.receive()
                if item is not None:
                    await self._perform(await self._decide(*item), also=item[0])
                await self._perform(machine.expire(time.monotonic()))
                self._messages.keep_only(machine.manifests)  # not an abandoned begin's

    async def _decide(self, peer: Peer, payload: bytes) -> list[Action]:
        """Decode and hand to the session.

        Large messages, and checks that walk many tensors, run in a worker thread so that
        per-tensor work never blocks the loop.
        """
        machine = self._session
        if len(payload) > self.config.limits.max_message_bytes:
            most = self.config.limits.max_message_bytes
            return machine.undecodable(
                peer, ProtocolError(f"{len(payload)}-byte message (most {most})")
            )
        try:
            if not on_loop(nbytes=len(payload)):
                message = await anyio.to_thread.run_sync(self._messages.decode, payload)
            else:
                message = self._messages.decode(payload)
        except ProtocolError as exc:
            log.debug("undecodable message from %s: %s", peer, exc)
            return machine.undecodable(peer, exc)
        if isinstance(message, Challenge):  # for this process's subscriber; never answered
            self.challenges.note(message.ref, message.token)
            return []
        first = None
        if isinstance(message, Begin):
            message, first = split_begin(message)  # bucket 1 in it: two messages in a row
        plane, in_thread = self._planes.get(peer), walks_tensors(message)
        actions = await receive_through_plane(plane, machine, peer, message, in_thread)
        if isinstance(message, Begin):  # its manifest is kept by its bytes once accepted
            session = machine.sessions.get(peer)
            held = session.stream.manifest if session and session.stream else None
            self._messages.settle(message.manifest if _accepted(actions, peer) else None, held)
        if first is not None and peer in machine.sessions:  # not after a protocol error
            plane, in_thread = self._planes.get(peer), walks_tensors(first)
            actions += await receive_through_plane(plane, machine, peer, first, in_thread)
        return actions

    # --- carrying out actions ---------------------------------------------------------

    async def _perform(
        self, actions: list[Action], *, replies: bool = True, also: Peer | None = None
    ) -> None:
        """Carry out ``actions`` and those they lead to, then forget peers left sessionless.

        ``also`` names the peer whose message led to ``actions``.
        """
        queue = deque(actions)
        peers = {also} if also is not None else set()
        while queue:
            action = queue.popleft()
            if isinstance(action, ClosePlane):
                peers.add(action.peer)
            if isinstance(action, Reply):
                if replies:
                    await self._reply(action.peer, action.message)
                continue
            queue.extendleft(reversed(await self._do(action)))
        for peer in peers:
            if peer not in self._session.sessions:
                await self._forget(peer)

    async def _forget(self, peer: Peer) -> None:
        """A peer without a session holds nothing here: its next message starts afresh."""
        channel = self._channels.pop(peer, None)
        if channel is not None:
            await channel.aclose()

    async def _reply(self, peer: Peer, message: Message) -> None:
        channel = self._channels.get(peer)
        if channel is None:
            return
        with anyio.move_on_after(self.config.reply_timeout) as scope:
            try:
                await channel.send(encode(message))
            except AiosyncError as exc:
                log.info("could not reply %s to %s: %s", type(message).__name__, peer, exc)
        if scope.cancelled_caught:
            log.warning("reply %s to %s timed out", type(message).__name__, peer)

    async def _do(self, action: Action) -> list[Action]:
        machine = self._session
        if isinstance(action, OpenPlane):
            try:
                devices = self.sink.part_devices  # a RankedSink's
                cap = max(self.config.stream_timeout, self.config.session_timeout)
                plane = await anyio.to_thread.run_sync(
                    functools.partial(open_receiver_plane, max_timeout=cap),
                    action.plane, self.sink.device, self.config.limits, devices,
                )  # fmt: skip
            except Exception as exc:
                log.warning("refused session from %s: %s", action.peer, exc)
                return machine.plane_failed(action.peer, str(exc))
            self._planes[action.peer] = plane
            return with_plane_events(machine.plane_opened(action.peer), plane)
        if isinstance(action, ClosePlane):
            closing = self._planes.pop(action.peer, None)
            if closing is not None:
                closing.close()
            return []
        if isinstance(action, Apply):
            try:
                plane = self._planes[action.peer]
                quick = self._quick_sink and views_at_once(plane) and self._quick.quick(action)
                if quick:  # no hop to a worker thread (engine.quick_apply)
                    with worker_stream(self.sink.device):
                        self._apply(plane, action, on_loop=True)
                else:
                    apply = functools.partial(self._apply, plane, action)
                    await anyio.to_thread.run_sync(apply, limiter=self._limiter)
            except Exception as exc:
                self._quick.forget(action)
                return machine.apply_failed(action.peer, action.seq, apply_error(action, exc))
            return machine.applied(action.peer, action.seq, time.monotonic())
        if isinstance(action, Discard):
            try:
                self.sink.abort()
            except Exception:
                log.exception("sink failed to discard version %d", action.version)
            return []
        if isinstance(action, CommitSink):  # under the lease gate; acked when live or staged
            return await self._swapper.commit(machine, action, self._reply)
        if isinstance(action, Committed):
            await self._committed_hook(action.version)
        elif isinstance(action, Note):
            log.warning("%s", action.text)
        return []

    def _apply(self, plane: ReceiverPlane, action: Apply, on_loop: bool = False) -> None:
        """Hand the sink the bucket's bytes and specs (a worker thread, or ``on_loop``).

        A CUDA plane orders the copies with events: no host wait here (``ordered_apply``).
        Its time is noted: a bucket that was quick goes on the loop next time.
        """
        started, wall = time.thread_time(), time.perf_counter()
        with ordered_apply(plane, action.buffer) as context:
            parts = view_parts(plane, action, context)
            if len(parts) > 1 and not action.held:  # a direct bucket's regions: one call
                self.sink.apply_with(parts, context)
            else:
                for part in held_or_parts(self.held, parts, action):
                    self.sink.apply_with([part], context)
        seconds = time.thread_time() - started
        if on_loop:  # what the loop was held, waits included
            seconds = max(seconds, time.perf_counter() - wall)
        if views_at_once(plane):
            self._quick.note(action, seconds)

    async def _committed_hook(self, version: int) -> None:
        log.info("committed version %d", version)
        if self.held is not None:  # the version is whole: the buckets kept for it go
            await anyio.to_thread.run_sync(self.held.clear)
        self._committed.set()
        self._committed = anyio.Event()
        if self._on_commit is not None:
            try:
                await anyio.to_thread.run_sync(self._on_commit, version)
            except Exception:
                log.exception("on_commit hook failed for version %d", version)
