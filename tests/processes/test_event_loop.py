"""Per-tensor work never blocks the event loop: it runs in worker threads.

Two kinds of evidence, neither a wall-clock bound: every per-tensor step is seen running on a
thread other than the loop's, and a heartbeat on each side keeps ticking while a version of
100,000 tensors streams (its longest gap stays under a fifth of the whole sync, however fast
or slow the machine is).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.core import engine_session, planning
from aiosync.core.layout_memory import LayoutMemory
from aiosync.core.wire import Begin, Bucket, Complete
from aiosync.planes.shm import ShmSenderPlane
from aiosync.runtime import child_env
from tests.helpers.loop_engine import heartbeat, small_tensors

ROOT = Path(__file__).resolve().parents[2]


async def test_per_tensor_steps_run_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, set[int]] = {}

    def record(step: str) -> None:
        seen.setdefault(step, set()).add(threading.get_ident())

    buckets = planning.VersionLayout.buckets
    lay_out = LayoutMemory.lay_out

    def recording_plan(self: planning.VersionLayout, capacity: int) -> Iterator[Any]:
        for plan in buckets(self, capacity):
            record("plan")
            yield plan

    def recording_manifest(*args: Any, **kwargs: Any) -> Any:
        record("manifest")  # the manifest and the bucket layout, made in one pass
        return lay_out(*args, **kwargs)

    pack = ShmSenderPlane.pack

    def recording_pack(self: ShmSenderPlane, *args: Any) -> None:
        record("pack")
        pack(self, *args)

    receive = engine_session.EngineSession.receive

    def recording_receive(self: Any, peer: Any, message: Any, now: float) -> Any:
        if isinstance(message, Complete) and self.light(peer, message):
            record("count Complete")  # a manifest's stream: counts only, no per-tensor walk
        elif isinstance(message, Begin | Bucket | Complete):
            record(f"check {type(message).__name__}")
        return receive(self, peer, message, now)

    class RecordingSink(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: Any) -> None:
            record("apply")
            super().apply_bucket(bucket, specs)

    monkeypatch.setattr(planning.VersionLayout, "buckets", recording_plan)
    monkeypatch.setattr(LayoutMemory, "lay_out", recording_manifest)
    monkeypatch.setattr(ShmSenderPlane, "pack", recording_pack)
    monkeypatch.setattr(engine_session.EngineSession, "receive", recording_receive)

    weights = small_tensors(5000)
    model = {name: torch.zeros_like(t) for name, t in weights.items()}
    async with (
        WeightReceiver(RecordingSink(model)) as receiver,
        WeightSender(receiver.endpoint, config=SenderConfig(num_buffers=2)) as sender,
    ):
        report = await sender.send(weights, version=0)
    assert report.buckets > 1
    assert all(torch.equal(model[name], t) for name, t in weights.items())
    expected = {
        "plan",
        "manifest",
        "pack",
        "check Begin",
        "check Bucket",
        "count Complete",
        "apply",
    }
    assert set(seen) == expected
    for step, threads in seen.items():
        if step != "count Complete":  # bounded work: the engine runs it on its loop
            assert loop_thread not in threads, f"{step} ran on the event loop"


def test_heartbeats_keep_ticking_while_100k_tensors_stream() -> None:
    count, versions = 100_000, 3
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.loop_engine", str(count), str(versions)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    try:
        assert engine.stdout is not None
        endpoint = json.loads(engine.stdout.readline())["endpoint"]
        trainer = anyio.run(_stream_watching_the_loop, endpoint, count, versions)
        engine_side = [json.loads(engine.stdout.readline()) for _ in range(versions)]
        checked = json.loads(engine.stdout.readline())
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait(timeout=30)
        if engine.stdout is not None:
            engine.stdout.close()
    assert checked["exact"]
    # Version 0 warms caches on both sides; the later ones are the steady state.
    for gap, seconds in trainer[1:]:
        assert gap * 5 < seconds, f"trainer loop stalled {gap:.3f}s of a {seconds:.3f}s sync"
    for event in engine_side[1:]:
        assert event["gap"] * 5 < event["seconds"], event


def _training_step(weights: dict[str, torch.Tensor]) -> None:
    for tensor in weights.values():
        tensor.add_(1.0)


async def _stream_watching_the_loop(
    endpoint: str, count: int, versions: int
) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    weights = small_tensors(count)
    figures = []
    async with WeightSender(endpoint) as sender, anyio.create_task_group() as tg:
        gaps: list[float] = []
        tg.start_soon(heartbeat, gaps)
        for version in range(versions):
            gaps.clear()
            started = time.perf_counter()
            await sender.send(weights, version=version)
            figures.append((max(gaps), time.perf_counter() - started))
            await anyio.to_thread.run_sync(_training_step, weights)
        tg.cancel_scope.cancel()
    return figures
