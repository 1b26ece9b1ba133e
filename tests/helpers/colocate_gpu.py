"""The two-GPU colocated run: 2 trainer ranks, one engine spanning both GPUs, CUDA IPC.

``python -m tests.helpers.colocate_gpu [--versions N] [--bucket-mb MB]`` starts one engine process
(a :class:`~aiosync.topology.ColocatedReceiver` with a sink on cuda:0 and one on cuda:1,
served over aiosync's control channel) and two trainer processes (Gloo world of 2, rank r on
cuda:r) holding Llama-3-8B shapes in bf16 (291 tensors, 16.06 GB each). Each version the
trainers refill their weights, then ``send_colocated`` hands every bucket to the engine:
rank r's part is a CUDA IPC buffer on GPU r, which the engine's sink on GPU r reads. After
each version the engine regenerates the expected weights on both GPUs and compares them bit
for bit (outside the timed part). Prints one JSON line per version and a summary line; exits
non-zero unless every version is bit-exact. Every process is killed and reaped at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout
from tests.helpers.colocate_procs import Children, loopback_env, role_parser, skip_without_two_gpus

GUARD = 170.0  # seconds for the whole run: it must finish unattended in under 3 minutes


TINY = os.environ.get("AIOSYNC_COLOCATE_TINY") == "1"
"""Set by ``--tiny``: CPU only, the same layout scaled down (a check of this script in CI)."""


def llama3_8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B's tensors, or a tiny model of the same layout under TINY."""
    return llama_layout(*((64, 16, 224, 500, 2) if TINY else LLAMA3_8B))


def zeros(device: torch.device) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in llama3_8b_shapes()}


def expected(version: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Version ``version``'s weights, one tensor at a time (the same bits on any GPU)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(version)
    for name, shape in llama3_8b_shapes():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.normal_(0.0, 0.02, generator=gen)
        yield name, t


def fill(model: dict[str, torch.Tensor], version: int) -> None:
    device = next(iter(model.values())).device
    gen = torch.Generator(device=device)
    gen.manual_seed(version)
    for name, _ in llama3_8b_shapes():
        model[name].normal_(0.0, 0.02, generator=gen)


# ----------------------------------------------------------------------------- engine


def engine_main() -> None:
    import anyio
    import anyio.to_thread

    from aiosync.channels.zmq import ZmqListener
    from aiosync.engine.sinks import ModuleSink
    from aiosync.handles import ObjectHandle, serve_engine
    from aiosync.runtime import run
    from aiosync.topology import ColocatedReceiver

    devices = [torch.device("cpu" if TINY else f"cuda:{i}") for i in range(2)]
    models = [zeros(d) for d in devices]

    class VerifyingReceiver(ColocatedReceiver):
        def check_health(self) -> dict[str, Any]:
            """Compares both GPUs' weights with the current version's, bit for bit."""
            version = self.current_version
            if version is None:
                return {"healthy": False, "message": "no version yet"}
            bad = [
                f"cuda:{i} {name}"
                for i, (device, model) in enumerate(zip(devices, models, strict=True))
                for name, want in expected(version, device)
                if not torch.equal(model[name].view(torch.int16), want.view(torch.int16))
            ]
            return {
                "healthy": not bad,
                "message": "bit-exact" if not bad else f"{len(bad)} differ: {bad[:3]}",
                "weight_version": str(version),
            }

    receiver = VerifyingReceiver([ModuleSink(m) for m in models], name="engine-tp2")

    async def serve() -> None:
        listener = ZmqListener.open()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_engine, listener, ObjectHandle(receiver, name="engine-tp2"))
                print(json.dumps({"ready": listener.endpoint}), flush=True)
                await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
                tg.cancel_scope.cancel()
        finally:
            await listener.aclose()
            receiver.close()

    run(serve)


# ----------------------------------------------------------------------------- trainer


def trainer_main(rank: int, store: str, endpoint: str, versions: int, bucket_mb: float) -> None:
    import torch.distributed as dist

    from aiosync.core.layout import iter_named_tensor_buckets
    from aiosync.handles import ChannelHandle
    from aiosync.runtime import run
    from aiosync.topology import connect_topology, send_colocated

    device = torch.device("cpu" if TINY else f"cuda:{rank}")
    if not TINY:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    state: dict[str, Any] = {}
    connect_topology(engine_gpu_counts=[2], worker_state=state)
    model = zeros(device)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())

    async def main() -> None:
        handle = ChannelHandle.connect(endpoint, name="engine-tp2") if rank == 0 else None
        try:
            for version in range(1, 2 * versions + 1):  # overlapped, then one at a time
                overlap = version <= versions
                fill(model, version)
                if not TINY:
                    torch.cuda.synchronize()
                dist.barrier()
                began = time.perf_counter()
                report = await send_colocated(
                    bucket_iterator=iter_named_tensor_buckets(
                        model.items(), int(bucket_mb * 2**20)
                    ),
                    rollout_engines=[handle],
                    worker_state=state,
                    weight_version=version,
                    overlap=overlap,
                )
                seconds = time.perf_counter() - began
                line: dict[str, Any] = {
                    "rank": rank,
                    "version": version,
                    "overlap": overlap,
                    "ms": round(seconds * 1e3, 2),
                    "buckets": report.buckets,
                    "bytes": nbytes,
                    "tensors": len(model),
                }
                if handle is not None:
                    health = await handle.check_health()
                    line.update(exact=health.healthy, check=health.message)
                    line["engine_version"] = health.weight_version
                print(json.dumps(line), flush=True)
                dist.barrier()
        finally:
            if handle is not None:
                await handle.aclose()

    run(main)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def drive(versions: int, bucket_mb: float) -> int:
    if skip_without_two_gpus(TINY):
        return 0
    env = loopback_env()
    env["AIOSYNC_COLOCATE_TINY"] = "1" if TINY else "0"
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    deadline = time.monotonic() + GUARD
    with Children("tests.helpers.colocate_gpu", env=env) as children:
        started: list[dict[str, Any]] = []
        engine = children.start_engine(started.append)
        while not started and engine.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polling a child's first line, bounded by the run's deadline
        ready = started[0] if started else {}
        if "ready" not in ready:
            print(json.dumps({"error": "engine did not start", "got": ready}), flush=True)
            return 1
        store = children.store()  # removed with the children
        results: list[dict[str, Any]] = []
        readers = children.start_trainers(
            store, ready["ready"], versions, results.append, "--bucket-mb", str(bucket_mb)
        )
        codes = children.wait_trainers(readers, deadline)
        for line in sorted(results, key=lambda r: (r.get("version", 0), r.get("rank", 0))):
            print(json.dumps(line), flush=True)
        sources = [r for r in results if "exact" in r]
        ok = codes == [0, 0] and len(sources) == 2 * versions and all(r["exact"] for r in sources)
        # a version's time is its slower rank's; the first one opens every buffer
        slowest: dict[int, float] = {}
        for r in results:
            slowest[r["version"]] = max(slowest.get(r["version"], 0.0), r["ms"])
        overlapped = [ms for v, ms in slowest.items() if 1 < v <= versions]
        serial = [ms for v, ms in slowest.items() if v > versions + 1]
        summary = {
            "ok": ok,
            "versions": 2 * versions,
            "exit_codes": codes,
            "first_ms": slowest.get(1),
            "overlapped_ms": [min(overlapped, default=0), max(overlapped, default=0)],
            "one_at_a_time_ms": [min(serial, default=0), max(serial, default=0)],
            "bytes_per_rank": results[0]["bytes"] if results else None,
            "bucket_mb": bucket_mb,
        }
        print(json.dumps({"summary": summary}), flush=True)
        return 0 if ok else 1


def main() -> None:
    parser = role_parser(__doc__, versions=4, versions_help="per mode (overlap or not)")
    parser.add_argument("--bucket-mb", type=float, default=1024)
    parser.add_argument("--tiny", action="store_true", help="CPU only, shapes scaled down")
    args = parser.parse_args()
    if args.tiny:
        global TINY
        TINY = True
    if args.role == "engine":
        engine_main()
    elif args.role == "trainer":
        trainer_main(args.rank, args.store, args.endpoint, args.versions, args.bucket_mb)
    else:
        sys.exit(drive(args.versions, args.bucket_mb))


if __name__ == "__main__":
    main()
