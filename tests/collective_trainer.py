"""A trainer process for the collective tests: ``python -m tests.collective_trainer E1 E2...``.

Opens a :class:`~aiosync.trainer.collective.CollectiveSender` to the engines (Gloo, 3 s
timeouts), sends ``mixed_weights(seed=1)`` as version 0, prints ``{"event": "sent"}``, then
sends version 1 (the test kills this process during it).
"""

from __future__ import annotations

import json
import sys

from aiosync import SenderConfig
from aiosync.planes.collective import CollectiveOptions
from aiosync.runtime import run
from aiosync.trainer.collective import CollectiveSender
from tests.models import mixed_weights


def main() -> None:
    endpoints = sys.argv[1:]
    options = CollectiveOptions(engines=len(endpoints), timeout=3.0)
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=3.0)

    async def train() -> None:
        async with CollectiveSender(endpoints, collective=options, config=config) as sender:
            await sender.send(mixed_weights(seed=1), version=0)
            print(json.dumps({"event": "sent", "version": 0}), flush=True)
            await sender.send(mixed_weights(seed=2), version=1)
            print(json.dumps({"event": "sent", "version": 1}), flush=True)

    run(train)


if __name__ == "__main__":
    main()
