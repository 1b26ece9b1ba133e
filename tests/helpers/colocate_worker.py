"""One trainer rank of the colocated-topology tests: Gloo on the CPU, commands on stdin.

Started ``python -m tests.helpers.colocate_worker RANK WORLD STORE_FILE``. It joins a Gloo world
through a file store, then runs one scenario per JSON line read from stdin (every rank
reads the same line) and answers with one JSON line on stdout. Engines live in the process
of their source rank: a :class:`~aiosync.topology.ColocatedReceiver` with one
:class:`~aiosync.ModuleSink` per GPU of its range, reading the other ranks' sealed memfds
(shared memory standing in for CUDA IPC).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from aiosync.compat import nemo_rl
from aiosync.engine.sinks import ModuleSink
from aiosync.handles.base import WeightSyncResult
from aiosync.runtime import run
from aiosync.topology import ColocatedReceiver, connect_topology, send_colocated

STATE: dict[str, Any] = {}
RELEASE = threading.Event()  # frees an engine told to hang, once the scenario is over


def model(version: int, tensors: int = 6) -> dict[str, torch.Tensor]:
    """The weights of ``version``: mixed dtypes and shapes, every rank computes the same."""
    gen = torch.Generator().manual_seed(1000 + version)
    out: dict[str, torch.Tensor] = {}
    for i in range(tensors):
        shape = (3 + i, 5 + 2 * i)
        base = torch.randn(shape, generator=gen)
        if i % 3 == 0:
            out[f"layers.{i}.weight"] = base
        elif i % 3 == 1:
            out[f"layers.{i}.weight"] = base.to(torch.bfloat16)
        else:
            out[f"layers.{i}.index"] = (base * 100).to(torch.int64)
    return out


def buckets(version: int, per_bucket: int) -> list[list[tuple[str, torch.Tensor]]]:
    pairs = list(model(version).items())
    return [pairs[i : i + per_bucket] for i in range(0, len(pairs), per_bucket)]


def reading(
    bucket_list: list[list[tuple[str, torch.Tensor]]], broken: dict[str, int] | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets, raising at bucket ``broken["at"]`` on rank ``broken["rank"]``."""
    for seq, bucket in enumerate(bucket_list):
        if broken is not None and broken["rank"] == dist.get_rank() and broken["at"] == seq:
            raise TypeError("a DTensor redistribute failed on purpose")
        yield bucket


class FailingEngine(ColocatedReceiver):
    """A receiver that fails (or raises, or hangs) at one bucket, as a broken engine would."""

    def __init__(self, *args: Any, mode: str, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
        self.at = at
        self.calls = 0

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> WeightSyncResult:
        self.calls += 1
        if self.calls - 1 == self.at:
            if self.mode == "result":
                return WeightSyncResult(False, "out of memory on purpose")
            if self.mode == "raise":
                raise RuntimeError("engine crashed on purpose")
            RELEASE.wait(60)  # "hang": far past the engine budget, freed after the scenario
            return WeightSyncResult(False, "answered too late")
        return super().update_weights_from_tensor(*args, **kwargs)


class RayEngine(ColocatedReceiver):
    """A colocated engine as a Ray actor (its sinks built inside the actor's process)."""

    def __init__(self, gpus: int, name: str) -> None:
        self.targets = [{k: torch.zeros_like(v) for k, v in model(0).items()} for _ in range(gpus)]
        super().__init__([ModuleSink(t) for t in self.targets], name=name)

    def state(self, good: int) -> tuple[int | None, bool]:
        expected = model(good)
        exact = all(all(torch.equal(t[k], v) for k, v in expected.items()) for t in self.targets)
        return self.current_version, exact


def ray_engine(count: int, name: str) -> Any:
    """A local Ray instance (started once in this process) and an engine actor on it."""
    import ray

    if not ray.is_initialized():
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": root}},
            namespace="aiosync-topology-tests",
        )
    return ray.remote(RayEngine).options(num_cpus=0).remote(count, name)


def make_engines(
    layout: Any, rank: int, fail: dict[str, Any] | None, use_ray: bool = False
) -> list[Any]:
    engines: list[Any] = []
    for engine in layout.engines:
        if engine.source != rank:
            engines.append(None)  # only the source resolves its engine's entry
            continue
        if use_ray:  # a raw Ray actor handle, as NeMo-RL passes rollout engines
            engines.append(ray_engine(engine.count, f"ray-{engine.index}"))
            continue
        staged = bool(fail and fail.get("staged"))
        sinks = [
            ModuleSink({k: torch.zeros_like(v) for k, v in model(0).items()}, staged=staged)
            for _ in range(engine.count)
        ]
        name = f"sglang-{engine.index}"
        if fail is not None and fail["engine"] == engine.index:
            engines.append(FailingEngine(sinks, name=name, mode=fail["mode"], at=fail["at"]))
        else:
            engines.append(ColocatedReceiver(sinks, name=name))
    return engines


def scenario(cmd: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    started = time.monotonic()
    if cmd.get("compat"):  # NeMo-RL's names
        nemo_rl.connect_colocate_topology(
            engine_gpu_counts=cmd["counts"],
            engine_gpu_offsets=cmd.get("offsets"),
            worker_state=STATE,
        )
        layout = STATE["_ipc_layout"]
    else:
        layout = connect_topology(
            engine_gpu_counts=cmd["counts"],
            engine_gpu_offsets=cmd.get("offsets"),
            worker_state=STATE,
        )
    group = STATE["_ipc_gather_group"]
    out: dict[str, Any] = {
        "rank": rank,
        "engine": STATE["_ipc_engine_index"],
        "src": STATE["_ipc_gather_src"],
        "group": None if group is None else group.group_name,
        "groups": len(STATE["_ipc_gather_groups"]),
        "live_groups": len(dist.distributed_c10d._world.pg_map),
        "layout_key": json.loads(json.dumps(STATE["_ipc_layout_key"])),
    }
    engines = make_engines(layout, rank, cmd.get("fail"), bool(cmd.get("ray")))
    reports: list[dict[str, Any]] = []
    good = 0  # the model number of the last sync that went through
    try:
        for number, version in enumerate(cmd.get("versions", []), start=1):

            async def main(number: int = number, version: Any = version) -> Any:
                return await send_colocated(
                    bucket_iterator=reading(
                        buckets(number, cmd.get("per_bucket", 2)),
                        cmd.get("broken") if number == 1 else None,
                    ),
                    rollout_engines=engines,
                    worker_state=STATE,
                    weight_version=version,
                    timeout=cmd.get("timeout"),
                    overlap=cmd.get("overlap", True),
                )

            began = time.monotonic()
            try:
                if cmd.get("compat"):
                    nemo_rl.send_hf_buckets_via_ipc_actor_impl(
                        bucket_iterator=iter(buckets(number, cmd.get("per_bucket", 2))),
                        rollout_engines=engines,
                        worker_state=STATE,
                        weight_version=version,
                    )
                    good = number
                    reports.append({"compat": True})
                    continue
                report = run(main)
            except Exception as exc:
                reports.append(
                    {
                        "error": f"{type(exc).__name__}: {exc}",
                        "types": [c.__name__ for c in type(exc).__mro__],
                        "seconds": time.monotonic() - began,
                    }
                )
                continue
            good = number
            reports.append({"buckets": report.buckets, "source": report.source})
    finally:
        RELEASE.set()
    out["reports"] = reports
    out["seconds"] = time.monotonic() - started
    mine = [e for e in engines if e is not None]
    if mine and cmd.get("ray"):
        import ray

        out["engine_version"], out["exact"] = ray.get(mine[0].state.remote(good), timeout=60)
        ray.kill(mine[0])
        ray.shutdown()  # the local instance goes with the scenario
    elif mine:
        engine = mine[0]
        expected = model(good)
        out["engine_version"] = engine.current_version
        out["exact"] = all(
            all(torch.equal(sink.targets[k], v) for k, v in expected.items())
            for sink in engine._sinks
        )
        engine.close()
    RELEASE.clear()
    return out


def main() -> None:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        try:
            if (
                cmd.get("op") == "pipeline"
            ):  # the native pipeline (tests/helpers/colocate_pipeline.py)
                from tests.helpers.colocate_pipeline import pipeline_scenario

                result = pipeline_scenario(cmd, STATE)
            else:
                result = scenario(cmd)
        except Exception as exc:  # the test reads what went wrong
            result = {"rank": rank, "fatal": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
