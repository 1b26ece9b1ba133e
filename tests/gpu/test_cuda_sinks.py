"""A staged engine on a GPU, swapping versions in by copy or by pointer (skip without one).

The engine is a process of its own: CUDA cannot open a process's own IPC handles.
"""

from __future__ import annotations

import pytest

from aiosync import SenderConfig, WeightSender
from tests.conftest import requires_cuda
from tests.helpers.models import mixed_weights
from tests.processes.test_fleet import digests, engine_processes

pytestmark = [pytest.mark.gpu, requires_cuda]
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


@only_asyncio
@pytest.mark.parametrize("swap", ["copy", "pointer"])
async def test_a_staged_cuda_engine_swaps_in_each_version_exactly(swap: str) -> None:
    argv = ["--device", "cuda:0", "--staged", "--swap", swap]
    with engine_processes(argv) as (engine,):
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=60)
        async with WeightSender(engine.endpoint, device="cuda:0", config=config) as sender:
            for version in range(3):
                weights = {n: t.cuda() for n, t in mixed_weights(seed=version + 7).items()}
                await sender.send(weights, version=version)
                committed = await engine.next_commit()
                assert committed["version"] == version
                assert committed["digests"] == digests(weights)
