"""Data planes: shared memory, CUDA IPC, collectives; see :mod:`aiosync.planes.base`.

Implementations are imported only when a plane of their kind is made, so a process that
never touches CUDA or shared memory never loads their modules.
"""

from __future__ import annotations

import torch

from aiosync.core.engine_actions import Apply
from aiosync.core.layout import TensorSpec
from aiosync.planes.base import BucketContext, Part, ReceiverPlane, SenderPlane
from aiosync.planes.factory import create_sender_plane, open_receiver_plane


def view_bucket(
    plane: ReceiverPlane,
    index: int,
    used: int,
    specs: list[TensorSpec],
    context: BucketContext | None = None,
) -> torch.Tensor:
    """A bucket's bytes: :meth:`ReceiverPlane.expect` with its checked specs, then ``view``.

    (A per-tensor collective plane receives each tensor into its slot; a gathered plane
    picks the part the specs name.)
    """
    plane.expect(index, specs)
    return plane.view(index, used, context)


def view_parts(
    plane: ReceiverPlane, action: Apply, context: BucketContext | None = None
) -> list[Part]:
    """An applied bucket as (flat bytes, specs) pairs for the sink: one, or one per region.

    A direct plane (:mod:`aiosync.planes.direct`) checks and opens the bucket's regions;
    any other plane refuses a bucket that names regions (:meth:`ReceiverPlane.parts`). A
    bucket sent ahead of its packing (``after``) first has this thread's stream wait on the
    trainer's counter (:meth:`ReceiverPlane.wait_after`); a plane with no counter refuses
    it. ``context``: the bucket's, for the copies that follow.
    """
    if action.after is not None:
        plane.wait_after(action.after, context)
    return plane.parts(
        action.buffer, action.used, action.specs, action.regions, action.version, context
    )


__all__ = [
    "BucketContext",
    "Part",
    "ReceiverPlane",
    "SenderPlane",
    "create_sender_plane",
    "open_receiver_plane",
    "view_bucket",
    "view_parts",
]
