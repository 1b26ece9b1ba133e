"""Two trainer ranks and one engine spanning both GPUs, through the native pipeline.

``python -m tests.helpers.colocate_pipeline_gpu [--versions N] [--tiny]`` starts one engine process
(a :class:`~aiosync.WeightReceiver` over a :class:`~aiosync.topology.RankedSink` with a
:class:`~aiosync.ModuleSink` on cuda:0 and one on cuda:1) and two trainer processes (a Gloo
world of 2 over loopback, rank r on cuda:r) that send their own shard of a small Llama
layout in bf16 through a :class:`~aiosync.topology.ColocatedSession`: rank r packs into CUDA
IPC buffers on GPU r, which the engine opens on the device of its sink r and copies from
there. After each commit the engine compares both GPUs' weights with the version's shards,
bit for bit, and prints one JSON line; the driver prints a summary line and exits non-zero
unless every version arrived bit-exact on both. ``--tiny``: the same on the CPU (memfds,
smaller shapes), CI's check of this script. Every process is killed and reaped at the end.
"""

from __future__ import annotations

import json
import queue
import sys
import time
from typing import Any

import torch

from aiosync.bench.model import llama_layout
from tests.helpers.colocate_procs import Children, loopback_env, role_parser, skip_without_two_gpus

GUARD = 90.0  # seconds for the whole run (it takes well under 60 on two GPUs)
GPU_DIMS = (256, 64, 512, 1000, 2)  # about 3.3 MB per rank in bf16
TINY_DIMS = (64, 16, 96, 200, 2)


def shapes(tiny: bool) -> list[tuple[str, tuple[int, ...]]]:
    return llama_layout(*(TINY_DIMS if tiny else GPU_DIMS))


def shard(version: int, rank: int, device: torch.device, tiny: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of ``version`` (made on the CPU: the same bits anywhere)."""
    gen = torch.Generator().manual_seed(1000 * version + rank)
    return {
        name: torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
        for name, shape in shapes(tiny)
    }


def devices(tiny: bool) -> list[torch.device]:
    return [torch.device("cpu" if tiny else f"cuda:{r}") for r in range(2)]


# ----------------------------------------------------------------------------- engine


def engine_main(tiny: bool) -> None:
    import anyio
    import anyio.to_thread

    from aiosync.core.layout import TensorSpec
    from aiosync.engine.receiver import WeightReceiver
    from aiosync.engine.sinks import ModuleSink
    from aiosync.runtime import run
    from aiosync.topology.sink import RankedSink

    class SeeingSink(ModuleSink):
        """A module sink that notes the devices its buckets' bytes were opened on."""

        def __init__(self, targets: dict[str, torch.Tensor]) -> None:
            super().__init__(targets)
            self.seen: set[str] = set()

        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            self.seen.add(str(bucket.device))
            super().apply_bucket(bucket, specs)

    models = [
        {k: torch.zeros_like(v) for k, v in shard(0, r, d, tiny).items()}
        for r, d in enumerate(devices(tiny))
    ]
    sinks = [SeeingSink(m) for m in models]

    def check(version: int) -> None:
        bad = [
            f"{d} {name}"
            for r, (d, model) in enumerate(zip(devices(tiny), models, strict=True))
            for name, want in shard(version, r, d, tiny).items()
            if not torch.equal(model[name].view(torch.int16), want.view(torch.int16))
        ]
        seen = [sorted(sink.seen) for sink in sinks]  # sink r reads buffers opened on GPU r
        line = {"engine_version": version, "exact": not bad, "differ": bad[:3], "seen": seen}
        print(json.dumps(line), flush=True)

    sink = RankedSink(sinks)

    async def serve() -> None:
        async with WeightReceiver(sink, on_commit=check) as receiver:
            print(json.dumps({"ready": receiver.endpoint}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)

    run(serve)


# ----------------------------------------------------------------------------- trainer


def trainer_main(rank: int, store: str, endpoint: str, versions: int, tiny: bool) -> None:
    import torch.distributed as dist

    from aiosync.runtime import run
    from aiosync.topology import connect_topology
    from aiosync.topology.pipeline import ColocatedSession

    device = devices(tiny)[rank]
    if not tiny:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    state: dict[str, Any] = {}
    connect_topology(engine_gpu_counts=[2], worker_state=state, timeout=60)
    buffer_bytes = (16 if tiny else 1024) << 10

    async def main() -> None:
        engines = [endpoint if rank == 0 else None]
        async with ColocatedSession(
            state, engines, device=device, buffer_bytes=buffer_bytes, link_timeout=20
        ) as session:
            for version in range(1, versions + 1):
                mine = shard(version, rank, device, tiny)
                began = time.perf_counter()
                report = await session.send(mine.items(), weight_version=version)
                line: dict[str, Any] = {
                    "rank": rank,
                    "version": report.version,
                    "committed": list(report.committed),
                    "ms": round((time.perf_counter() - began) * 1e3, 2),
                }
                if report.sync is not None:
                    line.update(buckets=report.sync.buckets, bytes=report.sync.bytes)
                print(json.dumps(line), flush=True)

    run(main)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def drive(versions: int, tiny: bool) -> int:
    if skip_without_two_gpus(tiny):
        return 0
    env = loopback_env()
    tiny_argv = ["--tiny"] if tiny else []
    deadline = time.monotonic() + GUARD
    began = time.monotonic()
    with Children("tests.helpers.colocate_pipeline_gpu", *tiny_argv, env=env) as children:
        from_engine: queue.Queue[dict[str, Any]] = queue.Queue()
        children.start_engine(from_engine.put)
        try:
            ready = from_engine.get(timeout=60)
        except queue.Empty:
            ready = {}
        if "ready" not in ready:
            print(json.dumps({"error": "engine did not start", "got": ready}), flush=True)
            return 1
        results: queue.Queue[dict[str, Any]] = queue.Queue()
        readers = children.start_trainers(children.store(), ready["ready"], versions, results.put)
        codes = children.wait_trainers(readers, deadline)
        ranks = sorted(results.queue, key=lambda r: (r.get("version", 0), r.get("rank", 0)))
        checks = []
        while len(checks) < versions:  # the engine's check of the last commit may trail
            try:
                checks.append(from_engine.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                break
        for line in [*ranks, *checks]:
            print(json.dumps(line), flush=True)
        ok = (
            codes == [0, 0]
            and [c.get("engine_version") for c in checks] == list(range(1, versions + 1))
            and all(c.get("exact") for c in checks)
            and all(c.get("seen") == [[str(d)] for d in devices(tiny)] for c in checks)
            and all(r.get("committed") == [0] for r in ranks)
            and len(ranks) == 2 * versions
        )
        summary = {
            "ok": ok,
            "versions": versions,
            "exit_codes": codes,
            "seconds": round(time.monotonic() - began, 2),
            "devices": [str(d) for d in devices(tiny)],
        }
        print(json.dumps({"summary": summary}), flush=True)
        return 0 if ok else 1


def main() -> None:
    parser = role_parser(__doc__, versions=2)
    parser.add_argument("--tiny", action="store_true", help="CPU only, shapes scaled down")
    args = parser.parse_args()
    if args.role == "engine":
        engine_main(args.tiny)
    elif args.role == "trainer":
        trainer_main(args.rank, args.store, args.endpoint, args.versions, args.tiny)
    else:
        sys.exit(drive(args.versions, args.tiny))


if __name__ == "__main__":
    main()
