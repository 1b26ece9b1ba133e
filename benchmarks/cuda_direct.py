"""Direct mode against packed mode and the copy floors on one GPU, in one run.

Run as ``python -m benchmarks.cuda_direct``.

An engine process (:mod:`aiosync.bench.cuda_dropin`'s ``engine`` role) holds a bf16
Llama-shaped model of ``--size-mb`` on ``cuda:0``; this process holds the same shapes as
``nn.Parameter`` objects and streams them with :class:`~aiosync.WeightSender` through
2 x ``--buffer-mb`` buffers, ``--repeats`` times each after a warm-up: packed (the default),
direct (``SenderConfig(direct=True)``: the engine copies out of this process's parameters),
mixed (direct, with every fourth tensor handed over as a plain tensor, so packed) and
flat (direct, the parameters being views of one allocation, as a training framework's
parameter buffer makes them: one region instead of one per allocation).
``--modes`` picks some of them. It measures the floors of the same run (one flat device
copy of the model's bytes; one copy of every tensor into a tensor of its own, queued by
address as an engine's copies are; a copy of every tensor into buffers and back), checks
the engine's model against the trainer's at the end, and prints JSON: times, byte splits,
the regions read in place (by kind, and the physical allocations of descriptor regions),
ratios to the floors. Under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (which
:mod:`benchmarks.cuda_direct_vmm` sets for one run of two) direct mode reads through
descriptor regions (:mod:`aiosync.planes.fd_regions`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch

from aiosync.bench.cuda_dropin import copy_floors, model_digest
from aiosync.bench.model import synthetic_state_dict
from aiosync.planes.fd_regions import pieces_of
from benchmarks.timeline_switches import direct_source

MiB = 1 << 20


def _engine(size_mb: int) -> subprocess.Popen[str]:
    from aiosync.runtime import child_env

    return subprocess.Popen(
        [sys.executable, "-m", "aiosync.bench.cuda_dropin", "engine", "--size-mb", str(size_mb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _per_tensor_floor(model: dict[str, torch.Tensor]) -> float:
    """Seconds (median of 5) to copy every tensor into a same-sized tensor of its own.

    Queued by address and spread over two streams, as an engine's copy programs queue
    them (:class:`~aiosync.planes.cuda_copies.DeviceCopies`): direct mode's GPU work in one
    process, with no host message at all.
    """
    from aiosync.bench.cuda_dropin import timed
    from aiosync.planes.cuda_copies import DeviceCopies

    pairs = [(torch.empty_like(t), t) for t in model.values()]
    jobs = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in pairs]
    copies = DeviceCopies(torch.cuda.current_device())

    def copy() -> None:
        copies.queue(jobs, torch.cuda.current_stream())
        torch.cuda.synchronize()

    out = statistics.median(timed(copy, 5))
    del pairs
    torch.cuda.empty_cache()
    return out


def _sources(model: dict[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
    mixed: dict[str, torch.Tensor] = {
        n: (p.detach() if i % 4 == 0 else p) for i, (n, p) in enumerate(model.items())
    }
    return {
        "packed": dict(model),
        "direct": dict(model),
        "mixed": mixed,
        "flat": direct_source(model, True),
    }


def main() -> None:
    """Parse the command line, run every mode against one engine, print JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=15316)
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--modes", default="packed,direct,mixed,flat", help="which modes, comma-separated"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")

    from aiosync import SenderConfig, WeightSender
    from aiosync.runtime import run

    plain = synthetic_state_dict(args.size_mb * MiB, torch.bfloat16, 1, "cuda:0")
    model = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in plain.items()}
    proc = _engine(args.size_mb)
    assert proc.stdout is not None
    assert proc.stdin is not None
    try:
        endpoint = json.loads(proc.stdout.readline())["endpoint"]
        out: dict[str, Any] = {"bytes": sum(t.nbytes for t in model.values())}
        out["tensors"] = len(model)
        out.update(copy_floors(plain, args.buffer_mb * MiB))
        out["one_copy_per_tensor_s"] = _per_tensor_floor(plain)

        async def one(mode: str, source: dict[str, torch.Tensor]) -> None:
            config = SenderConfig(
                buffer_bytes=args.buffer_mb * MiB, num_buffers=2, direct=mode != "packed"
            )
            times = []
            async with WeightSender(endpoint, device="cuda:0", config=config) as sender:
                first = time.perf_counter()
                report = await sender.send(source)
                out[f"{mode}_first_s"] = time.perf_counter() - first
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    report = await sender.send(source)
                    times.append(time.perf_counter() - start)
                regions = [] if sender._direct is None else sender._direct.regions
            out[f"{mode}_regions"] = dict(Counter(type(r).__name__ for r in regions))
            out[f"{mode}_pieces"] = sum(pieces_of(r) for r in regions)
            out[f"{mode}_s"] = times
            out[f"{mode}_median_s"] = statistics.median(times)
            out[f"{mode}_direct_bytes"] = report.direct_bytes
            out[f"{mode}_packed_bytes"] = report.packed_bytes
            out[f"{mode}_buckets"] = report.buckets
            out[f"{mode}_note"] = report.direct_note

        async def every() -> None:
            for mode, source in _sources(model).items():
                if mode in modes:
                    await one(mode, source)

        run(every)
        proc.stdin.write("digest\n")
        proc.stdin.flush()
        out["bit_exact"] = json.loads(proc.stdout.readline())["digest"] == model_digest(plain)
        out["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        for mode in modes:
            floor = out["two_copies_s"] if mode == "packed" else out["one_copy_s"]
            name = "two_copies" if mode == "packed" else "one_copy"
            out[f"{mode}_over_{name}"] = out[f"{mode}_median_s"] / floor
            if mode in ("direct", "flat"):
                per_tensor = out[f"{mode}_median_s"] / out["one_copy_per_tensor_s"]
                out[f"{mode}_over_one_copy_per_tensor"] = per_tensor
        print(json.dumps(out), flush=True)
    finally:
        proc.kill()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
