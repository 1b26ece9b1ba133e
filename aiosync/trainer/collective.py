"""A :class:`~aiosync.trainer.sender.WeightSender` whose buckets travel by broadcast.

Example (a CPU trainer and two engine processes, Gloo)::

    options = CollectiveOptions(engines=2, timeout=30)
    async with CollectiveSender(endpoints, collective=options) as sender:
        await sender.send(model, version=step)

Everything else is the native pipeline: the manifest, bucket acks, the fleet's two-phase
commit and its policy. The engines are ordinary :class:`~aiosync.WeightReceiver`s: the
hello tells them where the group meets (see :mod:`aiosync.planes.collective`). The fleet
is fixed for the life of the sender (a process group has a fixed size); to change it, or
after a failed broadcast, leave and open a new sender (a new group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import UsageError
from aiosync.planes.collective import CollectiveOptions, CollectiveSenderPlane
from aiosync.trainer.sender import SenderConfig, Target, WeightSender


class CollectiveSender(WeightSender):
    """A sender whose data plane is a broadcast over a new side process group.

    ``collective`` says how many engine ranks join (``engines``, one per engine here; the
    engines given must be that many), the backend, where the rendezvous listens, the mode
    and the per-broadcast timeout.
    ``device``: ``"cpu"`` for Gloo, a CUDA device for NCCL.
    """

    def __init__(
        self,
        engines: Target | Sequence[Target] = (),
        *,
        collective: CollectiveOptions,
        device: torch.device | str = "cpu",
        config: SenderConfig | None = None,
        auth: ChannelAuth | None = None,
    ) -> None:
        super().__init__(engines, device=device, config=config, auth=auth)
        self.collective = collective
        many = isinstance(engines, Sequence) and not isinstance(engines, str)
        given = len(engines) if many else 1  # type: ignore[arg-type]
        if given and given != collective.engines:  # the group would wait for ranks in vain
            raise UsageError(
                f"{given} engines given for a group of {collective.engines} engine ranks"
            )

    def _create_plane(
        self, device: torch.device, count: int, capacity: int
    ) -> CollectiveSenderPlane:
        return CollectiveSenderPlane(device, count, capacity, self.collective)
