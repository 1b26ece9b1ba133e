"""The collective data plane: buckets broadcast from the trainer to engines on other devices.

The trainer is rank 0 of a side process group (:func:`aiosync.collectives.init_process_group`,
NCCL on GPUs, Gloo on CPUs); each engine takes the next free rank when it opens the plane
from the hello. The pipeline is unchanged: :meth:`CollectiveSenderPlane.pack` fills a
buffer, its broadcast is queued (NCCL: :meth:`CollectiveSenderPlane.queue`, from the
packing thread; Gloo: :meth:`CollectiveSenderPlane.publish` hands it to the group's
thread), the bucket message goes to every engine, and each engine's
:meth:`CollectiveReceiverPlane.view` posts the matching receive when it sees that message.
Nothing waits for a broadcast it queued (the engines only join it once the bucket message
reached them), so bucket ``k + 1`` is packed while bucket ``k`` is broadcast.

NCCL runs with no host wait per bucket on either side: packing, broadcasts, receives and
the engine's copies out are chained on the GPUs by CUDA events
(:mod:`aiosync.collectives.ordered`), the engine acknowledges a bucket once its receive and
copies are queued, and each side waits on the host once per version (the trainer after its
last bucket, each engine before it calls the version whole), under the deadline. A watcher
aborts the communicator if a queued broadcast is not done by its deadline. Gloo is
synchronous: each broadcast runs to its end on the group's thread, under its own timeout.

Two modes, chosen by :attr:`CollectiveOptions.per_tensor`: one broadcast of the packed
bucket (flattened, the default), or one broadcast per tensor straight from the trainer's
tensors (no packing copy on the trainer; each tensor lands in its slot of the engine's
buffer). Both go through the same manifest, bucket acks and fleet commit.

Every collective runs under a deadline of ``timeout`` seconds (Gloo gives up by itself; an
NCCL communicator is aborted). After a failure the group is broken: later buckets fail at
once, the version is not committed, and the trainer reconnects with a new sender (a new
group). A refusal is not a failure of the group: every rank must join every broadcast, so
an engine that refuses a bucket or its version is still sent the version's buckets and
joins their broadcasts, dropping the bytes (:attr:`CollectiveSenderPlane.joins_all`); it
keeps its previous version and is reported, and under policy ``available`` the others
commit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import uuid
from typing import Any

import anyio
import msgspec
import torch

from aiosync.collectives import ops
from aiosync.collectives.executor import Deadline, GroupExecutor
from aiosync.collectives.ordered import OrderedBroadcasts
from aiosync.collectives.rendezvous import interface_address
from aiosync.core.errors import PeerGoneError, SyncTimeoutError, UsageError
from aiosync.core.layout import BucketPlan, is_plain, pack_bucket, tensor_bytes
from aiosync.core.wire import CollectivePlaneSpec
from aiosync.planes.base import SenderPlane
from aiosync.planes.collective_meeting import TrainerMeeting, file_rendezvous, forgetting
from aiosync.planes.collective_options import CollectiveOptions
from aiosync.planes.collective_receiver import CollectiveReceiverPlane, check_spec, joined_group
from aiosync.planes.cuda_copies import DeviceCopies, plain_jobs

log = logging.getLogger(__name__)

__all__ = [
    "CollectiveOptions",
    "CollectiveReceiverPlane",
    "CollectiveSenderPlane",
    "check_spec",
]


class CollectiveSenderPlane(SenderPlane):
    """The trainer's side: rank 0 of a new side group, a ring of buffers, broadcasts.

    NCCL: no host wait per bucket. :meth:`pack` queues the copies on a side stream after
    the trainer's stream and after the buffer's previous broadcast (CUDA events), and the
    trainer's stream waits for the packing (its later writes cannot reach tensors still
    being read); :meth:`queue` (or :meth:`publish`, where the pipeline did not call it)
    queues the broadcast after the packing's event. A watcher aborts the group when a
    broadcast is not done by its deadline, and :meth:`drain` (once per version, after the
    last bucket) waits for the last one. Gloo runs each broadcast to its end on the
    group's thread, under its own timeout.
    """

    joins_all = True
    """Every engine of the group must join every broadcast, even one it refused.

    The pipeline then keeps sending a refusing engine the version's buckets (it joins and
    drops them) and counts its refusal instead of ending its stream.
    """

    def __init__(
        self, device: torch.device, count: int, capacity: int, options: CollectiveOptions
    ) -> None:
        self.device = torch.device(device)
        self.options = options
        self.backend = options.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl" and self.device.type != "cuda":
            raise UsageError("an NCCL collective plane needs a CUDA device")
        if self.backend == "gloo" and self.device.type != "cpu":
            raise UsageError("a Gloo collective plane packs on the CPU; use device='cpu'")
        self._count, self._capacity = count, capacity
        host = interface_address(options.interface) if options.interface else options.host
        file = file_rendezvous(options.rendezvous, options.host, options.interface)
        self._name = f"aiosync-{uuid.uuid4().hex}"
        self._executor = GroupExecutor(self._name, join_timeout=options.timeout)
        self._executor.start()
        self._ordered: OrderedBroadcasts | None = None
        self._stream: torch.cuda.Stream | None = None
        self._copies: DeviceCopies | None = None
        if self.backend == "nccl":
            self._ordered = OrderedBroadcasts(self._executor, self.device)
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            index = self.device.index
            here = torch.cuda.current_device() if index is None else index
            self._copies = DeviceCopies(here, width=1)  # beside broadcasts: one stream
        self._buffers: list[torch.Tensor] = []
        if not options.per_tensor:
            self._buffers = [
                torch.empty(capacity, dtype=torch.uint8, device=self.device) for _ in range(count)
            ]
        for buffer in self._buffers:
            if self._ordered is not None and self._stream is not None:
                self._ordered.hold(buffer)
                buffer.record_stream(self._stream)
        self._segments: dict[int, list[torch.Tensor]] = {}
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        # NCCL, per buffer: a packed bucket's parts, its packed event and the stream to
        # hold behind its broadcast, until queued; then its buffer, until published
        self._ready: dict[int, tuple[list[torch.Tensor], torch.cuda.Event, Any]] = {}
        self._unpublished: set[int] = set()
        self._done: dict[int, torch.cuda.Event] = {}
        self._caller: torch.cuda.Stream | None = None
        try:  # last: nothing after it can fail and leave its private directory behind
            meeting = TrainerMeeting(self._name, file=file, host=host, timeout=options.timeout)
        except BaseException:
            if self._ordered is not None:
                self._ordered.close()
            self._executor.close(wait=False)
            raise
        self._meeting = meeting
        join = functools.partial(meeting.join, self._executor, self.backend, self.device)
        self._joined = self._executor.submit(forgetting(lambda: join(1 + options.engines)))

    @property
    def spec(self) -> CollectivePlaneSpec:
        """Where the group meets, its name, the buffers; no secret (:meth:`spec_for_link`)."""
        meeting = self._meeting
        return CollectivePlaneSpec(
            backend=self.backend,
            host=meeting.host,
            port=meeting.port,
            token=meeting.token,
            group=self._name,
            world_size=1 + self.options.engines,
            count=self._count,
            capacity=self._capacity,
            per_tensor=self.options.per_tensor,
            timeout_ms=round(self.options.timeout * 1000),
            store_path=meeting.path,
        )

    def spec_for_link(self) -> tuple[CollectivePlaneSpec, None]:
        """The spec for one more engine session, with a fresh secret, and no counter word.

        The secret travels only in this session's hello, over the control channel; the
        engine proves its rank with it before the first broadcast, and it proves one rank
        at most.
        """
        return msgspec.structs.replace(self.spec, secret=self._meeting.issue_secret()), None

    @property
    def capacity(self) -> int:
        """Bytes of each buffer."""
        return self._capacity

    @property
    def count(self) -> int:
        """Number of buffers (broadcasts in flight at most)."""
        return self._count

    def begin_version(self) -> None:
        """NCCL: read this version's tensors after the calling thread's stream (the trainer's).

        A broadcast the last version queued but never published (it failed, or was
        cancelled, in between) would pair with this version's first receive, NCCL matching
        broadcasts by their order: the group is broken instead (reconnect with a new
        sender), and this version fails at once.
        """
        if self._ordered is None:
            return
        self._ready.clear()  # packed, never queued: nothing to pair with
        if self._unpublished:
            error = PeerGoneError(
                f"group {self._name}: a broadcast of the last version was queued but its "
                "bucket never went out; the ranks are out of step (reconnect)"
            )
            raise self._executor.fail(error)
        self._caller = torch.cuda.current_stream(self.device)

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Fill buffer ``index`` (or, per tensor, keep the tensors' bytes); blocking.

        Gloo: waits first for the broadcast last queued from that buffer. NCCL: queues the
        packing after that broadcast (CUDA events, no wait for the device); :meth:`queue`
        then queues this bucket's broadcast.
        """
        previous = self._inflight.pop(index, None)
        if previous is not None:
            self._executor.result(
                previous, deadline=Deadline.after(self.options.timeout), what="broadcast"
            )
        if self._ordered is None or self._stream is None or self._copies is None:
            if self.options.per_tensor:
                self._segments[index] = _segments(plan, self.device)
            else:
                pack_bucket(self._buffers[index], plan)
            return
        caller = self._caller or torch.cuda.current_stream(self.device)
        packed = torch.cuda.Event()  # type: ignore[no-untyped-call]
        if self.options.per_tensor:
            with torch.cuda.stream(caller):  # a copy made here is made where the tensors are
                parts = _segments(plan, self.device)
            packed.record(caller)
        else:
            side = self._stream
            side.wait_stream(caller)
            done = self._done.get(index)
            if done is not None:  # the buffer's previous broadcast, queued by queue()
                side.wait_event(done)
            buffer = self._buffers[index]
            jobs, rest = plain_jobs(buffer, plan)
            self._copies.queue(jobs, side)
            if rest.specs:
                with torch.cuda.stream(side):
                    pack_bucket(buffer, rest)
            packed.record(side)
            caller.wait_event(packed)
            parts = [self._buffers[index][: plan.used]]
        then = caller if self.options.per_tensor else None
        self._ready[index] = (parts, packed, then)

    def queue(self, index: int) -> None:
        """NCCL: queue the broadcast of the bucket packed in ``index``; blocking.

        The broadcast waits for the packing on the GPU; the host waits at most for the
        group's thread to be free (its join, at the first version). The pipeline calls it
        from the packing thread once nothing stands between the bucket and its publishing
        (:meth:`publish` does it otherwise); it runs there when the group's thread is idle
        (:meth:`GroupExecutor.call_here`): no hand-over before the bucket message leaves.
        A bucket packed but never queued leaves nothing behind; one queued but never
        published breaks the group at the next version (:meth:`begin_version`).
        """
        ready = self._ready.pop(index, None)
        ordered = self._ordered
        if ready is None or ordered is None:
            return
        parts, packed, then = ready
        deadline = Deadline.after(self.options.timeout)
        what = f"broadcast from buffer {index}"

        def step() -> torch.cuda.Event:
            return ordered.step(self._group(), parts, packed, deadline, what, then=then)

        self._done[index] = self._executor.call_here(step, deadline=deadline, what=what)
        self._unpublished.add(index)

    async def publish(self, index: int, used: int) -> None:
        """Queue the broadcast of buffer ``index`` and return (engines join it on the message).

        NCCL: queued by :meth:`queue` (in a worker thread if the pipeline has not yet).
        Raises the group's error if an earlier broadcast failed.
        """
        self._raise_failed()
        if self._ordered is not None:
            if index in self._ready:
                await anyio.to_thread.run_sync(self.queue, index)
            self._unpublished.discard(index)  # the pipeline sends its message right after
            return
        deadline = Deadline.after(self.options.timeout)
        parts = (
            self._segments.pop(index) if self.options.per_tensor else [self._buffers[index][:used]]
        )
        job = lambda: ops.broadcast_many(self._group(), parts, 0, deadline)  # noqa: E731
        self._inflight[index] = self._executor.submit(job)

    async def drain(self) -> None:
        """Once every bucket is published: return when no broadcast reads the trainer's memory.

        The pipeline calls it before it tells the trainer its tensors are free again (the
        send's ``packed``), and before any engine is told to commit (an engine's receives
        all ending does not show they were paired with this version's broadcasts; see
        ``StreamRun._tail_ends``). NCCL: every broadcast done (:meth:`settle`, in a worker
        thread). Gloo, per tensor: every broadcast done. Gloo, packed: nothing to wait for.
        """
        if self._ordered is not None:
            await anyio.to_thread.run_sync(self.settle)
        elif self.options.per_tensor:
            deadline = Deadline.after(self.options.timeout)
            for future in list(self._inflight.values()):
                await self._executor.wait(future, deadline=deadline, what="broadcast")

    def settle(self) -> None:
        """Block until every broadcast queued so far is done (once per version); NCCL only.

        Raises :class:`~aiosync.core.errors.SyncTimeoutError` (and aborts the group) past
        the plane's timeout, or the group's error if a broadcast failed.
        """
        if self._ordered is not None:
            self._ordered.watch.settle(Deadline.after(self.options.timeout))

    def _group(self) -> torch.distributed.ProcessGroup:
        return joined_group(self._executor, self._joined, self._name)

    def _raise_failed(self) -> None:
        if self._executor.broken is not None:
            raise self._executor.broken
        for future in [self._joined, *self._inflight.values()]:
            if future.done() and future.exception() is not None:
                self._executor.result(future, deadline=Deadline.after(1), what="broadcast")

    def close(self) -> None:
        """Leave the group and stop the store; never waits for a broadcast.

        A broadcast still in flight (an engine that never joined it) breaks the group
        first, so an NCCL communicator is aborted and no kernel is left waiting.
        """
        busy = any(not future.done() for future in [self._joined, *self._inflight.values()])
        if busy or (self._ordered is not None and self._ordered.watch.pending):
            error = SyncTimeoutError(f"group {self._name} closed with a broadcast in flight")
            self._executor.fail(error)
        if self._ordered is not None:
            self._ordered.close()
        self._meeting.close()  # a join still waiting for ranks stops
        self._executor.close(wait=False)
        if self._copies is not None:
            self._copies.close()
        self._buffers.clear()
        self._segments.clear()
        self._ready.clear()
        self._unpublished.clear()
        self._done.clear()


def _segments(plan: BucketPlan, device: torch.device) -> list[torch.Tensor]:
    """Each planned tensor's bytes (or chunk) as flat ``uint8`` on ``device``."""
    parts = []
    for source, spec in zip(plan.tensors, plan.specs, strict=True):
        if spec.nbytes == 0:
            continue
        tensor = source if is_plain(source) else source.contiguous()
        if tensor.device != device:
            tensor = tensor.to(device)
        data = tensor_bytes(tensor)
        parts.append(data if spec.is_whole else data[spec.start : spec.start + spec.nbytes])
    return parts
