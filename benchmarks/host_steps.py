"""What a direct-mode version's host steps cost: ``python -m benchmarks.host_steps``.

On a CUDA host, with Llama-3-8B's 291 parameters in bf16 (one allocation each), medians of
``--repeats`` calls, back to back (a warm CPU):

- ``read_us``: :meth:`~aiosync.trainer.direct.DirectReader.read` of a kept split, and
  its parts: ``matches_us`` (the kept split's check), ``unique_storage_us``,
  ``marker_us`` (the allocator's counters);
- ``to_thread_idle_us`` / ``_p90``: an ``anyio.to_thread`` round trip after 2 ms idle (a
  worker that went to sleep), and ``to_thread_busy_us`` back to back.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout

MiB = 1 << 20


def _median_us(step: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


async def _hops(repeats: int) -> dict[str, float]:
    idle, busy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        await anyio.to_thread.run_sync(lambda: None)
        idle.append(time.perf_counter() - start)
        await anyio.sleep(0.002)
    for _ in range(repeats):
        start = time.perf_counter()
        await anyio.to_thread.run_sync(lambda: None)
        busy.append(time.perf_counter() - start)
    idle.sort()
    return {
        "to_thread_idle_us": round(statistics.median(idle) * 1e6, 1),
        "to_thread_idle_p90_us": round(idle[int(0.9 * (len(idle) - 1))] * 1e6, 1),
        "to_thread_busy_us": round(statistics.median(busy) * 1e6, 1),
    }


def measure(repeats: int) -> dict[str, Any]:
    """Every step's median on ``cuda:0``."""
    from aiosync.core.layout_memory import LayoutMemory
    from aiosync.core.manifest import unique_storage
    from aiosync.planes.cuda import CudaSenderPlane
    from aiosync.planes.direct import DirectSenderPlane
    from aiosync.runtime import run
    from aiosync.trainer.direct import DirectReader

    device = torch.device("cuda", 0)
    model = {
        name: torch.nn.Parameter(
            torch.zeros(shape, dtype=torch.bfloat16, device=device), requires_grad=False
        )
        for name, shape in llama_layout(*LLAMA3_8B)
    }
    plane = DirectSenderPlane(CudaSenderPlane(device, 2, 1024 * MiB), device)
    reader = DirectReader(plane, True)
    layouts = LayoutMemory()

    def read() -> object:
        return reader.read(model, None, 1024 * MiB, 4096, layouts.lay_out)

    try:
        read()
        read()  # kept from here on
        assert reader._kept is not None
        kept, mark = reader._kept, plane.finder.marker()
        pairs: list[tuple[str, torch.Tensor]] = list(model.items())
        out: dict[str, Any] = {
            "tensors": len(model),
            "read_us": _median_us(read, repeats),
            "matches_us": _median_us(lambda: kept.matches(pairs, plane.finder, mark), repeats),
            "unique_storage_us": _median_us(lambda: unique_storage(model.items()), repeats),
            "marker_us": _median_us(plane.finder.marker, repeats),
        }
    finally:
        plane.close()
    out.update(run(functools.partial(_hops, repeats)))
    return out


def main() -> None:
    """Parse the command line, measure, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(json.dumps(measure(args.repeats)), flush=True)


if __name__ == "__main__":
    main()
