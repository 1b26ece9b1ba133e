"""Buckets to a fleet: pack each once, send it to every live engine, free it when all acked.

A packer fills a free buffer (in a worker thread, with the planning and message encoding of
that bucket; bucket 1 may come packed already, from the thread that read the version, and
is then encoded after the begin left) and publishes it; per engine, a send task sends each
bucket message and an ack task matches the engine's acks (:mod:`.fanout_links`). A buffer
is free again once every live engine acked it (the
:class:`~aiosync.pipeline.ledger.BufferLedger`), so the ring of buffers is the
backpressure: with ``N`` buffers at most ``N`` buckets are in flight, to every engine at
once. Once the last bucket went out, a ``tail`` (if given) sends each live engine's closing
messages at once, before its acks are in and before the plane's ``drain`` (the stream's
end, see ``StreamRun``). With an ``opening`` (the engines checking a begin sent apart),
bucket 1 is packed meanwhile and goes out only once the opening ended with the version
still possible.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream as Receiving
from anyio.streams.memory import MemoryObjectSendStream as Sending

from aiosync.core.errors import MismatchError, SyncTimeoutError
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.trainer_session import FleetVote
from aiosync.core.where_to_run import on_loop
from aiosync.core.wire import Bucket, Slot, encode
from aiosync.pipeline.ahead import FIRST_BUFFER, PackedAhead, next_plan, pack_plan
from aiosync.pipeline.fanout_links import BEGIN as BEGIN
from aiosync.pipeline.fanout_links import LinkStages, PackedBucket
from aiosync.pipeline.ledger import BufferLedger
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import SyncProgress
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.planes.base import DirectPlan, SenderPlane, StoredPlan, regions_of

_Packed = PackedBucket  # the name it had before the split

Guard = Callable[..., Coroutine[Any, Any, None]]
"""Runs one engine's step inside a task group; its failure goes to the fleet's vote."""


class EarlyBucketMismatch(MismatchError):
    """Bucket 1 as the read planned it is not the message sent before the read.

    The version fails (the engines drop it); a sender then stops sending bucket 1 early.
    """


def bucket_payload(
    version: int,
    seq: int,
    index: int,
    plan: BucketPlan,
    slots: list[Slot] | None,
    after: int | None = None,
) -> bytes:
    """The encoded bucket message of ``plan`` in buffer ``index``.

    By manifest ``slots``, or naming its specs (no manifest); a direct plan's regions go
    with it, and a stored plan's digest; ``after``: sent ahead of its packing, its reads
    wait for that counter value.
    """
    digest, held = (plan.digest, plan.held) if isinstance(plan, StoredPlan) else (None, False)
    specs = plan.specs if slots is None else []
    regions = regions_of(plan)
    return encode(
        Bucket(version, seq, index, plan.used, slots or [], specs, regions, digest, held, after)
    )


def kept_first_payload(
    version: int, plan: BucketPlan, after: int | None = None, *, as_read: bool = False
) -> bytes | None:
    """Bucket 1 of ``version`` as a ``plan`` kept from the last version encodes it.

    None unless ``plan`` carries the slots made for it then, and is either direct or, with
    ``after``, a ring plan (into :data:`FIRST_BUFFER`): sent ahead of its packing, its
    reads wait for that counter value. ``as_read``: the bytes :class:`BucketFanout` makes
    for the same plan once the version is read (no ``after``), which the read confirms.
    """
    direct = plan.buffer if isinstance(plan, DirectPlan) and plan.regions else None
    if plan.slots is None or (direct is None and after is None):
        return None
    index = FIRST_BUFFER if direct is None else direct
    return bucket_payload(version, 1, index, plan, plan.slots, None if as_read else after)


class BucketFanout(LinkStages):
    """One version's (``spec``'s) buckets through ``plane`` to the live engines of ``vote``.

    ``spec.manifest`` is the one the begin carried; ``spec.first`` is not read (bucket 1
    packed ahead comes to :meth:`run`).
    """

    def __init__(
        self,
        *,
        links: dict[str, EngineLink],
        plane: SenderPlane,
        vote: FleetVote,
        guard: Guard,
        spec: VersionSpec,
        tail: Callable[[EngineLink], Awaitable[None]] | None = None,
    ) -> None:
        self.links = links
        self._rebase = spec.rebase  # the version restarts the numbering (the engines allow it)
        self._begun = spec.begun is not None  # the begin went out already, each stream open
        self._sent_first = spec.sent_first  # and bucket 1's message, to be confirmed as read
        self._tail = tail  # sent on each link after its last bucket, once all are packed
        self._on_sent = spec.on_sent
        self.finished = False  # every planned bucket was packed and handed to the links
        self._gate: anyio.Event | None = None  # set once every engine answered the begin
        self.packed = spec.packed  # set once every byte of the version is in a buffer
        self.plane = plane
        self.version = spec.version
        self.manifest = spec.manifest
        self.vote = vote
        self._guard = guard
        self.progress = spec.progress
        self.timeout = min(link.timeout for link in links.values())
        self._limiter = anyio.CapacityLimiter(1)
        self._following: list[str] = []  # engines that refused, still joining (``_follow``)
        self._entries: dict[str, int] | None = None  # built in the packing thread
        self.sent_buckets = self.sent_tensors = 0
        self.acked = SyncProgress(spec.version, 0, 0, 0)
        self.direct_bytes = 0  # of ``acked``, read in place (direct mode)
        self._direct_sent = False  # then the trainer's tensors are read until the commit

    async def run(
        self,
        plans: Iterator[BucketPlan],
        begin: bytes | None,
        opening: Callable[[], Awaitable[None]] | None = None,
        first: PackedAhead | None = None,
    ) -> None:
        """Stream every planned bucket to every live engine (opening with ``begin`` if given).

        ``opening`` (the engines' acceptance of a begin sent and answered apart) runs while
        bucket 1 is packed; nothing is published or sent before it ended, and nothing at
        all if it left the version hopeless (a refusal under policy ``all``). ``first``:
        bucket 1 packed already, the plane's ``begin_version`` called
        (:func:`~aiosync.pipeline.ahead.read_ahead`).
        """
        count = self.plane.count
        if first is None:  # (else called before read_ahead)
            self.plane.begin_version()  # a CUDA plane packs on this (the caller's) stream
        free_tx, free_rx = anyio.create_memory_object_stream[int](count)
        for index in range(count):
            free_tx.send_nowait(index)
        ledger: BufferLedger[PackedBucket] = BufferLedger()
        outboxes: dict[str, Sending[PackedBucket]] = {}
        async with free_tx, free_rx, anyio.create_task_group() as tg:
            for name in self.vote.live:
                tx, rx = anyio.create_memory_object_stream[PackedBucket](count)
                outboxes[name] = tx
                link = self.links[name]
                tg.start_soon(self._guard, tg, link, self._link_stage, rx, ledger, free_tx, begin)
            if opening is not None:
                self._gate = anyio.Event()
                tg.start_soon(self._open_all, opening, self._gate)
            await self._pack_stage(plans, (free_tx, free_rx), ledger, outboxes, first)

    async def _open_all(self, opening: Callable[[], Awaitable[None]], gate: anyio.Event) -> None:
        try:
            await opening()
        finally:
            gate.set()

    async def _accepted(self, gate: anyio.Event) -> bool:
        """Wait for every engine's answer to the begin; whether the version may still go."""
        self._gate = None
        with anyio.move_on_after(2 * self.timeout) as scope:  # a backstop: links time out
            await gate.wait()
        if scope.cancelled_caught:
            raise SyncTimeoutError(
                f"no answer to the begin within {2 * self.timeout:g}s", version=self.version
            )
        return not self.vote.hopeless

    async def _pack_stage(
        self,
        plans: Iterator[BucketPlan],
        ring: tuple[Sending[int], Receiving[int]],
        ledger: BufferLedger[PackedBucket],
        outboxes: dict[str, Sending[PackedBucket]],
        first: PackedAhead | None,
    ) -> None:
        freed, free = ring
        try:
            while self.vote.live and not (self._follow and self.vote.hopeless):
                try:  # no checkpoint when a buffer is free: the packing starts first
                    index = free.receive_nowait()
                except anyio.WouldBlock:
                    index = await self._free_buffer(free)
                packed: PackedBucket | None
                if first is not None and first.plan is not None:  # packed as it was read
                    assert index == FIRST_BUFFER, "every buffer is free when a version starts"
                    packed = await self._encoded(first.plan, index)
                    first = None
                elif self.plane.prepacked:
                    packed = await self._stored_next(plans, index)
                else:
                    packed = await anyio.to_thread.run_sync(
                        self._pack_next, plans, index, limiter=self._limiter
                    )
                if self._sent_first is not None:
                    packed = self._confirmed_first(packed)
                if packed is None:
                    return await self._end_packing(outboxes)
                if self._gate is not None and not await self._accepted(self._gate):
                    return  # refused under policy 'all': bucket 1 packed, never published
                if not packed.direct:
                    await self.plane.publish(index, packed.plan.used)
                live = self.vote.live + self._following
                ledger.hold(index, live, packed)
                for name in live:
                    try:
                        outboxes[name].send_nowait(packed)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        # the engine's stage is failing and not yet counted out: let go
                        if ledger.release(index, name) is not None:
                            freed.send_nowait(index)
                if getattr(plans, "done", False):  # that was the last plan (a layout's)
                    return await self._end_packing(outboxes)
        finally:
            for outbox in outboxes.values():
                outbox.close()

    def _confirmed_first(self, packed: PackedBucket | None) -> PackedBucket:
        """Bucket 1 as read, marked sent: it must be the very message sent before the read.

        (The sender sends it early only where the read reuses the same plan; this is the
        check that the bytes the engines already have are the version's.) Raises
        :class:`EarlyBucketMismatch` otherwise.
        """
        sent, self._sent_first = self._sent_first, None
        if packed is None or packed.seq != 1 or packed.payload != sent:
            raise EarlyBucketMismatch(
                "bucket 1 as read is not the one sent before the read", version=self.version
            )
        return replace(packed, sent=True)

    async def _free_buffer(self, free: Receiving[int]) -> int:
        """The next buffer every engine let go of.

        Each engine's acks are awaited with the timeout, and a failed engine lets go of its
        buffers; this bound is only a backstop, so it never fires first.
        """
        with anyio.move_on_after(2 * self.timeout):
            return await free.receive()
        held = ", ".join(self.vote.live)
        raise SyncTimeoutError(
            f"no buffer freed within {2 * self.timeout:g}s by {held}", version=self.version
        )

    async def _end_packing(self, outboxes: dict[str, Sending[PackedBucket]]) -> None:
        """Every bucket is packed: the links' closing messages go, then the trainer goes on.

        The links' queues close (each sends its closing messages), the plane's sends are
        waited for, and the trainer is told its tensors are free. The closing messages the
        stream sends here need not wait for the plane: each engine checks that it received
        every bucket whole before it prepares (a collective plane's commit is not among
        them: see ``StreamRun._tail_ends``).
        """
        self.finished = True
        for outbox in outboxes.values():
            outbox.close()
        await self.plane.drain()  # sends still reading
        if self.packed is not None and not self._direct_sent:
            self.packed.set()  # the trainer may change its tensors again

    def _pack_next(self, plans: Iterator[BucketPlan], index: int) -> PackedBucket | None:
        """Plan, pack and encode the next bucket into buffer ``index`` (a worker thread)."""
        plan = next_plan(plans, self.version)
        return None if plan is None else self._pack_one(plan, index)

    async def _stored_next(self, plans: Iterator[BucketPlan], index: int) -> PackedBucket | None:
        """The next bucket of a :attr:`~SenderPlane.prepacked` plane, ``index`` its window slot.

        Nothing to read or copy: a bucket :func:`~aiosync.core.where_to_run.on_loop` allows is
        encoded here, after a checkpoint that lets the link stages send what is queued; a larger
        one in a worker thread.
        """
        plan = next_plan(plans, self.version)
        if plan is None:
            return None
        if not on_loop(entries=len(plan.specs)):
            return await anyio.to_thread.run_sync(
                self._pack_one, plan, index, limiter=self._limiter
            )
        await anyio.lowlevel.checkpoint()
        return self._pack_one(plan, index)

    def _pack_one(self, plan: BucketPlan, index: int) -> PackedBucket:
        """Pack and encode ``plan`` into buffer ``index``."""
        pack_plan(self.plane, index, plan, self.version)
        packed = self._packed(plan, index)
        if self._gate is None:  # nothing left before publishing: a collective queues its send
            self.plane.queue(index)
        return packed

    async def _encoded(self, plan: BucketPlan, ring: int) -> PackedBucket:
        """Bucket 1, packed already: its message encoded after the begin left.

        On the loop where the planner knew the manifest's entries (a few slots to make);
        in a worker thread where each tensor is looked up in a given manifest.
        """
        await anyio.lowlevel.checkpoint()  # the link stages send the begin first
        if self.manifest is not None and len(plan.entries) != len(plan.specs):
            return await anyio.to_thread.run_sync(self._packed, plan, ring)
        return self._packed(plan, ring)

    def _packed(self, plan: BucketPlan, ring: int) -> PackedBucket:
        """A packed bucket counted and its message encoded (``ring``: the buffer it took)."""
        index = ring  # the buffer the message names: the ring's, or a direct plan's
        self.sent_buckets += 1
        tensors = plan.whole_tensors
        self.sent_tensors += tensors
        seq = self.sent_buckets
        direct = False
        if isinstance(plan, DirectPlan) and plan.regions:  # a direct plan: no ring buffer used
            direct = self._direct_sent = True
            index = plan.buffer
        elif isinstance(plan, StoredPlan):  # its bytes lie in a buffer of their own already
            index = plan.buffer
        if self.manifest is not None and len(plan.entries) == len(plan.specs):
            # the planner read the manifest with the tensors: entries known, no lookups;
            # a plan reused from the last version brings the slots made for it then
            if plan.slots is None:
                pairs = zip(plan.entries, plan.specs, strict=True)
                plan.slots = [Slot(entry, s.offset, s.nbytes, s.start) for entry, s in pairs]
            payload = bucket_payload(self.version, seq, index, plan, plan.slots)
        elif self.manifest is not None:
            slots = [self._slot(spec) for spec in plan.specs]
            payload = bucket_payload(self.version, seq, index, plan, slots)
        else:
            payload = bucket_payload(self.version, seq, index, plan, None)
        return PackedBucket(seq, ring, payload, plan, tensors, plan.payload_bytes, direct)

    def _slot(self, spec: TensorSpec) -> Slot:
        if self._entries is None:
            self._entries = {meta.name: i for i, meta in enumerate(self.manifest or ())}
        entry = self._entries.get(spec.name)
        if entry is None:
            raise MismatchError("tensor is not in the version's manifest", tensor=spec.name)
        return Slot(entry, spec.offset, spec.nbytes, spec.start)
