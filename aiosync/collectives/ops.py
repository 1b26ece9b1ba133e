"""Collectives under a deadline: what a :class:`GroupExecutor` job calls.

Each call issues collectives on a side group with a per-operation timeout taken from the
sync's :class:`~aiosync.collectives.executor.Deadline`. :func:`broadcast` and
:func:`broadcast_many` return once the bytes are in place on this rank (for CUDA tensors:
the host waits for the GPU stream); :func:`queue_broadcasts` (NCCL) only queues them and
leaves the waiting to the GPU (a CUDA event recorded after them is watched under the
deadline, see :mod:`aiosync.collectives.ordered`).

- Gloo honours the per-operation timeout itself: a broadcast whose peers never come raises
  once the deadline passes, so no Gloo rank stays blocked.
- NCCL gets the deadline plus ``NCCL_GRACE`` seconds as its watchdog timeout, so that the
  executor's abort at the deadline comes first (torch's watchdog, on its own timeout, may
  tear the whole process down); a collective blocked on the GPU ends when the executor
  aborts the communicator.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from aiosync.collectives.executor import Deadline

NCCL_GRACE = 30.0
"""Seconds past the deadline before NCCL's own watchdog would act (after aiosync's abort)."""

_SHORTEST = 0.001


def op_timeout(deadline: Deadline, tensor: torch.Tensor) -> timedelta:
    """The per-operation timeout for a collective on ``tensor`` under ``deadline``."""
    remaining = max(deadline.remaining(), _SHORTEST)
    if tensor.is_cuda:
        remaining += NCCL_GRACE
    return timedelta(seconds=remaining)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int, deadline: Deadline) -> None:
    """Broadcast ``tensor`` from group rank ``src`` to every rank of ``group``; blocking.

    ``tensor`` must be contiguous; on every rank but ``src`` it is overwritten. Returns
    when this rank's part is done (for CUDA tensors, once the GPU finished it).
    """
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    options.timeout = op_timeout(deadline, tensor)
    work = group.broadcast([tensor], options)
    work.wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def connect(group: dist.ProcessGroup, device: torch.device, deadline: Deadline) -> None:
    """NCCL: make the group's communicator now, with a one-byte broadcast; blocking.

    NCCL connects a group's ranks at its first collective, and that call blocks until every
    rank made it. Made at join, on the group's thread, it leaves the later collectives that
    only queue (steps issued from a packing or applying thread) nothing to block on. Gloo
    (a CPU device): nothing to do.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device), 0, deadline)


def broadcast_many(
    group: dist.ProcessGroup, tensors: list[torch.Tensor], src: int, deadline: Deadline
) -> None:
    """One broadcast per tensor, issued back to back, then one wait for all of them."""
    for work in queue_broadcasts(group, tensors, src, deadline):
        work.wait()
    cuda = {tensor.device for tensor in tensors if tensor.is_cuda}
    for device in cuda:
        torch.cuda.current_stream(device).synchronize()


def queue_broadcasts(
    group: dist.ProcessGroup, tensors: list[torch.Tensor], src: int, deadline: Deadline
) -> list[dist.Work]:
    """NCCL: queue one broadcast per tensor after this thread's current stream; no host wait.

    Each broadcast starts once the work queued so far on the current stream is done. The
    works are returned: ``work.wait()`` under another stream makes that stream (not the
    host) wait for them (see :class:`aiosync.collectives.ordered.OrderedBroadcasts`).
    """
    works = []
    for tensor in tensors:
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.timeout = op_timeout(deadline, tensor)
        works.append(group.broadcast([tensor], options))
    return works
