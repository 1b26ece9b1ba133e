"""Making a staged version live: pointer swap and copy, and the memory staging takes.

``swap="pointer"`` hands the staged storage to the live tensors and keeps the old one as
the next staging area (two storages per tensor, alternating; tied names stay tied);
``swap="copy"`` copies, so the live tensors never move. ``reserve()`` allocates the staged
copy when the receiver starts and refuses, naming the bytes needed and free, when it does
not fit.
"""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from torch import nn

from aiosync import (
    AiosyncError,
    ModuleSink,
    RejectedError,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.core import where_to_run
from aiosync.core.layout import TensorSpec
from aiosync.engine import staging
from aiosync.engine.staging import Swap

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)


class Net(nn.Module):
    """Six 64x64 layers (about 100 KB: two 64 KiB buckets) and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
        self.register_buffer("scale", torch.rand(64))


class Tied(nn.Module):
    """GPT-2's tying: ``lm_head.weight`` is ``wte.weight``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(300, 64)  # 76.8 KB: chunked across 64 KiB buckets
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 300, bias=False)
        self.lm_head.weight = self.wte.weight


def model_bytes(module: nn.Module) -> int:
    """Bytes of each distinct storage among the module's parameters and buffers."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in module.state_dict().values()}
    return sum(seen.values())


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def first_weight(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


async def test_pointer_swap_is_exact_and_alternates_between_two_storages() -> None:
    engine = Net(seed=0)
    weight = first_weight(engine)
    pointers = [weight.data_ptr()]
    sink = ModuleSink(engine, staged=True, swap="pointer")
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        assert sink.extra_bytes == model_bytes(engine)  # reserved when the receiver started
        for version in range(1, 6):
            trainer = Net(seed=version)
            await sender.send(trainer.state_dict(), version=version)
            assert same(engine, trainer), version
            assert first_weight(engine) is weight  # the same Parameter, new storage
            pointers.append(weight.data_ptr())
        assert sink.extra_bytes == model_bytes(engine)  # no allocation per version
    assert len(set(pointers)) == 2
    assert pointers[0::2] == [pointers[0]] * 3 and pointers[1::2] == [pointers[1]] * 3  # noqa: PT018


async def test_copy_swap_keeps_the_live_tensors_where_they_are() -> None:
    engine = Net(seed=0)
    before = {name: t.data_ptr() for name, t in engine.state_dict().items()}
    async with (
        WeightReceiver(ModuleSink(engine, staged=True)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        for version in range(1, 4):
            trainer = Net(seed=version)
            await sender.send(trainer.state_dict(), version=version)
            assert same(engine, trainer)
            assert {n: t.data_ptr() for n, t in engine.state_dict().items()} == before


@pytest.mark.parametrize("swap", ["pointer", "copy"])
async def test_tied_weights_stay_tied(swap: Swap) -> None:
    engine = Tied(seed=0)
    sink = ModuleSink(engine, staged=True, swap=swap)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        assert sink.extra_bytes == model_bytes(engine)  # one staged copy of the tied tensor
        pointers = set()
        for version in range(1, 5):
            trainer = Tied(seed=version)
            await sender.send(trainer.state_dict(), version=version)
            assert engine.lm_head.weight is engine.wte.weight
            assert torch.equal(engine.wte.weight, trainer.wte.weight)
            assert same(engine, trainer)
            pointers.add(engine.wte.weight.data_ptr())
    assert len(pointers) == (2 if swap == "pointer" else 1)


async def test_tied_names_of_a_map_move_together() -> None:
    base = torch.zeros(64, 64)
    targets = {"embed": base, "head": base.view(64, 64), "norm": torch.zeros(64)}
    async with (
        WeightReceiver(ModuleSink(targets, staged=True, swap="pointer")) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        pointers = {base.data_ptr()}
        for version in range(1, 4):
            sent = {"embed": torch.full((64, 64), float(version)), "norm": torch.ones(64)}
            await sender.send(sent, version=version)
            assert targets["embed"].data_ptr() == targets["head"].data_ptr()
            assert targets["head"].eq(version).all()
            assert targets["norm"].eq(1).all()
            pointers.add(targets["head"].data_ptr())
    assert len(pointers) == 2


async def test_a_tensor_also_held_elsewhere_is_copied_not_swapped() -> None:
    engine = Net(seed=0)
    before = {name: t.data_ptr() for name, t in engine.state_dict().items()}
    state = engine.state_dict()  # detached tensors sharing the module's storages
    async with (
        WeightReceiver(ModuleSink(state, staged=True, swap="pointer")) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        for version in range(1, 4):
            trainer = Net(seed=version)
            await sender.send(trainer.state_dict(), version=version)
            assert same(engine, trainer)  # the module itself sees every version
            assert {n: t.data_ptr() for n, t in engine.state_dict().items()} == before


@pytest.mark.parametrize("swap", ["pointer", "copy"])
async def test_a_failed_version_leaves_the_live_weights_untouched(swap: Swap) -> None:
    armed = [False]
    buckets = [0]

    class Faulty(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            buckets[0] += 1
            if armed[0] and buckets[0] == 2:  # the first bucket was written, then this
                raise RuntimeError("engine fell over")
            super().apply_bucket(bucket, specs)

    engine = Net(seed=0)
    async with (
        WeightReceiver(Faulty(engine, staged=True, swap=swap)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        one = Net(seed=1)
        await sender.send(one.state_dict(), version=1)
        pointer = first_weight(engine).data_ptr()
        armed[0], buckets[0] = True, 0
        with pytest.raises(RejectedError, match="engine fell over"):
            await sender.send(Net(seed=2).state_dict(), version=2)
        assert receiver.current_version == 1
        assert receiver.servable
        assert same(engine, one)
        assert first_weight(engine).data_ptr() == pointer
        armed[0] = False
        three = Net(seed=3)
        await sender.send(three.state_dict(), version=3)  # over the half-written staging area
        assert same(engine, three)


async def test_a_staged_copy_that_does_not_fit_is_refused_when_the_receiver_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "free_bytes", lambda device: 4096)
    engine = Net(seed=0)
    needed = model_bytes(engine)
    sink = ModuleSink(engine, staged=True, swap="pointer")
    with pytest.raises(AiosyncError, match=f"needs {needed:,} bytes on cpu .* 4,096 bytes"):
        async with WeightReceiver(sink):
            pass  # never reached
    assert sink.extra_bytes == 0  # nothing was allocated

    in_place = ModuleSink(engine)  # needs no second copy: starts, holds nothing extra
    async with WeightReceiver(in_place):
        assert in_place.extra_bytes == 0


def test_reserve_allocates_one_copy_of_the_model() -> None:
    engine = Tied(seed=0)
    sink = ModuleSink(engine, staged=True)
    assert sink.extra_bytes == 0
    sink.reserve()
    assert sink.extra_bytes == model_bytes(engine)
    sink.reserve()  # idempotent
    assert sink.extra_bytes == model_bytes(engine)
    in_place = ModuleSink(engine)
    in_place.reserve()
    assert in_place.extra_bytes == 0


def test_free_bytes_knows_the_host() -> None:
    free = staging.free_bytes(torch.device("cpu"))
    assert free is None or free > 0


def test_an_unknown_swap_is_refused() -> None:
    with pytest.raises(ValueError, match="swap must be one of"):
        ModuleSink(Net(seed=0), staged=True, swap="move")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs staged=True"):
        ModuleSink(Net(seed=0), swap="pointer")


async def test_requests_under_read_leases_see_one_version_with_pointer_swap() -> None:
    names = [f"layer.{i}" for i in range(8)]
    model = {name: torch.zeros(4096) for name in names}
    seen: list[int] = []

    async def request() -> None:
        async with receiver.serving() as version:
            if version is None:
                return
            first = [float(model[name][0]) for name in names]
            await anyio.sleep(0.003)  # versions arrive meanwhile
            last = [float(model[name][-1]) for name in names]
            assert first == last == [float(version)] * len(names), (version, first, last)
            seen.append(version)

    async with (
        WeightReceiver(ModuleSink(model, staged=True, swap="pointer")) as receiver,
        WeightSender(receiver.endpoint, config=SenderConfig(buffer_bytes=16 << 10)) as sender,
        anyio.create_task_group() as tg,
    ):
        for version in range(1, 8):
            for _ in range(4):
                tg.start_soon(request)
            await sender.send(
                {n: torch.full((4096,), float(version)) for n in names}, version=version
            )
        await anyio.sleep(0.01)
    assert receiver.current_version == 7
    assert seen == sorted(seen) and len(set(seen)) > 1  # noqa: PT018


async def test_a_view_taken_between_pointer_swaps_gets_each_version_by_copy() -> None:
    engine = Net(seed=0)
    weight = first_weight(engine)
    async with (
        WeightReceiver(ModuleSink(engine, staged=True, swap="pointer")) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        for version in (1, 2):  # swapped by pointer: the live storage is a staged one now
            await sender.send(Net(seed=version).state_dict(), version=version)
        held = engine.state_dict()  # views of the live storages, kept past a lease
        pointer = weight.data_ptr()
        for version in (3, 4):  # copied: the views see each version, never a staging area
            trainer = Net(seed=version)
            await sender.send(trainer.state_dict(), version=version)
            assert same(engine, trainer)
            assert all(torch.equal(held[k], v) for k, v in trainer.state_dict().items())
            assert weight.data_ptr() == pointer
        del held
        await sender.send(Net(seed=5).state_dict(), version=5)  # no view: swapped again
        assert same(engine, Net(seed=5))
        assert weight.data_ptr() != pointer


@pytest.mark.parametrize("case", ["pointer", "copy", "held view", "own commit", "many tensors"])
async def test_only_a_commit_that_moves_no_bytes_runs_on_the_event_loop(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.current_thread()
    calls: list[tuple[bool, bool]] = []  # (on the loop's thread, pointers only)
    commit = staging.Staging.commit

    def watched(self: staging.Staging, *, pointers_only: bool = False) -> list[str] | None:
        calls.append((threading.current_thread() is loop_thread, pointers_only))
        return commit(self, pointers_only=pointers_only)

    class OwnCommit(ModuleSink):
        def commit(self, version: int) -> None:
            super().commit(version)

    monkeypatch.setattr(staging.Staging, "commit", watched)
    if case == "many tensors":
        monkeypatch.setattr(where_to_run, "LOOP_ENTRIES", 4)  # Net has 13
    engine = Net(seed=0)
    kind = OwnCommit if case == "own commit" else ModuleSink
    sink = kind(engine, staged=True, swap="copy" if case == "copy" else "pointer")
    held = engine.state_dict() if case == "held view" else None
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        trainer = Net(seed=1)
        await sender.send(trainer.state_dict(), version=1)
        assert same(engine, trainer)
    expected = {
        "pointer": [(True, True)],  # swapped on the loop, no thread hop
        "copy": [(True, True), (False, False)],  # bytes move: in a worker thread
        "held view": [(True, True), (False, False)],
        "own commit": [(False, False)],  # a subclass's commit is always called
        "many tensors": [(False, False)],  # per-tensor work beyond the bound: off the loop
    }[case]
    assert calls == expected
    assert held is None or torch.equal(held["layers.0.weight"], trainer.layers[0].weight)


def test_weights_off_the_cpu_are_always_committed_in_a_worker_thread() -> None:
    # their commit waits for the device's queued copies: never on the event loop
    sink = ModuleSink({"w": torch.empty(4, device="meta")}, staged=True, swap="pointer")
    assert not sink.commit_quickly(0)
    assert ModuleSink({"w": torch.zeros(4)}).commit_quickly(0)  # in place on the CPU: nothing
