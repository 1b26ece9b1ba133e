"""The collective data plane: buckets broadcast from the trainer to engines on other devices.

The trainer is rank 0 of a side process group (:func:`aiosync.collectives.init_process_group`,
NCCL on GPUs, Gloo on CPUs); each engine takes the next free rank when it opens the plane
from the hello. The pipeline is unchanged: :meth:`CollectiveSenderPlane.pack` fills a
buffer, :meth:`CollectiveSenderPlane.publish` queues its broadcast on the group's executor
thread and returns, the bucket message goes to every engine, and each engine's
:meth:`CollectiveReceiverPlane.view` posts the matching receive when it sees that message.
Publishing never waits for the broadcast it queued (the engines only join it once the bucket
message reached them), so bucket ``k + 1`` is packed while bucket ``k`` is broadcast.

Two modes, chosen by :attr:`CollectiveOptions.per_tensor`: one broadcast of the packed
bucket (flattened, the default), or one broadcast per tensor straight from the trainer's
tensors (no packing copy on the trainer; each tensor lands in its slot of the engine's
buffer). Both go through the same manifest, bucket acks and fleet commit.

Every collective runs under a deadline of ``timeout`` seconds (Gloo gives up by itself; an
NCCL communicator is aborted by the executor). After a failure the group is broken: later
buckets fail at once, the version is not committed, and the trainer reconnects with a new
sender (a new group). An engine that refuses a bucket does not join its broadcast, so
under this plane a refusal fails the version for the whole group.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from aiosync.collectives import ops
from aiosync.collectives.executor import Deadline, GroupExecutor
from aiosync.collectives.process_group import init_process_group
from aiosync.collectives.rendezvous import (
    LOOPBACK,
    host_store,
    interface_address,
    new_token,
    token_store,
    valid_host,
)
from aiosync.core.errors import SyncTimeoutError, UsageError
from aiosync.core.layout import BucketPlan, is_plain, pack_bucket, tensor_bytes
from aiosync.core.wire import CollectivePlaneSpec
from aiosync.planes.collective_receiver import (
    BACKENDS,
    MAX_TIMEOUT_MS,
    MAX_WORLD,
    CollectiveReceiverPlane,
    check_spec,
    joined_group,
)

log = logging.getLogger(__name__)

__all__ = [
    "CollectiveOptions",
    "CollectiveReceiverPlane",
    "CollectiveSenderPlane",
    "check_spec",
]


@dataclass(frozen=True)
class CollectiveOptions:
    """How a trainer broadcasts buckets to ``engines`` engine ranks (world size 1 + that).

    ``backend``: ``"nccl"`` or ``"gloo"`` (default: NCCL for a CUDA device, else Gloo).
    The rendezvous store listens on ``host`` (an IP address, loopback by default) or on
    the address of network interface ``interface``. ``per_tensor``: one broadcast per
    tensor instead of one per packed bucket. ``timeout`` (seconds) bounds the rendezvous
    and each broadcast. ``overlap`` (NCCL, flattened): engines copy bucket k into their
    model while they receive bucket k + 1 (their sinks then wait for the GPU once, at
    commit, as with the CUDA IPC plane's events).
    """

    engines: int
    backend: str | None = None
    host: str = LOOPBACK
    interface: str | None = None
    per_tensor: bool = False
    timeout: float = 60.0
    overlap: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.engines < MAX_WORLD:
            raise ValueError(f"engines must be in [1, {MAX_WORLD}), got {self.engines}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.timeout * 1000 <= MAX_TIMEOUT_MS:
            raise ValueError(f"timeout must be positive and at most a day, got {self.timeout}")
        valid_host(self.host)


class CollectiveSenderPlane:
    """The trainer's side: rank 0 of a new side group, a ring of buffers, broadcasts."""

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
        wait = timedelta(seconds=options.timeout)
        self._hosted = host_store(host, timeout=wait)
        self._token = new_token()
        self._name = f"aiosync-{uuid.uuid4().hex}"
        self._buffers: list[torch.Tensor] = []
        if not options.per_tensor:
            self._buffers = [
                torch.empty(capacity, dtype=torch.uint8, device=self.device) for _ in range(count)
            ]
        self._segments: dict[int, list[torch.Tensor]] = {}
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._executor = GroupExecutor(self._name, join_timeout=options.timeout)
        self._executor.start()
        world, store = 1 + options.engines, token_store(self._hosted.store, self._token)

        def join() -> None:
            self._executor.group = init_process_group(
                self.backend, store=store, world_size=world, rank=0, group_name=self._name,
                timeout=wait,
            )  # fmt: skip

        self._joined = self._executor.submit(join)

    @property
    def spec(self) -> CollectivePlaneSpec:
        """The store's address, the token, the group and the buffers (for the hello)."""
        return CollectivePlaneSpec(
            backend=self.backend,
            host=self._hosted.host,
            port=self._hosted.port,
            token=self._token,
            group=self._name,
            world_size=1 + self.options.engines,
            count=self._count,
            capacity=self._capacity,
            per_tensor=self.options.per_tensor,
            timeout_ms=round(self.options.timeout * 1000),
            overlap=self.options.overlap,
        )

    @property
    def capacity(self) -> int:
        """Bytes of each buffer."""
        return self._capacity

    @property
    def count(self) -> int:
        """Number of buffers (broadcasts in flight at most)."""
        return self._count

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Fill buffer ``index`` (or, per tensor, keep the tensors' bytes); blocking.

        Waits first for the broadcast last queued from that buffer.
        """
        previous = self._inflight.pop(index, None)
        if previous is not None:
            self._executor.result(
                previous, deadline=Deadline.after(self.options.timeout), what="broadcast"
            )
        if self.options.per_tensor:
            self._segments[index] = _segments(plan, self.device)
            return
        if self._stream is None:
            pack_bucket(self._buffers[index], plan)
            return
        # a side stream: the group's thread enqueues broadcasts on the default stream, and
        # NCCL would wait for a pack queued there; the pack still follows the trainer's work
        self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._stream):
            pack_bucket(self._buffers[index], plan)
        self._stream.synchronize()

    async def publish(self, index: int, used: int) -> None:
        """Queue the broadcast of buffer ``index`` and return (engines join it on the message).

        Raises the group's error if an earlier broadcast failed.
        """
        self._raise_failed()
        deadline = Deadline.after(self.options.timeout)
        job: Callable[[], None]
        if self.options.per_tensor:
            parts = self._segments.pop(index)
            job = lambda: ops.broadcast_many(self._group(), parts, 0, deadline)  # noqa: E731
        else:
            data = self._buffers[index][:used]
            job = lambda: ops.broadcast(self._group(), data, 0, deadline)  # noqa: E731
        self._inflight[index] = self._executor.submit(job)

    def _group(self) -> torch.distributed.ProcessGroup:
        return joined_group(self._executor, self._joined, self._name)

    def _raise_failed(self) -> None:
        for future in [self._joined, *self._inflight.values()]:
            if future.done() and future.exception() is not None:
                self._executor.result(future, deadline=Deadline.after(1), what="broadcast")

    def close(self) -> None:
        """Leave the group and stop the store; never waits for a broadcast.

        A broadcast still in flight (an engine that never joined it) breaks the group
        first, so an NCCL communicator is aborted and no kernel is left waiting.
        """
        if any(not future.done() for future in [self._joined, *self._inflight.values()]):
            error = SyncTimeoutError(f"group {self._name} closed with a broadcast in flight")
            self._executor.fail(error)
        self._executor.close(wait=False)
        self._hosted.close()
        self._buffers.clear()
        self._segments.clear()


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
