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

Host time per bucket is kept short, since with two buffers the next pack can be queued
only after an engine's ack: plain tensors on the buffer's device are queued by address
(``cudaMemcpyAsync``, spread over two streams: :mod:`aiosync.planes.cuda_copies`), as are
the engine's copies out of the buffer (:mod:`aiosync.engine.bulk_apply`). ``python -m
aiosync.bench.cuda_timeline`` shows where a version's time goes, per bucket, on both sides.
"""

from __future__ import annotations

import logging

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import CudaLegacyPlaneSpec
from aiosync.planes.cuda_copies import DeviceCopies, hint_scope, plain_jobs, wait_gate
from aiosync.planes.cuda_runtime import IPC_HANDLE_BYTES, DeviceMemory

log = logging.getLogger(__name__)


def _new_event(device: int) -> tuple[torch.cuda.Event, bytes]:
    """An interprocess event on ``device`` and its IPC handle."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        return event, bytes(event.ipc_handle())  # type: ignore[no-untyped-call]


def _open_event(device: int, handle: bytes) -> torch.cuda.Event:
    if len(handle) != IPC_HANDLE_BYTES:
        raise AiosyncError(f"a CUDA IPC event handle has {IPC_HANDLE_BYTES} bytes")
    event: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]
    return event


def _pack(
    buffer: DeviceMemory, plan: BucketPlan, stream: torch.cuda.Stream, copies: DeviceCopies
) -> None:
    """Queue the bucket's copies into ``buffer`` on ``stream`` (the current one).

    Plain tensors on the buffer's device are queued by address, spread over two streams
    (:mod:`aiosync.planes.cuda_copies`): a few µs of host time each, where ``copy_`` and
    its views take tens, so the host queues a bucket well before the device is done with
    the last. Any other tensor (another device, the CPU, not contiguous) goes through
    :func:`pack_bucket`.
    """
    jobs, rest = plain_jobs(buffer.tensor, plan)
    copies.queue(jobs, stream)
    if rest.specs:
        pack_bucket(buffer.tensor, rest)


class CudaLegacySenderPlane:
    """A ring of ``count`` own device buffers of ``capacity`` bytes, packed without host waits.

    :meth:`begin_version` (on the caller's thread) takes the caller's current stream for the
    version's packing; :meth:`consumed` (on an engine's ack) names the engine event the
    buffer's next packing waits on.
    """

    def __init__(self, device: torch.device, count: int, capacity: int) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = index
        self._capacity = capacity
        self._buffers: list[DeviceMemory] = []
        try:
            for _ in range(count):
                self._buffers.append(DeviceMemory.allocate(capacity, index))
        except BaseException:
            self.close()
            raise
        made = [_new_event(index) for _ in range(count)]
        self._packed = [event for event, _ in made]
        self._spec = CudaLegacyPlaneSpec(
            device=index,
            size=capacity,
            handles=[buffer.handle for buffer in self._buffers],
            events=[handle for _, handle in made],
        )
        self._stream: torch.cuda.Stream | None = None
        self._waits: list[list[bytes]] = [[] for _ in range(count)]
        self._peer_events: dict[bytes, torch.cuda.Event] = {}
        self._copies = DeviceCopies(index)

    @property
    def spec(self) -> CudaLegacyPlaneSpec:
        """The buffers' and the packing events' IPC handles."""
        return self._spec

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

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Queue the bucket's copies after the engines' last reads of the buffer; no wait."""
        stream = self._stream or torch.cuda.current_stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(stream), hint_scope():
            waits, self._waits[index] = self._waits[index], []
            for handle in waits:
                event = self._peer_events.get(handle)
                if event is None:
                    event = self._peer_events[handle] = _open_event(self._device, handle)
                wait_gate(stream, event)
            _pack(self._buffers[index], plan, stream, self._copies)
            self._packed[index].record(stream)

    async def publish(self, index: int, used: int) -> None:
        """Nothing to do: engines read the same device memory."""

    def close(self) -> None:
        """Free the buffers once the device is idle (idempotent)."""
        self._copies.close()
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()
        self._peer_events.clear()


class CudaLegacyReceiverPlane:
    """An engine's mappings of a trainer's buffers, and the events that order its reads."""

    views_at_once = True  # a view never waits on the host (engine.quick_apply)

    def __init__(self, spec: CudaLegacyPlaneSpec, device: torch.device) -> None:
        index = device.index if device.type == "cuda" and device.index is not None else None
        self._device = spec.device if index is None else index
        if spec.events and len(spec.events) != len(spec.handles):
            raise AiosyncError(f"{len(spec.events)} events for {len(spec.handles)} CUDA buffers")
        self._buffers: list[DeviceMemory] = []
        try:
            for handle in spec.handles:
                self._buffers.append(DeviceMemory.open(handle, spec.size, self._device))
            self._packed = [_open_event(self._device, handle) for handle in spec.events]
        except BaseException:
            self.close()
            raise
        made = [_new_event(self._device) for _ in spec.events]
        self._applied = [event for event, _ in made]
        self.events = [handle for _, handle in made]

    def view(self, index: int, used: int) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index``, after the trainer's packing.

        This thread's stream is made to wait on the trainer's event (queued, no host wait).
        """
        if self._packed:
            wait_gate(torch.cuda.current_stream(self._device), self._packed[index])
        return self._buffers[index].tensor[:used]

    def applied(self, index: int) -> None:
        """The bucket's copies are queued on this thread's stream: record ``applied[index]``."""
        if self._applied:
            self._applied[index].record(torch.cuda.current_stream(self._device))

    def close(self) -> None:
        """Unmap the buffers once the device is idle (idempotent)."""
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()
