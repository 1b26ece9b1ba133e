"""The CUDA data plane: aiosync's own device buffers, chained by CUDA IPC events.

Buffers come from ``cudaMalloc`` (:mod:`aiosync.planes.cuda_runtime`), so they export legacy
IPC handles whatever allocator either process uses (``expandable_segments`` included) and
need no ``CAP_SYS_PTRACE``.

No host thread waits for the device per bucket. Per buffer ``i``, the trainer owns an
interprocess event ``packed[i]`` and each engine one ``applied[i]``, exchanged once per
session as plain bytes (the trainer's in the hello's plane spec, the engine's in its ready):

* the trainer packs buffer ``i`` on its current CUDA stream (where its weights were made),
  after that stream waited on every engine's ``applied[i]`` from the buffer's last use, then
  records ``packed[i]`` and sends the bucket message;
* the engine's applying stream waits on ``packed[i]``, queues the copies into the model,
  records ``applied[i]`` and acks at once; its one host wait per version is the sink's
  at commit.

An event wait covers the last record made before it, and each record is made before the
message that leads to the wait is sent, so the order holds across the two processes.

Bucket 1 may go before it is packed (with the ``begin`` sent before the read:
:mod:`aiosync.pipeline.early_begin`), so that the engine queues its copies while the
trainer still reads its tensors. An event cannot order that (the engine's wait would cover
the last version's record), so the trainer also owns counters, words of its own device
memory, one per engine session (:mod:`aiosync.planes.cuda_counters`;
:meth:`CudaSenderPlane.spec_for_link` hands each its word):
:meth:`CudaSenderPlane.arm` gives the value the bucket's message names
(``Bucket.after``), the buffer's next pack sets every engine's word to it on the packing
stream once its copies are queued, and each engine's stream waits until its word reaches
it (:meth:`CudaReceiverPlane.wait_after`). The trainer only ever writes its own
memory; should an engine's session end while its stream still waits, the engine sets its
own word when it closes the plane (never another engine's).

Unordered (``ordered=False``, the colocated topologies'): no events and no counters;
:meth:`CudaSenderPlane.pack` returns once the bytes are in place, and the engine, seeing a
spec without events, reads at once and synchronises before it acks.

Host time per bucket is kept short, since with two buffers the next pack can be queued
only after an engine's ack: plain tensors on the buffer's device are queued by address
(``cudaMemcpyAsync``, spread over two streams: :mod:`aiosync.planes.cuda_copies`), as are
the engine's copies out of the buffer (:mod:`aiosync.engine.bulk_apply`). ``python -m
benchmarks.cuda_timeline`` shows where a version's time goes, per bucket, on both sides.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import torch

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import CudaPlaneSpec
from aiosync.planes.base import BucketContext, ReceiverPlane, SenderPlane
from aiosync.planes.cuda_copies import CounterGate, DeviceCopies, plain_jobs, wait_gate
from aiosync.planes.cuda_counters import reached, write_now, write_value
from aiosync.planes.cuda_runtime import IPC_HANDLE_BYTES, DeviceMemory

log = logging.getLogger(__name__)

COUNTER_BYTES = 4096
"""Bytes of the trainer's counter memory: a 32-bit word for each of up to
:data:`COUNTER_WORDS` engine sessions over the plane's life (later ones get none, and
their versions send bucket 1 after the read)."""
COUNTER_WORDS = COUNTER_BYTES // 4
"""Counter words one sender plane hands out (one per engine session)."""
COUNTER_MAX = 1 << 31
"""Counter values a bucket may name: 1 to this, each above the last (the word wraps at 2**32)."""


def new_event(device: int) -> tuple[torch.cuda.Event, bytes]:
    """An interprocess event on ``device`` and its IPC handle."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        return event, bytes(event.ipc_handle())  # type: ignore[no-untyped-call]


def open_event(device: int, handle: bytes) -> torch.cuda.Event:
    """A peer's interprocess event, opened on ``device`` from its IPC handle."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise AiosyncError(f"a CUDA IPC event handle has {IPC_HANDLE_BYTES} bytes")
    event: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]
    return event


def allocate(size: int, device: int) -> DeviceMemory:
    """``size`` bytes of own device memory, tried again once torch's cache is emptied.

    (``cudaMalloc`` cannot use the blocks torch's caching allocator holds free.)
    """
    try:
        return DeviceMemory.allocate(size, device)
    except AiosyncError as exc:
        log.info("%s: emptying torch's CUDA cache and trying again", exc)
        torch.cuda.empty_cache()
        return DeviceMemory.allocate(size, device)


def _pack(
    buffer: DeviceMemory,
    plan: BucketPlan,
    stream: torch.cuda.Stream,
    copies: DeviceCopies,
    context: BucketContext | None = None,
) -> None:
    """Queue the bucket's copies into ``buffer`` on ``stream`` (the current one).

    Plain tensors on the buffer's device are queued by address (spread over two streams,
    after the gates in ``context``: :mod:`aiosync.planes.cuda_copies`); any other tensor
    (another device, the CPU, not contiguous) goes through :func:`pack_bucket`.
    """
    jobs, rest = plain_jobs(buffer.tensor, plan)
    copies.queue(jobs, stream, context)
    if rest.specs:
        pack_bucket(buffer.tensor, rest)


class CudaSenderPlane(SenderPlane):
    """A ring of ``count`` own device buffers of ``capacity`` bytes, packed without host waits.

    :meth:`begin_version` (on the caller's thread) takes the caller's current stream for the
    version's packing; :meth:`consumed` (on an engine's ack) names the engine event the
    buffer's next packing waits on. ``ordered=False``: no events nor counters, and
    :meth:`pack` returns with the bytes in place (the colocated topologies' buffers).
    """

    def __init__(
        self, device: torch.device, count: int, capacity: int, *, ordered: bool = True
    ) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = index
        self._capacity = capacity
        self._ordered = ordered
        self._buffers: list[DeviceMemory] = []
        self._counter: DeviceMemory | None = None
        self._armed: tuple[int, int, list[int]] | None = None  # (buffer, value, words)
        self._words = 0  # counter words handed out (never again: a word is one session's)
        self._count = 0  # the counter's last value handed out
        self._copies = DeviceCopies(index)
        self._peer_events: dict[bytes, torch.cuda.Event] = {}
        try:
            for _ in range(count):
                self._buffers.append(allocate(capacity, index))
            if ordered:
                self._counter = allocate(COUNTER_BYTES, index)
                with torch.cuda.device(index):
                    self._counter.tensor.zero_()
                    torch.cuda.current_stream(index).synchronize()  # type: ignore[no-untyped-call]
        except BaseException:
            self.close()
            raise
        made = [new_event(index) for _ in range(count)] if ordered else []
        self._packed = [event for event, _ in made]
        self._spec = CudaPlaneSpec(
            device=index,
            size=capacity,
            handles=[buffer.handle for buffer in self._buffers],
            events=[handle for _, handle in made],
            counter=b"" if self._counter is None else self._counter.handle,
        )
        self._stream: torch.cuda.Stream | None = None
        self._waits: list[list[bytes]] = [[] for _ in range(count)]

    @property
    def spec(self) -> CudaPlaneSpec:
        """The buffers' and the packing events' IPC handles."""
        return self._spec

    @property
    def ordered(self) -> bool:
        """Whether packing and reading are chained by events (else :meth:`pack` waits)."""
        return self._ordered

    @property
    def capacity(self) -> int:
        """Bytes of each buffer."""
        return self._capacity

    @property
    def count(self) -> int:
        """Number of buffers."""
        return len(self._buffers)

    def begin_version(self) -> None:
        """Pack this version on the calling thread's current stream (the trainer's)."""
        self._stream = torch.cuda.current_stream(self._device)

    def consumed(self, index: int, events: list[bytes]) -> None:
        """An engine acked buffer ``index``; ``events`` are its ``applied`` handles.

        An engine without events synchronised before acking: nothing to wait on.
        """
        if index < len(events):
            self._waits[index].append(events[index])

    def spec_for_link(self) -> tuple[CudaPlaneSpec, int | None]:
        """The spec for one more engine session, with a counter word of its own, and the word.

        Each word is handed out once, so an engine that sets its word when its session
        ends (:meth:`CudaReceiverPlane.close`) never lets another engine's reads go.
        Past :data:`COUNTER_WORDS`, or unordered: no counter (None).
        """
        if self._counter is None or self._words >= COUNTER_WORDS:
            return msgspec.structs.replace(self._spec, counter=b""), None
        word, self._words = self._words, self._words + 1
        return msgspec.structs.replace(self._spec, counter_word=word), word

    def arm(self, index: int, words: Sequence[int]) -> int:
        """The counter value a bucket sent ahead of its packing into buffer ``index`` names.

        The buffer's next :meth:`pack` sets each of the engines' ``words`` to it (or
        :meth:`disarm`, if no pack comes). One bucket at a time. Call on the packing
        stream's thread after :meth:`begin_version`, before the bucket is sent: the packing
        stream waits now for the engines' reads of the buffer's last use, for an engine
        may record the same event again, behind the counter, as soon as it has the bucket
        (a wait queued at the pack would then cover that record, and wait for itself).
        """
        if self._armed is not None:
            raise AiosyncError("a bucket sent ahead is still to be packed")
        if any(not 0 <= word < self._words for word in words):
            raise AiosyncError(f"counter words {list(words)} were not all handed out")
        stream = self._stream or torch.cuda.current_stream(self._device)
        with torch.cuda.device(self._device):
            for event in self._last_reads(index):
                stream.wait_event(event)
        self._count += 1
        self._armed = (index, self._count, list(words))
        return self._count

    def _last_reads(self, index: int) -> list[torch.cuda.Event]:
        """The engines' events of buffer ``index``'s last use, taken (each once)."""
        waits, self._waits[index] = self._waits[index], []
        events = []
        for handle in waits:
            event = self._peer_events.get(handle)
            if event is None:
                event = self._peer_events[handle] = open_event(self._device, handle)
            events.append(event)
        return events

    def disarm(self) -> None:
        """Set the counters now if the bucket sent ahead was not packed (its read failed).

        On the packing stream, after any earlier pack's own setting of them, so a word never
        goes back. The engines' reads that wait on it then go on (the version is withdrawn).
        """
        armed, self._armed = self._armed, None
        if armed is not None:
            stream = self._stream or torch.cuda.current_stream(self._device)
            with torch.cuda.device(self._device):
                self._set(stream, armed[1], armed[2])

    def _set(self, stream: torch.cuda.Stream, value: int, words: list[int]) -> None:
        """Queue on ``stream`` the setting of each of ``words`` to ``value``."""
        if self._counter is not None:
            base = self._counter.tensor.data_ptr()
            for word in words:
                write_value(stream.cuda_stream, base + 4 * word, value)

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Queue the bucket's copies after the engines' last reads of the buffer; no wait.

        If this buffer was armed (:meth:`arm`), the engines' counter words are set behind
        the copies, on the same stream. Unordered: waits until the copies are done.
        """
        stream = self._stream or torch.cuda.current_stream(self._device)
        context = BucketContext()
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            try:
                for event in self._last_reads(index):
                    wait_gate(stream, event, context)
                _pack(self._buffers[index], plan, stream, self._copies, context)
                if self._packed:
                    self._packed[index].record(stream)
            finally:  # a bucket sent ahead: its reads may go (after a failure too)
                armed = self._armed
                if armed is not None and armed[0] == index:
                    self._armed = None
                    self._set(stream, armed[1], armed[2])
            if not self._ordered:  # the engine reads at once: the bytes must be there
                stream.synchronize()  # type: ignore[no-untyped-call]

    async def publish(self, index: int, used: int) -> None:
        """Nothing to do: engines read the same device memory."""

    def close(self) -> None:
        """Free the buffers once the device is idle (idempotent)."""
        try:
            self.disarm()
        finally:
            counter, self._counter = self._counter, None
            try:
                if counter is not None:
                    counter.close()
            finally:
                self._copies.close()
                for buffer in self._buffers:
                    buffer.close()
                self._buffers.clear()
                self._peer_events.clear()


class CudaReceiverPlane(ReceiverPlane):
    """An engine's mappings of a trainer's buffers, and the events (if any) that order its reads."""

    views_at_once = True  # a view never waits on the host (engine.quick_apply)

    def __init__(self, spec: CudaPlaneSpec, device: torch.device) -> None:
        index = device.index if device.type == "cuda" and device.index is not None else None
        self._device = spec.device if index is None else index
        if spec.events and len(spec.events) != len(spec.handles):
            raise AiosyncError(f"{len(spec.events)} events for {len(spec.handles)} CUDA buffers")
        self._buffers: list[DeviceMemory] = []
        self._counter: DeviceMemory | None = None
        self._word = spec.counter_word  # this session's word of the trainer's counters
        self._after = 0  # the last counter value a bucket's reads waited for
        self._waited: torch.cuda.Event | None = None  # recorded behind that wait
        try:
            for handle in spec.handles:
                self._buffers.append(DeviceMemory.open(handle, spec.size, self._device))
            self._packed = [open_event(self._device, handle) for handle in spec.events]
            if spec.counter:
                if not 0 <= spec.counter_word < COUNTER_WORDS:
                    raise AiosyncError(f"counter word {spec.counter_word} (0-{COUNTER_WORDS - 1})")
                self._counter = DeviceMemory.open(spec.counter, COUNTER_BYTES, self._device)
        except BaseException:
            self.close()
            raise
        made = [new_event(self._device) for _ in spec.events]
        self._applied = [event for event, _ in made]
        self.events = [handle for _, handle in made]

    def wait_after(self, value: int, context: BucketContext | None = None) -> None:
        """Make this thread's stream wait until the trainer's counter reaches ``value``.

        For a bucket sent ahead of its packing (``Bucket.after``); the next batch's side
        streams wait too. A value that is not above the last one (up to
        :data:`COUNTER_MAX`), or a trainer without a counter, is a :class:`ProtocolError`.
        """
        if self._counter is None:
            raise ProtocolError("a bucket sent ahead of its packing; the trainer has no counter")
        if not self._after < value <= COUNTER_MAX:
            raise ProtocolError(f"counter value {value} does not follow {self._after}")
        stream = torch.cuda.current_stream(self._device)
        address = self._counter.tensor.data_ptr() + 4 * self._word
        wait_gate(stream, CounterGate(address, value), context)
        self._after = value
        if self._waited is None:
            self._waited = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._waited.record(stream)

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index``, after the trainer's packing.

        This thread's stream is made to wait on the trainer's event (queued, no host wait).
        """
        if self._packed:
            wait_gate(torch.cuda.current_stream(self._device), self._packed[index], context)
        return self._buffers[index].tensor[:used]

    def applied(self, index: int) -> None:
        """The bucket's copies are queued on this thread's stream: record ``applied[index]``."""
        if self._applied:
            self._applied[index].record(torch.cuda.current_stream(self._device))

    def _let_go(self, counter: DeviceMemory) -> None:
        """Set this session's word if a stream still waits on it (the trainer never did)."""
        waited, self._waited = self._waited, None
        if waited is None or waited.query():  # type: ignore[no-untyped-call]
            return
        word = counter.tensor[4 * self._word : 4 * self._word + 4]
        if not reached(word, self._after):
            log.warning("the trainer's counter never reached %d: released", self._after)
            write_now(self._device, word.data_ptr(), self._after)

    def close(self) -> None:
        """Unmap the buffers once the device is idle (idempotent).

        A stream still waiting on the trainer's counter (its session ended before it set
        it) is let go first: the engine sets its own word itself.
        """
        counter, self._counter = self._counter, None
        try:
            if counter is not None:
                try:
                    self._let_go(counter)
                finally:
                    counter.close()
        finally:
            for buffer in self._buffers:
                buffer.close()
            self._buffers.clear()


CudaLegacySenderPlane = CudaSenderPlane
"""The name :class:`CudaSenderPlane` had until the one CUDA plane (``cuda_legacy``)."""
CudaLegacyReceiverPlane = CudaReceiverPlane
"""The name :class:`CudaReceiverPlane` had until the one CUDA plane (``cuda_legacy``)."""
