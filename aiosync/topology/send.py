"""The trainer's side of a colocated sync: every covered rank hands its engine each bucket.

Per bucket, each rank packs its tensors (one flattened buffer, any mix of dtypes) into a
plane of :mod:`aiosync.planes` (a sealed memfd on the CPU, an own CUDA buffer on a GPU),
describes it as a :class:`~aiosync.core.colocated_parts.RankPart` and gathers the encoded bytes to
its engine's source rank (:func:`~aiosync.topology.gather.gather_bytes`, no pickle). The
source decodes them as hostile input and calls the engine's ``update_weights_from_tensor``
through its :class:`~aiosync.handles.EngineHandle`; then every covered rank learns, in one
all-reduce over the covered ranks, which engines failed the bucket, and all of them raise
or go on together. After the last bucket two more exchanges of parts marked ``last``
prepare the version on every engine, then, only if every engine prepared it, commit it (the
fleet commits together or not at all). Placeholder ranks return at once.

Blocking work (iterating the caller's buckets, packing, the Gloo collectives) runs in worker
threads, on the caller's CUDA device, so the event loop stays free. Every collective is
bounded by its group's timeout (set by :func:`~aiosync.topology.connect.connect_topology`);
an engine call gets :data:`ENGINE_SHARE` of it, so the ranks waiting for the source learn
of a silent engine before their own wait runs out.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from aiosync.core.colocated_parts import (
    FORMAT,
    MAX_PART_BYTES,
    RankPart,
    check_parts,
    decode_part,
    encode_part,
)
from aiosync.core.errors import AiosyncError, ProtocolError, RejectedError, UsageError
from aiosync.core.layout import (
    ALIGNMENT,
    BucketPlan,
    calculate_aligned_size,
    materialize,
    plan_buckets,
)
from aiosync.core.wire import CudaPlaneSpec, CudaRegion, ShmHandle, ShmPlaneSpec
from aiosync.handles import EngineHandle, ObjectHandle, as_engine_handle
from aiosync.handles.ray_actor import is_ray_actor
from aiosync.planes import SenderPlane, create_sender_plane
from aiosync.runtime import unwrap_group
from aiosync.topology.connect import default_timeout
from aiosync.topology.gather import agree_on_failures, gather_bytes
from aiosync.topology.layout import LayoutError

log = logging.getLogger(__name__)

T = TypeVar("T")

ENGINE_SHARE = 0.75
"""Share of the groups' timeout an engine call may take before it counts as failed."""

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ColocatedReport:
    """What one rank did in a colocated sync.

    ``engine`` is None on a placeholder rank (which did nothing). ``buckets`` and ``bytes``
    count this rank's own share; ``source`` says whether this rank called the engine.
    """

    rank: int
    engine: int | None
    source: bool
    buckets: int
    bytes: int
    seconds: float


def _device_now() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return torch.cuda.current_device()
    return None


async def _in_thread(device: int | None, func: Callable[..., T], *args: Any) -> T:
    """Run blocking ``func(*args)`` in a worker thread on CUDA device ``device``."""

    def call() -> T:
        if device is not None:
            torch.cuda.set_device(device)
        return func(*args)

    return await anyio.to_thread.run_sync(call)


def as_handle(engine: object, index: int) -> tuple[EngineHandle, bool]:
    """An engine handle for what the caller holds, and whether it was made here (to close).

    An :class:`EngineHandle` is used as is; an object in this process with an
    ``update_weights_from_tensor`` method (all a colocated sync calls) gets an
    :class:`~aiosync.handles.ObjectHandle`; anything else (a Ray actor) goes through
    :func:`aiosync.handles.as_engine_handle`. Unnamed engines are named by a ``name``
    attribute, if a string, else ``engine <index>``.
    """
    if isinstance(engine, EngineHandle):
        return engine, False
    name = getattr(engine, "name", None)
    name = name if isinstance(name, str) else f"engine {index}"
    if not is_ray_actor(engine) and callable(getattr(engine, "update_weights_from_tensor", None)):
        return ObjectHandle(engine, name=name), True
    return as_engine_handle(engine, name=name), True


def _buffer_of(spec: object) -> ShmHandle | CudaRegion:
    """What a part names of a one-buffer plane: its segment, or its CUDA buffer's handle."""
    if isinstance(spec, ShmPlaneSpec):
        return spec.buffers[0]
    if isinstance(spec, CudaPlaneSpec):
        return CudaRegion(spec.handles[0], spec.size)
    raise UsageError(f"a colocated part cannot name a {type(spec).__name__}")


class _Packer:
    """One rank's buffer for its bucket parts, grown when a bucket needs more."""

    def __init__(self, rank: int, engine: int) -> None:
        self.rank = rank
        self.engine = engine
        self._plane: SenderPlane | None = None
        self._device: torch.device | None = None

    def _ensure(self, device: torch.device, capacity: int) -> SenderPlane:
        plane = self._plane
        if plane is not None and self._device == device and plane.capacity >= capacity:
            return plane
        if plane is not None:
            capacity = max(capacity, plane.capacity if self._device == device else 0)
            self.close()
        self._plane = create_sender_plane(device, 1, capacity)
        self._device = device
        return self._plane

    def pack(self, seq: int, bucket: Bucket) -> RankPart:
        """Pack ``bucket`` and describe it; a failure becomes a part carrying its text."""
        try:
            pairs = [(name, materialize(tensor)) for name, tensor in bucket]
            total = sum(calculate_aligned_size(t.numel() * t.element_size()) for _, t in pairs)
            device = pairs[0][1].device if pairs else torch.device("cpu")
            plane = self._ensure(device, max(ALIGNMENT, total))
            plans = list(plan_buckets(pairs, plane.capacity, max_items=len(pairs) + 1))
            plan = plans[0] if plans else BucketPlan()
            plane.pack(0, plan)
            handle = _buffer_of(plane.spec)
            return RankPart(
                self.rank, self.engine, seq, buffer=handle, used=plan.used, specs=plan.specs
            )
        except (AiosyncError, ValueError, TypeError, RuntimeError) as exc:
            log.warning("rank %d cannot pack bucket %d: %s", self.rank, seq, exc)
            return RankPart(self.rank, self.engine, seq, error=f"cannot pack bucket {seq}: {exc}")

    def close(self) -> None:
        """Release the buffer (idempotent)."""
        if self._plane is not None:
            self._plane.close()
            self._plane = None


async def _overlapped(
    exchange: Coroutine[Any, Any, None], following: Coroutine[Any, Any, RankPart | None]
) -> RankPart | None:
    """Run a bucket's exchange while the next bucket is read and packed; the next part.

    An error of either is raised as itself (not as a group); the other is waited for.
    """
    out: list[RankPart | None] = []

    async def keep() -> None:
        out.append(await following)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep)
            await exchange
    except BaseExceptionGroup as group:
        exc = unwrap_group(group)
        raise exc from exc.__cause__
    return out[0]


def _next(iterator: Any) -> Bucket | str | None:
    """The next bucket, None at the end, or the text of what reading it raised."""
    try:
        return next(iterator, None)  # type: ignore[no-any-return]
    except Exception as exc:  # the others must hear of it, not wait in a collective
        return f"reading the next bucket raised {type(exc).__name__}: {exc}"


class _RankSync:
    """One covered rank's part in one colocated sync."""

    def __init__(
        self, state: dict[str, Any], engines: Sequence[object], version: str | None, timeout: float
    ) -> None:
        self.layout = state["_ipc_layout"]
        self.index: int = state["_ipc_engine_index"]
        self.group = state["_ipc_gather_group"]
        self.src: int = state["_ipc_gather_src"]
        self.sync = state["_ipc_sync_group"]
        self.rank = dist.get_rank()
        self.version = version
        self.timeout = timeout
        self.device = _device_now()
        self.engine_obj = engines[self.index]
        self.handle: EngineHandle | None = None
        self._made = False  # whether the handle was made here (and so is closed here)
        self.engine_name = f"engine {self.index}"

    async def exchange(self, part: RankPart) -> None:
        """Gather ``part`` to the source, which calls the engine; raise if any engine failed."""
        payload = encode_part(part)
        gathered = await _in_thread(
            self.device,
            functools.partial(
                gather_bytes, group=self.group, dst=self.src, max_bytes=MAX_PART_BYTES
            ),
            payload,
        )
        failure: str | None = None
        if gathered is not None:
            try:
                failure = await self.call_engine(gathered, part.seq, part.last)
            except Exception as exc:  # the others wait in the all-reduce below: always join it
                failure = f"{type(exc).__name__}: {exc}"
        flags = [False] * len(self.layout.engines)
        flags[self.index] = failure is not None
        agreed = await _in_thread(
            self.device, functools.partial(agree_on_failures, group=self.sync), flags
        )
        if not any(agreed):
            return
        failed = [i for i, bad in enumerate(agreed) if bad]
        own = f": {failure}" if failure is not None else ""
        names = ", ".join(self.engine_name if i == self.index else f"engine {i}" for i in failed)
        what = f"bucket {part.seq}"
        if part.last:
            what = "the version's commit" if part.commit else "the version's prepare"
        raise RejectedError(
            f"{names} failed {what} (seen on trainer rank {self.rank}){own}",
            peer=self.engine_name if self.index in failed else f"engine {failed[0]}",
        )

    async def call_engine(self, gathered: list[bytes], seq: int, last: bool) -> str | None:
        """The source's call; returns why the bucket failed, or None."""
        try:
            parts = [decode_part(data) for data in gathered]
            check_parts(
                parts, engine=self.index, ranks=self.layout.engines[self.index].ranks, seq=seq
            )
        except ProtocolError as exc:
            return str(exc)
        errors = [f"trainer rank {p.rank}: {p.error}" for p in parts if p.error is not None]
        if errors:
            return "; ".join(errors)
        if self.handle is None:
            self.handle, self._made = as_handle(self.engine_obj, self.index)
            if self.handle.name != self.engine_name:
                self.engine_name = f"{self.engine_name} ({self.handle.name})"
        budget = self.timeout * ENGINE_SHARE
        try:
            with anyio.fail_after(budget):
                result = await self.handle.update_weights_from_tensor(
                    serialized_named_tensors=gathered,
                    load_format=FORMAT,
                    flush_cache=last,
                    weight_version=self.version,
                )
        except TimeoutError:
            return f"no answer within {budget:.1f}s"
        except AiosyncError as exc:
            return str(exc)
        if not result.success:
            return result.message or "failed without a message"
        return None

    async def aclose(self) -> None:
        if self.handle is not None and self._made:
            await self.handle.aclose()


async def send_colocated(
    *,
    bucket_iterator: Iterable[Bucket],
    rollout_engines: Sequence[object],
    worker_state: dict[str, Any],
    weight_version: int | str | None = None,
    timeout: float | None = None,
    overlap: bool = True,
) -> ColocatedReport:
    """Hand every bucket to this rank's engine together with its colocated peers.

    Every trainer rank calls it after :func:`~aiosync.topology.connect.connect_topology`
    (``worker_state``), with the same number of buckets. ``rollout_engines`` are indexed as
    the layout's engines (Ray actors, engine handles or engine objects); only each engine's
    source rank resolves and calls its entry, at call time.
    ``weight_version`` is passed to the engines as given (as a string, as SGLang takes it);
    None lets each engine move to its next version. ``timeout`` only bounds the engine calls
    (default: the ``AIOSYNC_TIMEOUT`` the groups were made with). ``overlap`` (default)
    reads and packs bucket k+1 into a second buffer while bucket k is handed over: faster,
    at the cost of a second bucket and buffer in memory; ``overlap=False`` holds one.

    Raises :class:`RejectedError` on every covered rank, naming the engines, when any engine
    failed a bucket (the source rank's message carries the engine's own text);
    :class:`UsageError` without a connected topology. A placeholder rank returns at once.
    """
    started = time.perf_counter()
    if "_ipc_layout" not in worker_state:
        raise UsageError("no colocated topology: call connect_colocate_topology first")
    rank = dist.get_rank()
    index = worker_state["_ipc_engine_index"]
    if index is None:
        return ColocatedReport(rank, None, False, 0, 0, 0.0)
    if len(rollout_engines) != len(worker_state["_ipc_layout"].engines):
        raise LayoutError(
            f"{len(rollout_engines)} rollout engines for a layout of "
            f"{len(worker_state['_ipc_layout'].engines)}"
        )
    version = None if weight_version is None else str(weight_version)
    state = _RankSync(
        worker_state,
        rollout_engines,
        version,
        timeout or worker_state.get("_ipc_timeout") or default_timeout(),
    )
    packers = [_Packer(rank, index) for _ in range(2 if overlap else 1)]
    iterator = iter(bucket_iterator)

    async def read_and_pack(seq: int) -> RankPart | None:
        """Bucket ``seq`` packed and described; None at the end.

        A part with ``error`` when reading it raised. The bucket's tensors are not
        referenced once it returns.
        """
        bucket = await _in_thread(state.device, _next, iterator)
        if bucket is None or isinstance(bucket, str):
            return None if bucket is None else RankPart(rank, index, seq, error=bucket)
        return await _in_thread(state.device, packers[seq % len(packers)].pack, seq, bucket)

    seq = sent = 0
    try:
        part = await read_and_pack(0)
        while part is not None:
            sent += part.used
            if overlap and part.error is None:
                part = await _overlapped(state.exchange(part), read_and_pack(seq + 1))
            else:
                await state.exchange(part)  # raises for a part carrying an error
                if part.error is not None:
                    raise UsageError(f"trainer rank {rank}: {part.error}")  # (not reached)
                part = await read_and_pack(seq + 1)
            seq += 1
        if seq:  # every engine prepares, then (only if all did) every engine commits
            await state.exchange(RankPart(rank, index, seq, last=True))
            await state.exchange(RankPart(rank, index, seq + 1, last=True, commit=True))
    finally:
        for packer in packers:
            packer.close()
        await state.aclose()
    return ColocatedReport(rank, index, rank == state.src, seq, sent, time.perf_counter() - started)
