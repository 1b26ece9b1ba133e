"""AiosyncEngine.update_weights_from_tensor: colocated parts through the engine handles.

Two trainer ranks (made in this process) hand an engine of two sinks one part each per
bucket, through shared-memory buffers; the calls go through the in-process adapter and
through aiosync's control channel. Bit-exact; versions count on across both update paths;
a refused part keeps the previous version and is reported.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import msgspec
import pytest
import torch

from aiosync import ModuleSink
from aiosync.channels.inproc import inproc_pair
from aiosync.core.colocated_parts import FORMAT, RankPart, encode_part
from aiosync.core.layout import plan_buckets
from aiosync.handles import ChannelHandle, EngineHandle, ObjectHandle
from aiosync.handles.channel import serve_peer
from aiosync.handles.engine import AiosyncEngine
from aiosync.planes.shm import ShmSenderPlane


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 16, generator=gen),
        "h": torch.randn(5, generator=gen).to(torch.bfloat16),
        "i": torch.randint(0, 100, (7,), generator=gen),
    }


class Ranks:
    """Two colocated trainer ranks: each packs its part into a buffer of its own."""

    def __init__(self) -> None:
        self.planes = [ShmSenderPlane(1, 1 << 16) for _ in range(2)]

    def bucket(self, seq: int, pairs: list[tuple[str, torch.Tensor]]) -> list[bytes | str]:
        out: list[bytes | str] = []
        for rank, plane in enumerate(self.planes):
            (plan,) = plan_buckets(pairs, plane.capacity)
            plane.pack(0, plan)
            part = RankPart(rank, 0, seq, buffer=plane.spec.buffers[0], used=plan.used)
            out.append(encode_part(msgspec.structs.replace(part, specs=plan.specs)))
        return out

    def last(self, seq: int, commit: bool) -> list[bytes | str]:
        return [encode_part(RankPart(r, 0, seq, last=True, commit=commit)) for r in range(2)]


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    made = Ranks()
    yield made
    for plane in made.planes:
        plane.close()


def engine() -> tuple[AiosyncEngine, list[dict[str, torch.Tensor]]]:
    targets = [{k: torch.zeros_like(v) for k, v in weights(0).items()} for _ in range(2)]
    return AiosyncEngine([ModuleSink(t, staged=True) for t in targets], name="e0"), targets


async def sync(handle: EngineHandle, ranks: Ranks, seed: int, version: str | None) -> None:
    pairs = list(weights(seed).items())
    calls = [
        lambda: ranks.bucket(0, pairs[:2]),  # each packed when its call comes (one buffer)
        lambda: ranks.bucket(1, pairs[2:]),
        lambda: ranks.last(2, commit=False),  # prepare
        lambda: ranks.last(3, commit=True),  # commit
    ]
    for make in calls:
        entries = make()
        with anyio.fail_after(30):
            result = await handle.update_weights_from_tensor(
                entries, load_format=FORMAT, weight_version=version
            )
        assert result.success, result.message


def assert_holds(targets: list[dict[str, torch.Tensor]], seed: int) -> None:
    for target in targets:
        for name, tensor in weights(seed).items():
            assert torch.equal(target[name], tensor), name


async def test_in_process_adapter_applies_parts_and_numbers_versions(ranks: Ranks) -> None:
    made, targets = engine()
    handle = ObjectHandle(made)
    await sync(handle, ranks, 1, None)
    assert made.weight_version == 0
    assert_holds(targets, 1)
    await sync(handle, ranks, 2, "7")
    await sync(handle, ranks, 3, None)  # counts on from the last version, 7
    assert (await handle.check_health()).weight_version == "8"
    assert_holds(targets, 3)
    refused = await handle.update_weights_from_tensor(["not msgpack"], load_format=FORMAT)
    assert not refused.success
    failed = [encode_part(RankPart(r, 0, 0, error="CUDA OOM on purpose")) for r in range(2)]
    refused = await handle.update_weights_from_tensor(failed, load_format=FORMAT)
    assert not refused.success
    assert "CUDA OOM on purpose" in refused.message
    health = await handle.check_health()
    assert health.weight_version == "8"  # the previous version is kept (staged sinks)
    assert "CUDA OOM on purpose" in health.message
    assert_holds(targets, 3)
    made.close()


async def test_channel_adapter_carries_the_parts_as_bytes(ranks: Ranks) -> None:
    made, targets = engine()
    trainer_end, engine_end = inproc_pair("trainer", "engine")
    handle = ChannelHandle(trainer_end, name="remote")
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_peer, engine_end, ObjectHandle(made))
        await sync(handle, ranks, 4, "3")
        assert (await handle.check_health()).weight_version == "3"
        tg.cancel_scope.cancel()
    await engine_end.aclose()
    assert_holds(targets, 4)
    made.close()
