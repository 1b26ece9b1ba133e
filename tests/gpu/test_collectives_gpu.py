"""The collective plane over NCCL: trainer on GPU 0, an engine process on GPU 1.

Every mode bit-exact, with the trainer overwriting its tensors on its own stream as soon
as the send says they are packed (the GPU orders packing and broadcasts before those
writes: nothing waits on the host per bucket); a frozen engine aborted at the deadline; a
trainer killed mid-broadcast leaving the engine on its previous version; a refused bucket
still received, so the group stays whole.
"""

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
from tests.helpers.models import mixed_weights
from tests.processes.test_collectives_plane import Proc, digests, engines, processes

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


def on_gpu0(seed: int) -> dict[str, torch.Tensor]:
    return {name: t.to("cuda:0") for name, t in mixed_weights(seed=seed).items()}


def nccl_sender(targets: list[Proc], *, per_tensor: bool, timeout: float) -> CollectiveSender:
    options = CollectiveOptions(engines=len(targets), per_tensor=per_tensor, timeout=timeout)
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=timeout)
    return CollectiveSender(
        [t.endpoint for t in targets], collective=options, device="cuda:0", config=config
    )


async def send_then_overwrite(
    sender: CollectiveSender, weights: dict[str, torch.Tensor], version: int
) -> None:
    """Send; once the send says every byte is packed, overwrite the tensors on the GPU."""
    packed = anyio.Event()

    async def overwrite() -> None:
        await packed.wait()
        for tensor in weights.values():
            tensor.fill_(7)  # queued on the trainer's stream, behind the packing it waits on

    async with anyio.create_task_group() as tg:
        tg.start_soon(overwrite)
        await sender.send(weights, version=version, packed=packed)


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
async def test_nccl_every_mode_bit_exact_gpu0_to_gpu1() -> None:
    with engines(["--device", "cuda:1"]) as (engine,):
        for step, per_tensor in enumerate((False, True, False, True)):
            async with nccl_sender([engine], per_tensor=per_tensor, timeout=120) as sender:
                await send_then_overwrite(sender, on_gpu0(step + 1), 2 * step)
                await sender.send(on_gpu0(step + 11), version=2 * step + 1)  # same group
            for sent, seed in ((2 * step, step + 1), (2 * step + 1, step + 11)):
                committed = await engine.until("committed")
                assert committed["version"] == sent
                assert committed["digests"] == digests(seed)


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


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
async def test_nccl_trainer_killed_mid_broadcast_leaves_the_engine_on_its_version() -> None:
    slow = ["--device", "cuda:1", "--slow-version", "1", "--delay", "1", "--timeout", "5"]
    with engines(slow) as (engine,):
        with processes(
            "tests.helpers.collective_trainer", ["--device", "cuda:0", engine.endpoint]
        ) as (trainer,):
            assert (await trainer.until("sent"))["version"] == 0
            await engine.until("applying", version=1)
            trainer.proc.kill()
            failed = await engine.until("failed", version=1)
            assert failed["current"] == 0
            assert failed["digests"] == digests(1)
        async with nccl_sender([engine], per_tensor=False, timeout=60) as sender:  # a new group
            await sender.send(on_gpu0(3), version=1)
        assert (await engine.until("committed"))["digests"] == digests(3)


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
@pytest.mark.parametrize("per_tensor", [False, True])
async def test_nccl_a_refused_bucket_is_still_received_and_the_group_stays_whole(
    per_tensor: bool,
) -> None:
    with engines(["--device", "cuda:1", "--refuse-version", "1"]) as (engine,):
        async with nccl_sender([engine], per_tensor=per_tensor, timeout=60) as sender:
            await sender.send(on_gpu0(1), version=0)
            with pytest.raises(AiosyncError, match="refused on purpose"):
                await sender.send(on_gpu0(2), version=1)
            failed = await engine.until("failed", version=1)  # (reported before version 2)
            assert (failed["current"], failed["digests"]) == (0, digests(1))
            await sender.send(on_gpu0(3), version=2)  # the broadcasts stayed in step
        committed = await engine.until("committed")
        assert (committed["version"], committed["digests"]) == (2, digests(3))
