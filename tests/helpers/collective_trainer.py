"""A trainer process for the collective tests:
``python -m tests.helpers.collective_trainer E1 E2...``.

Opens a :class:`~aiosync.trainer.collective.CollectiveSender` to the engines (Gloo, 3 s
timeouts), sends ``mixed_weights(seed=1)`` as version 0, prints ``{"event": "sent"}``, then
sends version 1 (the test kills this process during it). ``--device cuda:N`` first: NCCL
from that GPU instead.
"""

from __future__ import annotations

import json
import sys

import torch

from aiosync import SenderConfig
from aiosync.planes.collective import CollectiveOptions
from aiosync.runtime import run
from aiosync.trainer.collective import CollectiveSender
from tests.helpers.models import mixed_weights


def main() -> None:
    endpoints, device = sys.argv[1:], "cpu"
    if endpoints[:1] == ["--device"]:
        device, endpoints = endpoints[1], endpoints[2:]
    options = CollectiveOptions(engines=len(endpoints), timeout=3.0)
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=3.0)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        return {name: t.to(device) for name, t in mixed_weights(seed=seed).items()}

    async def train() -> None:
        async with CollectiveSender(
            endpoints, collective=options, config=config, device=device
        ) as sender:
            await sender.send(weights(1), version=0)
            print(json.dumps({"event": "sent", "version": 0}), flush=True)
            await sender.send(weights(2), version=1)
            print(json.dumps({"event": "sent", "version": 1}), flush=True)

    run(train)


if __name__ == "__main__":
    main()
