"""A peer's ring of buffers opened from its spec: the shared-memory and CUDA IPC planes.

The planes built from rings (:mod:`aiosync.planes.direct`, :mod:`aiosync.planes.gathered`)
open theirs here, so they need not import the factory that imports them. Implementations
are imported only when a ring of their kind is opened.
"""

from __future__ import annotations

import torch

from aiosync.core.limits import Limits
from aiosync.core.wire import CudaPlaneSpec, ShmPlaneSpec
from aiosync.planes.base import ReceiverPlane


def open_ring(
    spec: ShmPlaneSpec | CudaPlaneSpec, device: torch.device, limits: Limits | None = None
) -> ReceiverPlane:
    """Open the ring ``spec`` describes: CUDA buffers on ``device``, or shared memory.

    ``limits`` (the engine's), when given, bound the shared memory's buffers and bytes.
    """
    if isinstance(spec, CudaPlaneSpec):
        from aiosync.planes.cuda import CudaReceiverPlane

        return CudaReceiverPlane(spec, device)
    from aiosync.planes.shm import ShmReceiverPlane

    if limits is None:
        return ShmReceiverPlane(spec)
    return ShmReceiverPlane(
        spec, max_buffers=limits.max_buffers, max_bytes=limits.max_session_bytes
    )
