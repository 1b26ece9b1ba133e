"""The blocking work of one bucket on either side of a broadcast (run on a group's thread).

:func:`send_bucket` is rank 0's broadcasts, :func:`receive_bucket` an engine rank's
receives and its sink's apply. Both sides lay a bucket out with
:func:`aiosync.handles.metadata.bucket_layout`, so a flattened bucket's bytes line up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, TensorSpec, pack_bucket, view_spec
from aiosync.engine.sinks import WeightSink
from aiosync.handles.scratch import Scratch


def send_bucket(
    group: dist.ProcessGroup,
    scratch: Scratch,
    tensors: list[torch.Tensor],
    specs: list[TensorSpec],
    used: int,
    flattened: bool,
) -> None:
    """Rank 0's broadcasts of one bucket (on the group's executor thread).

    On CUDA it waits for the broadcasts to finish on the device, so the deadline covers them
    and the tensors may be freed afterwards.
    """
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if flattened:
        if used:
            buffer = scratch.get(used, device)
            pack_bucket(buffer, BucketPlan(tensors, specs, used))
            dist.broadcast(buffer, src=0, group=group)
    else:
        for tensor, spec in zip(tensors, specs, strict=True):
            if spec.nbytes:
                plain = tensor.resolve_conj().resolve_neg().contiguous()
                dist.broadcast(plain, src=0, group=group)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def receive_bucket(
    sink: WeightSink,
    group: dist.ProcessGroup | None,
    scratch: Scratch,
    specs: list[TensorSpec],
    used: int,
    flattened: bool,
) -> None:
    """Receive one bucket's broadcasts from rank 0 into the rank's buffer, then apply it."""
    if group is None:
        raise AiosyncError("the group is gone")
    buffer = scratch.get(used, sink.device)
    if flattened:
        if used:
            dist.broadcast(buffer[:used], src=0, group=group)
    else:
        for spec in specs:
            if spec.nbytes:
                dist.broadcast(view_spec(buffer, spec), src=0, group=group)
    sink.apply_bucket(buffer, specs)
