"""Rank 0's broadcasts of the broadcast path's buckets: the send loop's data plane there.

:class:`GroupBroadcastPlane` is the :class:`~aiosync.planes.base.SenderPlane` under the
broadcast path's :class:`~aiosync.pipeline.stream.StreamRun`. Its group is the one
:func:`aiosync.handles.fleet.connect` made (the engines joined through their own
``init_weights_update_group``, so no hello describes it), and each bucket is broadcast as
SGLang's engines receive it: one broadcast per tensor, in order, or one of the whole bucket
laid out by :func:`aiosync.handles.metadata.bucket_layout` (``flattened``). The broadcasts
run on the group's thread, one bucket at a time into its one buffer, each to its end under
the call's deadline (:mod:`aiosync.collectives.ops`, as the collective plane's Gloo path).
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch
import torch.distributed as dist

from aiosync.collectives import Deadline, GroupExecutor, ops
from aiosync.core.errors import UsageError
from aiosync.core.layout import BucketPlan, TensorSpec, pack_bucket
from aiosync.core.wire import PlaneSpec
from aiosync.handles.scratch import Scratch
from aiosync.planes.base import SenderPlane


def send_bucket(
    group: dist.ProcessGroup,
    scratch: Scratch,
    tensors: list[torch.Tensor],
    specs: list[TensorSpec],
    used: int,
    flattened: bool,
    deadline: Deadline,
) -> None:
    """Rank 0's broadcasts of one bucket (on the group's thread), done when it returns.

    On CUDA the host waits for them, so the deadline covers them and the tensors may be
    reused afterwards.
    """
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if flattened:
        parts = []
        if used:
            buffer = scratch.get(used, device)
            pack_bucket(buffer, BucketPlan(tensors, specs, used))
            parts = [buffer[:used]]
    else:
        pairs = zip(tensors, specs, strict=True)
        parts = [t.resolve_conj().resolve_neg().contiguous() for t, s in pairs if s.nbytes]
    ops.broadcast_many(group, parts, 0, deadline)


class GroupBroadcastPlane(SenderPlane):
    """Each bucket broadcast from rank 0 of ``group`` on ``executor``'s thread (see the module).

    Gloo broadcasts CPU tensors: a bucket's tensors are copied to the CPU when packed.
    """

    def __init__(
        self,
        executor: GroupExecutor,
        scratch: Scratch,
        backend: str,
        flattened: bool,
        deadline: Deadline,
    ) -> None:
        self._executor = executor
        self._scratch = scratch
        self._backend = backend
        self._flattened = flattened
        self._deadline = deadline
        self._packed: functools.partial[None] | None = None
        self._sending: concurrent.futures.Future[None] | None = None

    @property
    def spec(self) -> PlaneSpec:
        """Never sent: the engines joined the group through their own calls."""
        raise UsageError("the broadcast path's group is joined by the engines' own calls")

    @property
    def capacity(self) -> int:
        """No bound of the plane's own: a bucket is as large as the caller made it."""
        return 1 << 62

    @property
    def count(self) -> int:
        """One bucket at a time: engines take SGLang's calls one after another."""
        return 1

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Hold the bucket's tensors for its broadcast (packed on the group's thread)."""
        tensors = [tensor.detach() for tensor in plan.tensors]
        if self._backend == "gloo":
            tensors = [tensor.cpu() for tensor in tensors]
        group = self._executor.group
        if group is None:
            raise UsageError("the group is gone")
        args = (group, self._scratch, tensors, list(plan.specs), plan.used, self._flattened)
        self._packed = functools.partial(send_bucket, *args, self._deadline)

    async def publish(self, index: int, used: int) -> None:
        """Queue the bucket's broadcasts on the group's thread; engines join on its message."""
        job, self._packed = self._packed, None
        if job is not None:
            self._sending = self._executor.submit(job)

    async def drain(self) -> None:
        """Wait for the last bucket's broadcasts (a failure breaks the group)."""
        sending, self._sending = self._sending, None
        if sending is not None:
            await self._executor.wait(sending, deadline=self._deadline, what="broadcasting")

    def close(self) -> None:
        """Let go of the bucket held (idempotent)."""
        self._packed = self._sending = None
