"""The sender's concurrent stages: pack -> send -> await ack, joined by bounded streams.

Backpressure comes from the buffer ring: a bucket is packed only into a free buffer, and a
buffer is freed only by the receiver's ack for the bucket in it. With ``N`` buffers at most
``N`` buckets are in flight, and packing bucket ``k+1`` overlaps the receiver applying ``k``.
Packing runs in a worker thread (it is a large memcpy or a CUDA stream sync) so the event
loop stays free for acks, timeouts and cancellation. This module knows nothing of ZMQ or
of the memory kind: it gets a channel, buffers and a pack function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import anyio
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from aiosync.errors import PeerGoneError, ProtocolError, RejectedError, SyncTimeoutError
from aiosync.layout import BucketPlan, pack_bucket
from aiosync.protocol import SenderProtocol
from aiosync.transports.zmq import SenderChannel
from aiosync.wire import Abort, Ack, Bucket, Complete, Message, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncProgress:
    """Progress of one version's stream, reported after every acknowledged bucket."""

    version: int
    buckets: int
    tensors: int
    bytes: int


@dataclass(frozen=True)
class SyncReport:
    """What one completed sync moved and how long it took, end to end."""

    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


ProgressCallback = Callable[[SyncProgress], None]


def make_packer(device: torch.device) -> Callable[[torch.Tensor, BucketPlan], None]:
    """A blocking pack function for buffers on ``device``, meant for a worker thread.

    On CUDA the copies run on a side stream that first waits for the default stream (where
    the trainer wrote its weights), and the call returns once they have finished.
    """
    if device.type != "cuda":
        return pack_bucket
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def pack_on_side_stream(buffer: torch.Tensor, plan: BucketPlan) -> None:
        stream.wait_stream(torch.cuda.default_stream(device))
        with torch.cuda.stream(stream):
            pack_bucket(buffer, plan)
        stream.synchronize()

    return pack_on_side_stream


@dataclass
class _Sent:
    seq: int
    buffer: int
    plan: BucketPlan


class StreamRun:
    """One version's trip through the stages; :meth:`run` returns its report or raises."""

    def __init__(
        self,
        *,
        channel: SenderChannel,
        protocol: SenderProtocol,
        buffers: list[torch.Tensor],
        packer: Callable[[torch.Tensor, BucketPlan], None],
        timeout: float,
        version: int,
        progress: ProgressCallback | None = None,
        receiver_lost: anyio.Event | None = None,
    ) -> None:
        self.channel = channel
        self.protocol = protocol
        self.buffers = buffers
        self.packer = packer
        self.timeout = timeout
        self.version = version
        self.progress = progress
        self._receiver_lost = receiver_lost or anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        window = channel.max_in_flight or len(buffers)
        self._window = anyio.Semaphore(min(window, len(buffers)))
        self.buckets = self.tensors = self.bytes = 0

    def _timeout_error(self, what: str, plan: BucketPlan | None = None) -> SyncTimeoutError:
        tensor = plan.items[0].spec.name if plan and plan.items else None
        return SyncTimeoutError(
            f"no {what} within {self.timeout:g}s (is the receiver alive?)",
            peer=self.channel.endpoint,
            version=self.version,
            tensor=tensor,
        )

    async def _recv_ack(self, what: str, plan: BucketPlan | None = None) -> tuple[int, Ack]:
        """The next ack that belongs to this stream, skipping leftovers of failed streams."""
        with anyio.move_on_after(self.timeout) as scope:
            while True:
                message: Message = decode(await self.channel.recv())
                if isinstance(message, Abort):  # the receiver has ended this session
                    raise PeerGoneError(
                        f"receiver ended the session: {message.reason}",
                        peer=self.channel.endpoint,
                        version=self.version,
                    )
                if not isinstance(message, Ack):
                    raise ProtocolError(
                        f"expected an ack, got {type(message).__name__}",
                        peer=self.channel.endpoint,
                        version=self.version,
                    )
                seq = self.protocol.ack(message)
                if seq is not None:
                    return seq, message
        assert scope.cancelled_caught
        raise self._timeout_error(what, plan)

    async def _send(self, message: Bucket | Complete, plan: BucketPlan | None = None) -> None:
        with anyio.move_on_after(self.timeout):
            await self.channel.send(encode(message))
            return
        raise self._timeout_error("room on the socket to send", plan)

    async def _pack_stage(
        self,
        plans: Iterable[BucketPlan],
        free: ObjectReceiveStream[int],
        packed: ObjectSendStream[tuple[int, BucketPlan]],
    ) -> None:
        async with packed:
            for plan in plans:
                with anyio.move_on_after(self.timeout) as scope:
                    index = await free.receive()
                if scope.cancelled_caught:
                    raise self._timeout_error("free buffer", plan)
                await anyio.to_thread.run_sync(
                    self.packer, self.buffers[index], plan, limiter=self._limiter
                )
                await packed.send((index, plan))

    async def _send_stage(
        self,
        packed: ObjectReceiveStream[tuple[int, BucketPlan]],
        sent: ObjectSendStream[_Sent],
    ) -> None:
        async with sent:
            async for index, plan in packed:
                with anyio.move_on_after(self.timeout) as scope:
                    await self._window.acquire()
                if scope.cancelled_caught:
                    raise self._timeout_error("ack freeing a send slot", plan)
                seq = self.protocol.next_seq()
                bucket = Bucket(seq, self.version, index, plan.used, plan.specs)
                await self._send(bucket, plan)
                await sent.send(_Sent(seq, index, plan))

    async def _ack_stage(
        self, sent: ObjectReceiveStream[_Sent], free: ObjectSendStream[int]
    ) -> None:
        async for item in sent:
            _, ack = await self._recv_ack("ack for a bucket", item.plan)  # in order: item.seq
            if not ack.ok:
                raise RejectedError(
                    ack.error or "bucket refused",
                    peer=self.channel.endpoint,
                    version=self.version,
                    tensor=ack.tensor,
                )
            self._window.release()
            self.buckets += 1
            self.tensors += sum(1 for it in item.plan.items if it.spec.is_last_chunk)
            self.bytes += item.plan.payload_bytes
            await free.send(item.buffer)
            if self.progress is not None:
                self.progress(SyncProgress(self.version, self.buckets, self.tensors, self.bytes))

    async def run(self, plans: Iterable[BucketPlan]) -> SyncReport:
        """Stream every planned bucket, then commit; raises an :class:`AiosyncError` on failure.

        A dropped connection to the receiver ends the stream at once with
        :class:`PeerGoneError`, without waiting for an ack timeout.
        """
        report: SyncReport | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._fail_if_receiver_lost)
            report = await self._stream_and_commit(plans)
            tg.cancel_scope.cancel()
        assert report is not None
        return report

    async def _fail_if_receiver_lost(self) -> None:
        await self._receiver_lost.wait()
        raise PeerGoneError(
            "receiver disconnected mid-stream", peer=self.channel.endpoint, version=self.version
        )

    async def _stream_and_commit(self, plans: Iterable[BucketPlan]) -> SyncReport:
        started = time.perf_counter()
        n = len(self.buffers)
        free_tx, free_rx = anyio.create_memory_object_stream[int](n)
        packed_tx, packed_rx = anyio.create_memory_object_stream[tuple[int, BucketPlan]](n)
        sent_tx, sent_rx = anyio.create_memory_object_stream[_Sent](n)
        for index in range(n):
            free_tx.send_nowait(index)
        async with free_tx, free_rx, packed_rx, sent_rx, anyio.create_task_group() as tg:
            tg.start_soon(self._pack_stage, plans, free_rx, packed_tx)
            tg.start_soon(self._send_stage, packed_rx, sent_tx)
            tg.start_soon(self._ack_stage, sent_rx, free_tx)
        async with self._window:
            seq = self.protocol.next_seq()
            await self._send(Complete(seq, self.version, self.buckets, self.tensors))
            _, ack = await self._recv_ack("ack for the commit")
        if not ack.ok:
            raise RejectedError(
                ack.error or "commit refused",
                peer=self.channel.endpoint,
                version=self.version,
                tensor=ack.tensor,
            )
        self.protocol.committed()
        return SyncReport(
            self.version, self.buckets, self.tensors, self.bytes, time.perf_counter() - started
        )


def is_connection_failure(exc: BaseException) -> bool:
    """True for errors after which the session cannot be trusted (timeouts, lost peers)."""
    return isinstance(exc, SyncTimeoutError | PeerGoneError | ProtocolError)
