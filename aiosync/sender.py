"""The trainer's side: an async context manager that streams weights to one receiver.

Example::

    async with WeightSender("ipc:///tmp/aiosync-x/engine.sock") as sender:
        for step in range(steps):
            train_step()
            report = await sender.send(model.named_parameters(), version=step)

Buffers are created once per session and reused by every :meth:`WeightSender.send`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import anyio
import anyio.abc
import torch

from aiosync.errors import AiosyncError, PeerGoneError, ProtocolError, RejectedError
from aiosync.layout import ALIGNMENT, calculate_aligned_size, plan_buckets
from aiosync.memory import SharedBuffer, ShmSegment, create_buffer
from aiosync.pipeline import (
    ProgressCallback,
    StreamRun,
    SyncReport,
    is_connection_failure,
    make_packer,
)
from aiosync.protocol import SenderProtocol
from aiosync.runtime import unwrap_group
from aiosync.transports.zmq import SenderChannel
from aiosync.wire import (
    GOODBYE_SEQ,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Goodbye,
    Hello,
    Ping,
    Ready,
    decode,
    encode,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
CLOSE_TIMEOUT = 1.0  # seconds a closing sender waits for the goodbye to be acknowledged


@dataclass(frozen=True)
class SenderConfig:
    """How a sender buffers and how long it waits.

    ``buffer_bytes`` is the size of each of the ``num_buffers`` shared buffers (rounded up to
    the alignment); ``timeout`` bounds every wait on the receiver, in seconds. Every
    ``keepalive`` seconds the sender tells the receiver it is alive (keep it well under the
    receiver's ``session_timeout``); a caller's REQ socket cannot, so its sessions are short.
    """

    buffer_bytes: int = 128 * MiB
    num_buffers: int = 2
    timeout: float = 60.0
    keepalive: float = 10.0
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_buffers < 1:
            raise ValueError("num_buffers must be at least 1")
        if self.buffer_bytes < ALIGNMENT:
            raise ValueError(f"buffer_bytes must be at least {ALIGNMENT}")
        if self.timeout <= 0 or self.keepalive <= 0:
            raise ValueError("timeout and keepalive must be positive")


class WeightSender:
    """Streams named tensors to one receiver, one version at a time.

    ``target`` is an endpoint to connect to (``ipc://`` or ``tcp://``) or a ready
    :class:`SenderChannel`. ``device`` picks the buffers: CPU shared memory, or CUDA IPC
    memory on that GPU. Use as ``async with``, entered and left in one task (it runs a
    small task group for the connection watch and keepalives); leaving it releases sockets
    and buffers even when cancelled.
    """

    def __init__(
        self,
        target: str | SenderChannel,
        *,
        device: torch.device | str = "cpu",
        config: SenderConfig | None = None,
    ) -> None:
        self.config = config or SenderConfig()
        self.device = torch.device(device)
        self._target = target
        self._channel: SenderChannel | None = None
        self._buffers: list[SharedBuffer] = []
        self._protocol: SenderProtocol | None = None
        self._broken: BaseException | None = None
        self._receiver_lost = anyio.Event()
        self._packer = make_packer(self.device)
        self._watcher: anyio.abc.TaskGroup | None = None

    @property
    def peer(self) -> str:
        """The receiver's endpoint, for messages."""
        return self._target if isinstance(self._target, str) else self._target.endpoint

    @property
    def remote_version(self) -> int | None:
        """The receiver's current version as last confirmed to this sender."""
        return self._protocol.remote_version if self._protocol else None

    async def __aenter__(self) -> WeightSender:
        try:
            await self._open()
        except BaseException:
            await self._stop_watching()
            self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._channel is not None and self._protocol is not None and self._broken is None:
                with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                    await self._say_goodbye(self._channel, self._protocol.session or "")
        finally:
            await self._stop_watching()
            self._close()

    async def _watch_receiver(self, channel: SenderChannel) -> None:
        """Flag the session lost as soon as the receiver's connection drops."""
        try:
            await channel.wait_disconnected()
        except Exception as exc:  # the monitor itself failed: timeouts still bound every wait
            log.warning("cannot watch the connection to %s: %s", self.peer, exc)
            return
        log.warning("receiver %s disconnected", self.peer)
        self._receiver_lost.set()

    async def _keep_alive(self, channel: SenderChannel, session: str) -> None:
        """Tell the receiver, every ``keepalive`` seconds, that this session is alive."""
        ping = encode(Ping(session=session))
        while True:
            await anyio.sleep(self.config.keepalive)
            with anyio.move_on_after(self.config.timeout):
                try:
                    await channel.send(ping)
                except Exception as exc:  # never let a keepalive take the session down
                    log.warning("keepalive to %s failed: %s", self.peer, exc)
                    return

    async def _stop_watching(self) -> None:
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.cancel_scope.cancel()
            await watcher.__aexit__(None, None, None)

    @staticmethod
    async def _say_goodbye(channel: SenderChannel, session: str) -> None:
        """Close the session and wait for its ack, skipping acks of abandoned streams."""
        await channel.send(encode(Goodbye(session=session)))
        while True:
            reply = decode(await channel.recv())
            if isinstance(reply, Ack) and reply.seq == GOODBYE_SEQ:
                return

    async def _open(self) -> None:
        cfg = self.config
        size = calculate_aligned_size(cfg.buffer_bytes)
        if isinstance(self._target, SenderChannel):
            self._channel = self._target
        else:
            self._channel = SenderChannel.connect(self._target)
        self._watcher = anyio.create_task_group()
        await self._watcher.__aenter__()
        self._watcher.start_soon(self._watch_receiver, self._channel)
        for _ in range(cfg.num_buffers):
            self._buffers.append(create_buffer(size, self.device))
        session = uuid.uuid4().hex
        self._protocol = SenderProtocol(self.peer)
        self._protocol.session = session
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            session=session,
            sender=cfg.name or f"pid-{os.getpid()}",
            buffers=[buf.handle for buf in self._buffers],
        )
        with anyio.move_on_after(cfg.timeout) as scope:
            await self._channel.send(encode(hello))
            reply = decode(await self._channel.recv())
        if scope.cancelled_caught:
            raise PeerGoneError(f"no reply to hello within {cfg.timeout:g}s", peer=self.peer)
        if isinstance(reply, Abort):
            raise RejectedError(f"receiver refused the session: {reply.reason}", peer=self.peer)
        if not isinstance(reply, Ready):
            raise ProtocolError(f"expected ready, got {type(reply).__name__}", peer=self.peer)
        self._protocol.ready(reply)
        if self._channel.max_in_flight is None:  # a REQ socket must not send unasked
            self._watcher.start_soon(self._keep_alive, self._channel, session)
        for buf in self._buffers:  # the receiver has mapped them: no name needs to outlive us
            if isinstance(buf, ShmSegment):
                buf.unlink()
        log.info(
            "session %s open with %s (receiver at version %s)", session, self.peer, reply.version
        )

    def _close(self) -> None:
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()
        if self._channel is not None and self._channel is not self._target:
            self._channel.close()
        self._channel = None

    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> SyncReport:
        """Stream every tensor as ``version`` and return once the receiver has committed it.

        ``version`` defaults to one past the receiver's current version. On any failure the
        receiver is told to drop the partial stream and the error is raised; its
        ``current_version`` stays where it was.
        """
        if self._channel is None or self._protocol is None:
            raise AiosyncError("sender is not open; use 'async with WeightSender(...)'")
        if self._broken is not None:
            raise PeerGoneError(
                f"session unusable after an earlier failure: {self._broken}", peer=self.peer
            )
        if self._receiver_lost.is_set():
            self._broken = PeerGoneError("receiver disconnected", peer=self.peer)
            raise PeerGoneError("receiver disconnected since the last version", peer=self.peer)
        if version is None:
            remote = self._protocol.remote_version
            version = 0 if remote is None else remote + 1
        self._protocol.begin(version)
        run = StreamRun(
            channel=self._channel,
            protocol=self._protocol,
            buffers=[buf.tensor for buf in self._buffers],
            packer=self._packer,
            timeout=self.config.timeout,
            version=version,
            progress=progress,
            receiver_lost=self._receiver_lost,
        )
        capacity = calculate_aligned_size(self.config.buffer_bytes)
        try:
            report = await run.run(plan_buckets(named_tensors, capacity))
        except BaseException as group:
            exc = unwrap_group(group)
            self._protocol.failed()
            if is_connection_failure(exc) or self._channel.max_in_flight is not None:
                self._broken = exc
            else:
                with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                    await self._channel.send(encode(Abort(reason=str(exc), version=version)))
            if exc is group:
                raise
            raise exc from group
        log.info(
            "version %d: %d tensors, %.1f MB in %.3fs (%.2f GB/s) to %s",
            report.version,
            report.tensors,
            report.bytes / 1e6,
            report.seconds,
            report.gbps,
            self.peer,
        )
        return report
