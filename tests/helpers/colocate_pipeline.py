"""The native-pipeline scenarios of the colocated-topology worker
(tests/helpers/colocate_worker.py).

Every rank sends its own shard (a model seeded by the version and the rank's place in its
engine's range); each engine is a :class:`~aiosync.WeightReceiver` over a
:class:`~aiosync.topology.sink.RankedSink` in its source rank's process, reached through an
in-process channel, reading the other ranks' sealed memfds.
"""

from __future__ import annotations

import threading
import time
from contextlib import AsyncExitStack
from typing import Any

import torch
import torch.distributed as dist

from aiosync.channels.inproc import InprocListener
from aiosync.core.layout import TensorSpec
from aiosync.engine.receiver import WeightReceiver
from aiosync.engine.sinks import ModuleSink
from aiosync.runtime import run
from aiosync.topology import connect_topology
from aiosync.topology.pipeline import ColocatedSession
from aiosync.topology.sink import RankedSink

RELEASE = threading.Event()  # frees an engine told to hang, once the versions are sent


def shard(number: int, pos: int) -> dict[str, torch.Tensor]:
    """Rank ``pos``'s shard of model ``number``: mixed dtypes, different on every rank."""
    gen = torch.Generator().manual_seed(1000 * number + pos)
    out: dict[str, torch.Tensor] = {}
    for i in range(5):
        base = torch.randn((3 + i, 4 + pos), generator=gen)
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        out[f"layers.{i}.w"] = (base * 100).to(dtype) if dtype is torch.int64 else base.to(dtype)
    return out


class CountingSink(ModuleSink):
    """A staged module sink that counts buckets and may refuse one (a broken engine)."""

    def __init__(self, targets: dict[str, torch.Tensor], fail_at: int | None, hang: bool) -> None:
        super().__init__(targets, staged=True)
        self.applied = 0
        self.fail_at = fail_at
        self.hang = hang

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        if self.applied == self.fail_at:
            if self.hang:  # a silent engine, freed once the trainer ranks gave up on it
                RELEASE.wait(60)
            raise RuntimeError("out of memory on purpose")
        self.applied += 1
        super().apply_bucket(bucket, specs)


def pipeline_scenario(cmd: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Versions ``cmd["versions"]`` through the native pipeline; each rank's view of them."""
    rank = dist.get_rank()
    layout = connect_topology(engine_gpu_counts=cmd["counts"], worker_state=state)
    mine = layout.engine_of(rank)
    pos = 0 if mine is None else rank - mine.source
    fail = cmd.get("fail") or {}
    out: dict[str, Any] = {"rank": rank, "engine": None if mine is None else mine.index}

    async def main() -> None:
        engines: list[Any] = [None] * len(layout.engines)
        sinks: list[CountingSink] = []
        receiver: WeightReceiver | None = None
        async with AsyncExitStack() as stack:
            if mine is not None and mine.source == rank:
                for p in range(mine.count):
                    fail_at = fail.get("at") if fail.get("engine") == mine.index else None
                    targets = {k: v.clone() for k, v in shard(0, p).items()}  # "version 0"
                    at = fail_at if p == fail.get("pos") else None
                    sinks.append(CountingSink(targets, at, bool(fail.get("hang"))))
                listener = InprocListener(f"engine-{mine.index}")
                receiver = WeightReceiver(RankedSink(sinks), listener)
                await stack.enter_async_context(receiver)
                engines[mine.index] = listener.connect()
            session = ColocatedSession(
                state,
                engines,
                buffer_bytes=1024,
                policy=cmd.get("policy", "all"),
                link_timeout=cmd.get("link_timeout"),
            )
            await stack.enter_async_context(session)
            reports: list[Any] = []
            good = 0
            for number, version in enumerate(cmd["versions"], start=1):
                tensors = shard(number, pos)
                if cmd.get("extra") == rank:  # a tensor the engine does not have
                    tensors["extra.w"] = torch.ones(2)
                if cmd.get("unplannable") == rank and number == 1:  # not a tensor: cannot plan
                    tensors["layers.0.w"] = "not a tensor"  # type: ignore[assignment]
                began = time.monotonic()
                try:
                    report = await session.send(tensors.items(), weight_version=version)
                except Exception as exc:
                    reports.append({"error": f"{type(exc).__name__}: {exc}"})
                else:
                    good = number if report.sync is not None else good
                    reports.append(
                        {
                            "version": report.version,
                            "committed": list(report.committed),
                            "failed": list(report.failed),
                        }
                    )
                reports[-1]["seconds"] = time.monotonic() - began
            out["reports"] = reports
            RELEASE.set()
            if receiver is not None and mine is not None:
                out["engine_version"] = receiver.current_version
                out["applied"] = [s.applied for s in sinks]
                out["exact_last"] = all(
                    all(torch.equal(s.targets[k], v) for k, v in shard(good, p).items())
                    for p, s in enumerate(sinks)
                )
                out["good"] = good

    try:
        run(main)
    finally:
        RELEASE.clear()
    return out
