"""The broadcast path through raw Ray actor handles (a local CPU Ray instance, Gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

from aiosync import ModuleSink
from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.handles import RayActorHandle, as_engine_handle
from aiosync.handles.engine import AiosyncEngine
from tests.helpers.models import digest, mixed_weights
from tests.helpers.ray_lock import LockActor, SlowEngine

ray = pytest.importorskip("ray")

ROOT = str(Path(__file__).resolve().parents[2])


class EngineActor(AiosyncEngine):
    """An AiosyncEngine as a Ray actor: staged module sinks built inside the actor."""

    def __init__(self, ranks: int, name: str) -> None:
        self.models = [
            {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
            for _ in range(ranks)
        ]
        super().__init__([ModuleSink(m, staged=True) for m in self.models], name=name, timeout=30)

    def digests(self) -> list[dict[str, str]]:
        return [{n: digest(t) for n, t in model.items()} for model in self.models]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    env = {"PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
        namespace="aiosync-tests",
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_raw_ray_actor_handles_bit_exact_and_disconnect_with_a_dead_engine(
    local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "60")
    actor = ray.remote(EngineActor).options(num_cpus=0, max_concurrency=4)
    engines = [actor.remote(1, "ray-a"), actor.remote(2, "ray-b")]
    lock = ray.remote(LockActor).options(num_cpus=0).remote()
    assert isinstance(as_engine_handle(engines[0]), RayActorHandle)
    try:
        group = connect_rollout_engines_from_distributed(
            group_name="ray", rollout_engines=engines, engine_gpu_counts=[1, 2]
        )
        weights = mixed_weights(seed=4)
        buckets = list(iter_named_tensor_buckets(weights.items(), 128 * 1024))
        broadcast_hf_buckets_via_distributed_impl(
            bucket_iterator=iter(buckets),
            rollout_engines=engines,
            rollout_engine_lock=lock,
            group_name="ray",
            model_update_group=group,
            weight_version=1,
        )
        expected = {n: digest(t) for n, t in weights.items()}
        for engine, ranks in zip(engines, (1, 2), strict=True):
            assert ray.get(engine.digests.remote(), timeout=60) == [expected] * ranks
            assert ray.get(engine.check_health.remote(), timeout=60)["weight_version"] == "1"
        assert ray.get(lock.state.remote(), timeout=60) == (False, len(buckets))
        ray.kill(engines[1])  # gone before the disconnect
        disconnect_rollout_engines_from_distributed(
            group_name="ray", model_update_group=group, rollout_engines=engines
        )
        assert ray.get(engines[0].check_health.remote(), timeout=60)["groups"] == []
    finally:
        for engine in engines:
            ray.kill(engine)
        ray.kill(lock)


async def test_a_ray_call_in_flight_leaves_the_event_loop_running(local_ray: None) -> None:
    seconds, tick = 1.0, 0.01
    actor = ray.remote(SlowEngine).options(num_cpus=0).remote(seconds)
    handle = as_engine_handle(actor, name="slow")
    ticks = 0
    done = anyio.Event()

    async def heartbeat() -> None:
        nonlocal ticks
        while not done.is_set():
            await anyio.sleep(tick)
            ticks += 1

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            with anyio.fail_after(60):
                result = await handle.update_weights_from_distributed(["w"], ["float32"], [[1]])
            done.set()
        assert result.success
        assert result.message == "applied 1 tensors"
        assert ticks >= seconds / tick / 5  # a 5x margin: the loop was never held by Ray
    finally:
        ray.kill(actor)
