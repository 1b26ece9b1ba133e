"""The collective plane over NCCL: trainer on GPU 0, an engine process on GPU 1."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch

from aiosync import AiosyncError, SenderConfig
from aiosync.planes.collective import CollectiveOptions
from aiosync.trainer.collective import CollectiveSender
from tests.conftest import requires_two_gpus
from tests.models import mixed_weights
from tests.test_collectives_plane import Proc, digests, engines

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


def on_gpu0(seed: int) -> dict[str, torch.Tensor]:
    return {name: t.to("cuda:0") for name, t in mixed_weights(seed=seed).items()}


def nccl_sender(
    targets: list[Proc], *, per_tensor: bool, timeout: float, overlap: bool = False
) -> CollectiveSender:
    options = CollectiveOptions(
        engines=len(targets), per_tensor=per_tensor, timeout=timeout, overlap=overlap
    )
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=timeout)
    return CollectiveSender(
        [t.endpoint for t in targets], collective=options, device="cuda:0", config=config
    )


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
async def test_nccl_every_mode_bit_exact_gpu0_to_gpu1() -> None:
    with engines(["--device", "cuda:1"]) as (engine,):
        modes = ((False, False), (True, False), (False, True), (False, True))
        for version, (per_tensor, overlap) in enumerate(modes):
            async with nccl_sender(
                [engine], per_tensor=per_tensor, timeout=120, overlap=overlap
            ) as sender:
                await sender.send(on_gpu0(version + 1), version=version)
            committed = await engine.until("committed")
            assert committed["version"] == version
            assert committed["digests"] == digests(version + 1)


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
async def test_nccl_frozen_engine_is_aborted_at_the_deadline_then_a_new_group_works() -> None:
    slow = ["--device", "cuda:1", "--slow-version", "1", "--delay", "30"]
    with engines(slow) as (frozen,):
        async with nccl_sender([frozen], per_tensor=False, timeout=5) as sender:
            await sender.send(on_gpu0(1), version=0)
            async with anyio.create_task_group() as tg:

                async def freeze() -> None:
                    await frozen.until("applying", version=1)
                    os.kill(frozen.proc.pid, signal.SIGSTOP)

                tg.start_soon(freeze)
                with anyio.fail_after(120), pytest.raises(AiosyncError):
                    await sender.send(on_gpu0(2), version=1)
    with engines(["--device", "cuda:1"]) as (fresh,):  # this process is not wedged
        async with nccl_sender([fresh], per_tensor=False, timeout=120) as sender:
            await sender.send(on_gpu0(3), version=0)
        assert (await fresh.until("committed"))["digests"] == digests(3)
