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
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from aiosync.collectives import ops
from aiosync.collectives.executor import Deadline, GroupExecutor, collective_error
from aiosync.collectives.process_group import init_process_group
from aiosync.collectives.rendezvous import (
    LOOPBACK,
    connect_store,
    host_store,
    interface_address,
    is_token,
    new_token,
    token_store,
    valid_host,
)
from aiosync.core.errors import AiosyncError, ProtocolError, SyncTimeoutError, UsageError
from aiosync.core.layout import BucketPlan, TensorSpec, is_plain, pack_bucket, tensor_bytes
from aiosync.core.limits import Limits
from aiosync.core.wire import CollectivePlaneSpec

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
RANK_KEY = "aiosync-next-rank"
MAX_WORLD = 1 << 14
MAX_TIMEOUT_MS = 24 * 3600 * 1000
_GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class CollectiveOptions:
    """How a trainer broadcasts buckets to ``engines`` engine ranks (world size 1 + that).

    ``backend``: ``"nccl"`` or ``"gloo"`` (default: NCCL for a CUDA device, else Gloo).
    The rendezvous store listens on ``host`` (an IP address, loopback by default) or on
    the address of network interface ``interface``. ``per_tensor``: one broadcast per
    tensor instead of one per packed bucket. ``timeout`` (seconds) bounds the rendezvous
    and each broadcast.
    """

    engines: int
    backend: str | None = None
    host: str = LOOPBACK
    interface: str | None = None
    per_tensor: bool = False
    timeout: float = 60.0

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
        return _joined_group(self._executor, self._joined, self._name)

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


def _joined_group(
    executor: GroupExecutor, joined: concurrent.futures.Future[None], name: str
) -> torch.distributed.ProcessGroup:
    """The group once joined (on the group's thread, so the join has ended by then)."""
    error = joined.exception() if joined.done() else None
    if error is not None:
        raise collective_error(error, f"rendezvous of group {name}", ())
    if executor.group is None:
        raise AiosyncError(f"group {name} was never joined")
    return executor.group


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


def check_spec(spec: CollectivePlaneSpec, limits: Limits | None = None) -> None:
    """Refuse a collective plane spec a peer could abuse (raises :class:`ProtocolError`)."""
    limits = limits or Limits()
    problems = []
    if spec.backend not in BACKENDS:
        problems.append(f"backend {spec.backend!r} is not one of {BACKENDS}")
    try:
        valid_host(spec.host)
    except ValueError as exc:
        problems.append(str(exc))
    if not 0 < spec.port < 65536:
        problems.append(f"port {spec.port} out of range")
    if not is_token(spec.token):
        problems.append("malformed token")
    if not _GROUP_NAME.fullmatch(spec.group):
        problems.append("group name must be 1-128 of [A-Za-z0-9_.-]")
    if not 2 <= spec.world_size <= MAX_WORLD:
        problems.append(f"world size {spec.world_size} not in [2, {MAX_WORLD}]")
    if not 1 <= spec.count <= limits.max_buffers or spec.capacity <= 0:
        problems.append(f"{spec.count} buffers of {spec.capacity} bytes")
    elif spec.count * spec.capacity > limits.max_session_bytes:
        problems.append(f"{spec.count * spec.capacity} bytes of buffers (too many)")
    if not 0 < spec.timeout_ms <= MAX_TIMEOUT_MS:
        problems.append(f"timeout {spec.timeout_ms} ms out of range")
    if problems:
        raise ProtocolError("collective plane refused: " + "; ".join(problems))


class CollectiveReceiverPlane:
    """An engine's side: joins the group (next free rank) and receives each bucket.

    Opening returns at once; the rendezvous runs on the group's thread, so a trainer that
    says hello to several engines in turn is never blocked by the first. ``view`` (called
    when the bucket message arrives, in a worker thread) posts the receive and returns the
    bytes once they are in place. Buffers are allocated on first use.
    """

    def __init__(
        self, spec: CollectivePlaneSpec, device: torch.device, limits: Limits | None = None
    ) -> None:
        check_spec(spec, limits)
        self._spec = spec
        self._timeout = spec.timeout_ms / 1000
        if spec.backend == "nccl":
            if device.type != "cuda":
                raise ProtocolError("an NCCL plane needs an engine on a CUDA device")
            self._device = device
        else:
            self._device = torch.device("cpu")
        self._buffers: dict[int, torch.Tensor] = {}
        self._expected: dict[int, list[TensorSpec]] = {}
        self.rank: int | None = None
        self._executor = GroupExecutor(spec.group, join_timeout=self._timeout)
        self._executor.start()
        self._joined = self._executor.submit(self._join)

    def _join(self) -> None:
        spec, wait = self._spec, timedelta(seconds=self._timeout)
        store = token_store(connect_store(spec.host, spec.port, timeout=wait), spec.token)
        rank = int(store.add(RANK_KEY, 1))
        if not 0 < rank < spec.world_size:
            raise ProtocolError(f"group {spec.group} is full ({spec.world_size - 1} engine ranks)")
        self.rank = rank
        self._executor.group = init_process_group(
            spec.backend, store=store, world_size=spec.world_size, rank=rank,
            group_name=spec.group, timeout=wait,
        )  # fmt: skip
        log.info("joined group %s as rank %d of %d", spec.group, rank, spec.world_size)

    def expect(self, index: int, specs: list[TensorSpec]) -> None:
        """The (checked) specs of the bucket about to arrive in ``index`` (per-tensor mode)."""
        self._expected[index] = specs

    def view(self, index: int, used: int) -> torch.Tensor:
        """Receive bucket ``index`` (``used`` bytes) and return its bytes; blocking."""
        spec = self._spec
        if not 0 <= index < spec.count or not 0 <= used <= spec.capacity:
            raise ProtocolError(f"bucket {index} of {used} bytes is outside the plane")
        buffer = self._buffers.get(index)
        if buffer is None:
            buffer = torch.empty(spec.capacity, dtype=torch.uint8, device=self._device)
            self._buffers[index] = buffer
        data = buffer[:used]
        deadline = Deadline.after(self._timeout)
        job: Callable[[], None]
        if spec.per_tensor:
            specs = self._expected.pop(index, None)
            if specs is None:
                raise UsageError("per-tensor plane: the receiver did not pass the bucket's specs")
            parts = [data[s.offset : s.offset + s.nbytes] for s in specs if s.nbytes]
            job = lambda: ops.broadcast_many(self._group(), parts, 0, deadline)  # noqa: E731
        else:
            job = lambda: ops.broadcast(self._group(), data, 0, deadline)  # noqa: E731
        self._executor.call(job, deadline=deadline, what=f"receive into buffer {index}")
        return data

    def _group(self) -> torch.distributed.ProcessGroup:
        return _joined_group(self._executor, self._joined, self._spec.group)

    def close(self) -> None:
        """Leave the group (without waiting for a blocked collective to end)."""
        self._executor.close(wait=False)
        self._buffers.clear()
