"""The planes' two entries: a sender's ring made for a device, a peer's plane opened from its spec.

Implementations are imported only when a plane of their kind is made, so a process that
never touches CUDA or shared memory never loads their modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiosync.core.limits import Limits
from aiosync.core.wire import (
    CollectivePlaneSpec,
    CudaPlaneSpec,
    DirectPlaneSpec,
    GatheredPlaneSpec,
    PlaneSpec,
    ShmPlaneSpec,
)
from aiosync.planes.base import ReceiverPlane, SenderPlane
from aiosync.planes.rings import open_ring


def create_sender_plane(
    device: torch.device, count: int, capacity: int, *, ordered: bool = False
) -> SenderPlane:
    """A ring of ``count`` buffers of ``capacity`` bytes shareable from ``device``.

    On CUDA, aiosync's own buffers with legacy IPC handles (:mod:`aiosync.planes.cuda`):
    ``ordered``, their packing and reading are chained by CUDA events instead of host waits
    (``WeightSender``'s); otherwise :meth:`SenderPlane.pack` returns with the bytes in
    place (the colocated topologies').
    """
    if device.type == "cuda":
        from aiosync.planes.cuda import CudaSenderPlane

        return CudaSenderPlane(device, count, capacity, ordered=ordered)
    if device.type == "cpu":
        from aiosync.planes.shm import ShmSenderPlane

        return ShmSenderPlane(count, capacity)
    raise ValueError(f"no data plane for device {device}")


def open_receiver_plane(
    spec: PlaneSpec,
    device: torch.device,
    limits: Limits | None = None,
    part_devices: Sequence[torch.device] | None = None,
    max_timeout: float | None = None,
) -> ReceiverPlane:
    """Open a peer's plane described by ``spec``; CUDA buffers open on ``device`` if CUDA.

    ``limits`` (the engine's) bound the buffers and bytes the plane may name.
    ``part_devices`` (a sink's, :attr:`aiosync.topology.RankedSink.part_devices`): where
    each part of a gathered plane opens instead. ``max_timeout`` (seconds, the engine's
    own): the longest a collective plane takes the peer's timeout to be.
    """
    if isinstance(spec, ShmPlaneSpec | CudaPlaneSpec):
        return open_ring(spec, device, limits)
    if isinstance(spec, CollectivePlaneSpec):
        from aiosync.planes.collective_receiver import CollectiveReceiverPlane

        if max_timeout is None:
            return CollectiveReceiverPlane(spec, device, limits)
        return CollectiveReceiverPlane(spec, device, limits, max_timeout=max_timeout)
    if isinstance(spec, DirectPlaneSpec):
        from aiosync.planes.direct import DirectReceiverPlane

        return DirectReceiverPlane(spec, device, limits)
    if isinstance(spec, GatheredPlaneSpec):
        from aiosync.planes.gathered import GatheredReceiverPlane

        return GatheredReceiverPlane(spec, device, limits, part_devices)
    raise ValueError(f"unknown data plane {type(spec).__name__}")
