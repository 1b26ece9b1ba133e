"""Per-tensor device copies against one flat copy: which way of queueing them runs fastest.

Run as ``python -m benchmarks.copy_paths`` on a CUDA host. Llama-3-8B's 291 tensors in
bf16 (16.06 GB) are copied device to device, GPU time only (the stream is held by a short
spin while the copies are queued, so host queueing is not counted), median of
``--repeats``:

- ``flat``: one copy of all the bytes (the one-copy floor);
- ``streams_N``: one ``cudaMemcpyAsync`` a tensor, dealt over N streams by
  :class:`~aiosync.planes.cuda_copies.DeviceCopies` (N=1 is one stream; more let one
  copy's tail overlap the next one's start; the library uses 2);
- ``foreach``: ``torch._foreach_copy_``;
- ``graph_N``: the copies as one CUDA graph (:class:`~aiosync.planes.cuda_graphs.CopyGraph`)
  in N independent chains, launched with one call (``graph_free``: no chains, every copy
  independent); ``build_ms``: the host time to make the graph;
- ``buckets_K_serial``: the copies cut in K buckets in order (as direct mode's buckets), a
  4-chain graph each, launched one after another on one stream (each bucket's tail idles
  the GPU's other chains); ``buckets_K_overlap_S``: the same graphs launched on S streams
  in turn, each stream waiting only for the start, so a bucket's tail overlaps the next
  one's start.

Prints one JSON object: milliseconds and the ratio to ``flat`` per path, and the host time
to queue each.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout
from aiosync.planes.cuda_copies import DeviceCopies, deal
from aiosync.planes.cuda_graphs import CopyGraph
from aiosync.planes.cuda_runtime import memcpy_async

SPIN_CYCLES = 20_000_000  # about 10 ms of a spinning kernel: longer than any queueing


def _times(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median GPU milliseconds of ``run``'s queued work, and median host ms to queue it."""
    gpu, host = [], []
    for _ in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
        start.record()
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu[1:]), statistics.median(host[1:])


def _serial(graphs: list[CopyGraph]) -> None:
    stream = torch.cuda.current_stream()
    for graph in graphs:
        graph.launch(stream)


def _overlap(graphs: list[CopyGraph], streams: list[torch.cuda.Stream]) -> None:
    stream = torch.cuda.current_stream()
    fork = torch.cuda.Event()  # type: ignore[no-untyped-call]
    fork.record(stream)
    for k, graph in enumerate(graphs):
        side = streams[k % len(streams)]
        side.wait_event(fork)
        graph.launch(side)
    for side in streams:
        stream.wait_stream(side)


def measure(repeats: int) -> dict[str, Any]:
    """Every path over Llama-3-8B's bf16 tensors on the current GPU."""
    shapes = [shape for _, shape in llama_layout(*LLAMA3_8B)]
    src = [torch.full(shape, 1.5, dtype=torch.bfloat16, device="cuda") for shape in shapes]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for shape in shapes]
    sizes = [t.nbytes for t in src]
    total = sum(sizes)
    flat_src = torch.ones(total, dtype=torch.uint8, device="cuda")
    flat_dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    dsts, srcs = [t.data_ptr() for t in dst], [t.data_ptr() for t in src]
    paths: dict[str, Callable[[], None]] = {
        "flat": lambda: memcpy_async(
            flat_dst.data_ptr(), flat_src.data_ptr(), total, torch.cuda.current_stream().cuda_stream
        ),
        "foreach": lambda: torch._foreach_copy_(dst, src),
    }
    jobs = list(zip(dsts, srcs, sizes, strict=True))
    for n in (1, 2, 3, 4, 8):
        copies = DeviceCopies(torch.cuda.current_device(), n, graphs=False)
        paths[f"streams_{n}"] = functools.partial(copies.queue, jobs, torch.cuda.current_stream())
    built: dict[str, float] = {}
    for lanes in (1, 2, 4, 8, None):
        t0 = time.perf_counter()
        chains = deal(sizes, lanes) if lanes else None
        graph = CopyGraph(jobs, torch.cuda.current_device(), chains)
        name = f"graph_{lanes}" if lanes else "graph_free"
        built[name] = (time.perf_counter() - t0) * 1e3
        paths[name] = functools.partial(graph.launch, torch.cuda.current_stream())
    for k in (4, 8):
        cut = [len(jobs) * i // k for i in range(k + 1)]
        graphs = [
            CopyGraph(jobs[a:b], torch.cuda.current_device(), deal(sizes[a:b], 4))
            for a, b in itertools.pairwise(cut)
        ]
        paths[f"buckets_{k}_serial"] = functools.partial(_serial, graphs)
        for width in (2, 4):
            streams = [torch.cuda.Stream() for _ in range(width)]  # type: ignore[no-untyped-call]
            paths[f"buckets_{k}_overlap_{width}"] = functools.partial(_overlap, graphs, streams)
    out: dict[str, Any] = {
        "bytes": total,
        "tensors": len(sizes),
        "device": torch.cuda.get_device_name(),
    }
    flat_ms = None
    for name, run in paths.items():
        for t in dst:
            t.zero_()
        gpu, host = _times(run, repeats)
        torch.cuda.synchronize()
        exact = name == "flat" or all(bool((d == 1.5).all()) for d in dst)
        flat_ms = gpu if name == "flat" else flat_ms
        out[name] = {
            "gpu_ms": round(gpu, 3),
            "host_ms": round(host, 3),
            "ratio_to_flat": round(gpu / flat_ms, 3) if flat_ms else None,
            "exact": exact,
        }
        if name in built:
            out[name]["build_ms"] = round(built[name], 3)
    return out


def main() -> None:
    """Parse the command line, measure, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(json.dumps(measure(args.repeats), indent=1), flush=True)


if __name__ == "__main__":
    main()
