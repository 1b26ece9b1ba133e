"""The per-engine stages of a :class:`~aiosync.pipeline.fanout.BucketFanout`.

Per engine, a send task sends each bucket message the packing stage published into that
engine's queue, and an ack task matches the engine's acks in order; a bucket acked by every
live engine frees its buffer. An engine that fails lets go of every buffer it held. On a
collective plane an engine that refuses is still sent every bucket (it joins each
broadcast and drops it) and its refusal goes to the vote.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream as Receiving
from anyio.streams.memory import MemoryObjectSendStream as Sending

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan
from aiosync.core.trainer_session import FleetVote
from aiosync.pipeline.ledger import BufferLedger
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import SyncProgress
from aiosync.planes.base import SenderPlane

BEGIN = -1
"""The buffer index of the ``begin`` message when it travels in a link's send queue."""


@dataclass(frozen=True)
class PackedBucket:
    """A bucket packed into ``index`` (or :data:`BEGIN`), as it travels to each link."""

    seq: int
    index: int
    payload: bytes
    plan: BucketPlan
    tensors: int = 0  # whole tensors and last chunks (counted in the packing thread)
    nbytes: int = 0  # tensor bytes carried
    direct: bool = False  # read by engines in the trainer's memory (direct mode)
    sent: bool = False  # went out before the read (pipeline.early_begin): acks only


class LinkStages:
    """The send and ack stages of one version's fanout, one pair per engine link.

    A base of :class:`~aiosync.pipeline.fanout.BucketFanout`, which sets these attributes.
    """

    plane: SenderPlane
    version: int
    vote: FleetVote
    timeout: float
    finished: bool
    acked: SyncProgress
    direct_bytes: int
    progress: Callable[[SyncProgress], None] | None
    _rebase: bool
    _begun: bool
    _tail: Callable[[EngineLink], Awaitable[None]] | None
    _on_sent: Callable[[BucketPlan], None] | None
    _following: list[str]

    @property
    def _follow(self) -> bool:
        """A collective plane's: every engine of the group joins every broadcast.

        So one that refuses is still sent the version's buckets (it drops them) and its
        refusal is counted, not raised: the others complete (``_following`` names them).
        """
        return self.plane.joins_all

    async def _link_stage(
        self,
        link: EngineLink,
        outbox: Receiving[PackedBucket],
        ledger: BufferLedger[PackedBucket],
        free: Sending[int],
        begin: bytes | None,
    ) -> None:
        """Send every bucket to one engine and match its acks; gone: release its buffers.

        With ``begin``, the stream opens here (or opened already, the ``begin`` sent, for a
        fanout made with ``begun``), and the ack of the begin is the first awaited.
        """
        inflight_tx, inflight_rx = anyio.create_memory_object_stream[PackedBucket](
            self.plane.count + 1
        )
        try:
            if begin is not None:  # sent already with ``begun``: only its ack is due
                if not self._begun:
                    self._open(link)
                head = PackedBucket(0, BEGIN, begin, BucketPlan(), sent=self._begun)
                await self._send_one(link, head, inflight_tx)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_loop, link, outbox, inflight_tx)
                await self._ack_loop(link, inflight_rx, ledger, free)
            if link.name in self._following:  # its refusals were all read: the stream ends
                link.session.failed()
        except BaseException:
            for index, done in ledger.drop(link.name):
                self._bucket_done(done)
                free.send_nowait(index)
            raise

    def _open(self, link: EngineLink) -> None:
        """Open ``link``'s stream, even one a collective plane's engine will refuse.

        That engine still gets the version: it refuses it itself, then joins and drops
        each bucket's broadcast.
        """
        try:
            link.session.begin(self.version, rebase=self._rebase)
        except AiosyncError as exc:
            if not self._follow:
                raise
            self._refused(link, exc)
            link.session.follow(self.version)

    def _refused(self, link: EngineLink, refusal: AiosyncError) -> None:
        """A collective plane's engine refused: the vote hears it; it keeps joining."""
        if link.name not in self._following:
            self._following.append(link.name)
            self.vote.fail(link.name, refusal)

    async def _send_loop(
        self,
        link: EngineLink,
        outbox: Receiving[PackedBucket],
        inflight: Sending[PackedBucket],
    ) -> None:
        async with outbox, inflight:
            async for packed in outbox:
                await self._send_one(link, packed, inflight)
                if self._on_sent is not None:
                    self._on_sent(packed.plan)
            if self._tail is not None and self.finished:  # not after a failed packing
                await self._tail(link)

    async def _send_one(
        self, link: EngineLink, packed: PackedBucket, inflight: Sending[PackedBucket]
    ) -> None:
        if packed.sent:  # before the read (pipeline.early_begin): only its ack is due
            inflight.send_nowait(packed)
            return
        tensor = packed.plan.first_name
        if link.window is not None:
            with anyio.move_on_after(self.timeout) as scope:
                await link.window.acquire()
            if scope.cancelled_caught:
                raise link.timeout_error("ack freeing a send slot", self.version, tensor)
        await link.send(packed.payload, "a bucket", self.version, tensor)
        link.session.sent(packed.seq)
        try:
            inflight.send_nowait(packed)
        except anyio.BrokenResourceError:  # the ack loop ended: raise its cancellation
            await anyio.lowlevel.checkpoint()  # (a zmq send done at once did not check)
            raise

    async def _ack_loop(
        self,
        link: EngineLink,
        inflight: Receiving[PackedBucket],
        ledger: BufferLedger[PackedBucket],
        free: Sending[int],
    ) -> None:
        async with inflight:
            async for packed in inflight:
                tensor = packed.plan.first_name
                ack = await link.recv_ack("ack for a bucket", self.version, tensor)
                if link.window is not None:
                    link.window.release()
                if not ack.ok and link.name not in self._following:
                    refusal = link.refusal(ack, "bucket" if packed.index != BEGIN else "version")
                    if not self._follow:
                        raise refusal
                    self._refused(link, refusal)
                if packed.index == BEGIN:
                    continue
                if not packed.direct:
                    self.plane.consumed(packed.index, link.events)  # reuse waits for its event
                done = ledger.release(packed.index, link.name)
                if done is not None:
                    self._bucket_done(done)
                    free.send_nowait(packed.index)

    def _bucket_done(self, packed: PackedBucket) -> None:
        """Count an acked bucket (from figures the packing thread took: no per-tensor work)."""
        done = self.acked
        if packed.direct:
            self.direct_bytes += packed.nbytes
        self.acked = SyncProgress(
            self.version,
            done.buckets + 1,
            done.tensors + packed.tensors,
            done.bytes + packed.nbytes,
        )
        if self.progress is not None:
            self.progress(self.acked)
