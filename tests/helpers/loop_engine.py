"""An engine process that watches its own event loop: ``python -m tests.helpers.loop_engine N V``.

It holds N one-element tensors, runs a 1 ms heartbeat beside its receiver, and after each
of V commits prints the longest gap between heartbeats and the time since the previous
commit, as JSON lines (after a ``ready`` line with the endpoint); then whether it holds the
last version exactly.
"""

from __future__ import annotations

import json
import sys
import time

import anyio
import torch

from aiosync import ModuleSink, WeightReceiver
from aiosync.runtime import run


def small_tensors(count: int) -> dict[str, torch.Tensor]:
    """``count`` one-element fp32 tensors with distinct values."""
    return {f"layer.{i}.w": torch.full((1,), float(i)) for i in range(count)}


async def heartbeat(gaps: list[float]) -> None:
    """Sleep 1 ms at a time and record how long each sleep really took."""
    last = time.perf_counter()
    while True:
        await anyio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _holds(model: dict[str, torch.Tensor], version: int) -> bool:
    """True when tensor ``i`` holds ``i + version`` (the trainer adds 1 per version)."""
    values = torch.cat(list(model.values()))
    return torch.equal(values, torch.arange(len(model), dtype=values.dtype) + version)


def main(count: int, versions: int) -> None:
    torch.set_num_threads(1)
    model = {name: torch.zeros_like(t) for name, t in small_tensors(count).items()}

    async def serve() -> None:
        gaps: list[float] = []
        async with WeightReceiver(ModuleSink(model)) as receiver, anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, gaps)
            print(json.dumps({"event": "ready", "endpoint": receiver.endpoint}), flush=True)
            started = time.perf_counter()
            for version in range(versions):
                await receiver.wait_for_version(version, 600)
                seconds = time.perf_counter() - started
                event = {"event": "committed", "version": version, "gap": max(gaps)}
                print(json.dumps({**event, "seconds": seconds}), flush=True)
                gaps.clear()
                started = time.perf_counter()
            # Checked once at the end: a check between versions would stall this loop itself.
            exact = await anyio.to_thread.run_sync(_holds, model, versions - 1)
            print(json.dumps({"event": "checked", "exact": exact}), flush=True)
            tg.cancel_scope.cancel()

    run(serve)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
