"""Benchmark of the compat broadcast path over NCCL: ``python -m tests.helpers.handle_bench``.

Trainer (this thread, GPU 0) and an in-process AiosyncEngine (GPU 1, in-place or staged
ModuleSink) joined by connect_rollout_engines_from_distributed; Llama-3-8B shapes in bf16
(291 tensors, 16.06 GB) sent by broadcast_hf_buckets_via_distributed_impl in 1 GiB buckets,
per tensor and flattened, each checked bit-exact; beside them the raw NCCL broadcast of the
same bytes in 1 GiB messages over the same group. Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from aiosync import ModuleSink
from aiosync.bench.model import LLAMA3_8B, llama_layout
from aiosync.collectives import Deadline
from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.handles.engine import AiosyncEngine

GIB = 1 << 30


def llama8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    return llama_layout(*LLAMA3_8B)


def emit(**fields: object) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "handle_bench.jsonl"), "a") as f:
            f.write(line + "\n")


def report(mode: str, total: int, times: list[float], **extra: object) -> None:
    median = statistics.median(times)
    emit(
        mode=mode,
        bytes=total,
        ms=[round(t * 1e3, 2) for t in times],
        median_ms=round(median * 1e3, 2),
        gbps=round(total / median / 1e9, 1),
        **extra,
    )


def main() -> None:
    os.environ.setdefault(distributed.BACKEND_ENV, "nccl")
    os.environ.setdefault(distributed.TIMEOUT_ENV, "300")
    staged = "--staged" in sys.argv
    reps = 3
    shapes = llama8b_shapes()
    g = torch.Generator(device="cuda:0").manual_seed(0)
    weights = {
        n: torch.empty(s, dtype=torch.bfloat16, device="cuda:0").normal_(generator=g)
        for n, s in shapes
    }
    total = sum(t.nbytes for t in weights.values())
    model = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda:1") for n, s in shapes}
    engine = AiosyncEngine(ModuleSink(model, staged=staged), name="gpu1", timeout=300)
    engines: list[object] = [engine]
    group = connect_rollout_engines_from_distributed(
        group_name="bench", rollout_engines=engines, engine_gpu_counts=[1]
    )
    version = 0
    for layout in ("per_tensor", "flattened"):
        os.environ[distributed.FORMAT_ENV] = layout
        times = []
        for rep in range(reps + 1):
            version += 1
            for t in weights.values():  # a new version each time (cheap on the GPU)
                t.add_(1)
            torch.cuda.synchronize("cuda:0")
            start = time.perf_counter()
            broadcast_hf_buckets_via_distributed_impl(
                bucket_iterator=iter_named_tensor_buckets(weights.items(), GIB),
                rollout_engines=engines,
                rollout_engine_lock=threading.Lock(),
                group_name="bench",
                model_update_group=group,
                weight_version=version,
            )
            elapsed = time.perf_counter() - start
            if rep:
                times.append(elapsed)
            assert engine.weight_version == version
        exact = all(torch.equal(model[n].to("cuda:0"), t) for n, t in weights.items())
        report(f"compat {layout}", total, times, staged=staged, bit_exact=exact)
    # the raw broadcast of the same bytes in 1 GiB messages, over the same two ranks
    trainer = distributed._groups["bench"]
    rank1 = engine._groups["bench"].executors[0]
    src = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(total, dtype=torch.uint8, device="cuda:1")

    def raw(buffer: torch.Tensor, pg: dist.ProcessGroup) -> None:
        torch.cuda.set_device(buffer.device)
        for start in range(0, total, GIB):
            dist.broadcast(buffer[start : start + GIB], src=0, group=pg)
        torch.cuda.current_stream(buffer.device).synchronize()

    times = []
    for rep in range(reps + 1):
        begin = time.perf_counter()
        f0 = trainer.executor.submit(lambda: raw(src, trainer.group))
        f1 = rank1.submit(lambda: raw(dst, rank1.group))  # type: ignore[arg-type]
        deadline = Deadline.after(120)
        trainer.executor.result(f0, deadline=deadline)
        rank1.result(f1, deadline=deadline)
        if rep:
            times.append(time.perf_counter() - begin)
    report("raw NCCL broadcast, 1 GiB messages", total, times)
    disconnect_rollout_engines_from_distributed(
        group_name="bench", model_update_group=group, rollout_engines=engines
    )


if __name__ == "__main__":
    main()
