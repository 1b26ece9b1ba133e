"""A bucket in several parts (a direct bucket's regions) applied in one sink call.

:func:`aiosync.engine.sinks.apply_parts` hands an in-place :class:`ModuleSink` every part
of a bucket at once (one copy program a part, set up once a bucket); any other sink, and a
subclass that overrides only ``apply_bucket``, gets one ``apply_bucket`` a part. Every
sink kind must end bit-exact, also when the same parts come again (programs reused) and
when a destination gets new storage in between (its program is made again).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

from aiosync import (
    CallbackSink,
    ModuleSink,
    SenderConfig,
    WeightReceiver,
    WeightSender,
    share_tensors,
)
from aiosync.core.layout import SMALL_COPY, TensorSpec, calculate_aligned_size, dtype_name
from aiosync.engine.sinks import apply_parts
from aiosync.runtime import run

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _collected() -> Iterator[None]:
    """Segments made here are gone after each test (other tests count open memfds)."""
    yield
    gc.collect()


Part = tuple[torch.Tensor, list[TensorSpec]]


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """30 tensors: small (copied by address on the CPU) and large, three dtypes."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(30):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        rows = 3 + i if i % 7 else SMALL_COPY // 64 + 5  # every 7th larger than SMALL_COPY
        out[f"t{i}"] = torch.randn(rows, 16, generator=gen).to(dtype)
    return out


def regions_of(tensors: dict[str, torch.Tensor], count: int) -> list[Part]:
    """The tensors laid out in ``count`` regions (flat bytes and specs rebased into each)."""
    names = list(tensors)
    parts: list[Part] = []
    for k in range(count):
        chosen = names[k::count]
        size = sum(calculate_aligned_size(tensors[n].nbytes) for n in chosen)
        region = torch.zeros(size, dtype=torch.uint8)
        specs, offset = [], 0
        for name in chosen:
            t = tensors[name]
            region[offset : offset + t.nbytes] = t.reshape(-1).view(torch.uint8)
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset, t.nbytes))
            offset += calculate_aligned_size(t.nbytes)
        parts.append((region, specs))
    return parts


def refill(parts: list[Part], tensors: dict[str, torch.Tensor]) -> None:
    """New values in the same regions (the same spec lists: a replayed bucket)."""
    for region, specs in parts:
        for spec in specs:
            src = tensors[spec.name].reshape(-1).view(torch.uint8)
            region[spec.offset : spec.offset + spec.nbytes] = src


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in tensors.items()}


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, t in want.items():
        assert torch.equal(got[name], t), name


class CountingSink(ModuleSink):
    """Counts calls; overrides ``apply_parts``, so it still takes parts together."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def apply_parts(self, parts: list[Part]) -> None:
        self.calls.append(len(parts))
        super().apply_parts(parts)


class PerBucketSink(ModuleSink):
    """Overrides only ``apply_bucket``: must get one call a part."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buckets = 0

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.buckets += 1
        super().apply_bucket(bucket, specs)


def test_an_in_place_module_sink_takes_every_part_in_one_call_bit_exact() -> None:
    first, second = model_tensors(1), model_tensors(2)
    target = zeros_like(first)
    sink = CountingSink(target)
    sink.expectations()
    parts = regions_of(first, 4)
    apply_parts(sink, parts)
    equal(target, first)
    refill(parts, second)  # the same spec lists again: the programs are reused
    apply_parts(sink, parts)
    equal(target, second)
    sink.commit(1)
    assert sink.calls == [4, 4]
    target["t3"].data = torch.zeros_like(target["t3"])  # new storage: its program is remade
    target["t7"].data = torch.zeros_like(target["t7"])
    refill(parts, first)
    apply_parts(sink, parts)
    equal(target, first)
    apply_parts(sink, parts)  # and made again from the new storage
    equal(target, first)
    refill(parts, second)
    moved = [(region.clone(), specs) for region, specs in parts]  # same lists, other bytes
    apply_parts(sink, moved)
    equal(target, second)


@pytest.mark.parametrize("kind", ["staged", "renamed", "cast", "tied", "per_bucket"])
def test_other_module_sinks_stay_bit_exact(kind: str) -> None:
    sent = model_tensors(3)
    target = zeros_like(sent)
    if kind == "cast":
        target["t0"] = torch.zeros_like(sent["t0"], dtype=torch.float64)
    if kind == "renamed":
        target = {f"m.{n}": t for n, t in target.items()}
    sink: ModuleSink
    if kind == "staged":
        sink = ModuleSink(target, staged=True)
    elif kind == "renamed":
        sink = ModuleSink(target, rename=lambda name: f"m.{name}")
    elif kind == "cast":
        sink = ModuleSink(target, cast=True)
    elif kind == "tied":
        module = torch.nn.Module()
        for name, t in target.items():
            module.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        tied = module.get_parameter("t5")
        module.register_parameter("alias", tied)  # t5 has two names
        target = dict(module.named_parameters())
        sink = ModuleSink(module)
    else:
        sink = PerBucketSink(target)
    sink.expectations()
    parts = regions_of(sent, 3)
    for _ in range(2):
        apply_parts(sink, parts)
        sink.commit(1)
    if kind == "renamed":
        target = {n[2:]: t for n, t in target.items()}
    if kind == "cast":
        assert torch.equal(target.pop("t0"), sent.pop("t0").double())
    equal(target, sent)
    if kind == "per_bucket":
        assert isinstance(sink, PerBucketSink)
        assert sink.buckets == 6


def test_a_callback_sink_gets_one_call_a_part() -> None:
    sent = model_tensors(4)
    got: dict[str, torch.Tensor] = {}
    calls: list[int] = []

    def load(pairs: Any) -> None:
        pairs = list(pairs)
        calls.append(len(pairs))
        got.update((n, t.clone()) for n, t in pairs)

    apply_parts(CallbackSink(load), regions_of(sent, 3))
    assert calls == [10, 10, 10]
    equal(got, sent)


class Three(torch.nn.Module):
    """Three submodules, each moved into its own shared segment: three regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 24)
        self.b = torch.nn.Linear(24, 8)
        self.c = torch.nn.Embedding(40, 16)
        self.small = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(8))


def test_a_direct_bucket_of_several_regions_reaches_the_sink_in_one_call() -> None:
    torch.manual_seed(0)
    model = Three()
    shares = [share_tensors(sub) for sub in (model.a, model.b, model.c, model.small)]
    engine = Three()
    sink = CountingSink(engine)

    async def main() -> None:
        async with WeightReceiver(sink) as receiver:
            config = SenderConfig(direct=True)
            async with WeightSender(receiver.endpoint, config=config) as sender:
                for version in range(3):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(version + 1.0)
                    report = await sender.send(model)
                    assert report.direct_bytes == report.bytes
                    for name, p in model.state_dict().items():
                        assert torch.equal(engine.state_dict()[name], p), name
                    await anyio.sleep(0)

    run(main)
    assert sink.calls == [4, 4, 4]  # one call a version's one direct bucket, every region
    for share in shares:
        share.close()


def test_a_replayed_bucket_reuses_its_parts_and_other_regions_are_checked_again() -> None:
    """The plane hands out a kept split only for the same spec list with equal regions;
    other regions under the same list are checked as new (and refused when they lie)."""
    from aiosync.core.errors import ProtocolError
    from aiosync.core.wire import DirectPlaneSpec, ShmHandle
    from aiosync.planes.direct import DirectReceiverPlane
    from aiosync.planes.shm import ShmSenderPlane

    first, second = share_tensors(torch.nn.Linear(64, 64)), share_tensors(torch.nn.Linear(8, 8))
    a, b = first.handle, second.handle
    ring = ShmSenderPlane(1, 4096)
    plane = DirectReceiverPlane(DirectPlaneSpec(ring.spec, 1 << 20), torch.device("cpu"), None)
    size_a, size_b = calculate_aligned_size(a.size), calculate_aligned_size(b.size)
    specs = [TensorSpec("w", "uint8", (16,), 0, 16), TensorSpec("v", "uint8", (8,), size_a, 8)]
    try:
        parts = plane.parts(1, size_a + size_b, specs, [a, b], 0)
        assert [view.numel() for view, _ in parts] == [a.size, b.size]
        assert [s.offset for _, group in parts for s in group] == [0, 0]
        again = plane.parts(1, size_a + size_b, specs, [a, b], 1)
        assert again is parts  # nothing checked, opened or split again
        assert all(g is h for (_, g), (_, h) in zip(parts, again, strict=True))
        liar = ShmHandle(b.name, b.size + 512)
        with pytest.raises(ProtocolError, match="bytes for a"):
            plane.parts(1, size_a + size_b, specs, [a, liar], 2)
        swapped = [
            TensorSpec("w", "uint8", (16,), 0, 16),
            TensorSpec("v", "uint8", (8,), size_b, 8),
        ]
        parts = plane.parts(1, size_a + size_b, swapped, [b, a], 2)
        assert [view.numel() for view, _ in parts] == [b.size, a.size]
    finally:
        plane.close()
        ring.close()
        first.close()
        second.close()


def test_regions_read_before_a_rebase_are_closed_once_a_whole_version_skipped_them() -> None:
    """Version numbers may go down (a rebase): a region left behind still closes.

    Room for two regions: version 10 reads ``a``, version 0 (a rebase) ``b``, version 1
    ``c``. ``a`` was not read by version 0, so it is closed when version 1 starts.
    """
    from aiosync.core.wire import DirectPlaneSpec
    from aiosync.planes.direct import DirectReceiverPlane
    from aiosync.planes.shm import ShmSenderPlane

    shares = [share_tensors(torch.nn.Linear(64, 64)) for _ in range(3)]
    a, b, c = (s.handle for s in shares)
    assert a.size == b.size == c.size
    spec_list = [TensorSpec("w", "uint8", (512,), 0, 512)]
    ring = ShmSenderPlane(1, 4096)
    room = DirectPlaneSpec(ring.spec, 2 * a.size + 512)
    plane = DirectReceiverPlane(room, torch.device("cpu"), None)
    used = calculate_aligned_size(a.size)
    try:
        plane.parts(1, used, spec_list, [a], 10)
        plane.parts(1, used, spec_list, [b], 0)
        assert len(plane.parts(1, used, spec_list, [c], 1)) == 1  # no room while a stayed open
    finally:
        plane.close()
        ring.close()
        for s in shares:
            s.close()


def test_a_segment_closed_while_a_sender_looks_a_tensor_up_is_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """:func:`find_shared` racing :meth:`SharedTensors.close` (another thread): None, or the
    segment as it was, never an error (the sender then packs the tensor)."""
    from aiosync.planes.shared_tensors import SharedTensors, find_shared

    model = torch.nn.Linear(8, 8)
    shared = share_tensors(model)
    name = shared.handle.name
    real = SharedTensors.closed.fget  # type: ignore[attr-defined]

    def closing(self: SharedTensors) -> bool:  # the close lands right after the check
        was: bool = real(self)
        self.close()
        return was

    monkeypatch.setattr(SharedTensors, "closed", property(closing))
    try:
        spot = find_shared(model.weight)
        assert spot is None or spot.handle.name == name
    finally:
        shared.close()


def test_regions_close_after_versions_with_packed_buckets_only() -> None:
    """A version with no direct bucket still ends the last one's regions' use: version 0
    reads ``a``; versions 1 and 2 are packed only; version 3 needs room for ``b`` and
    ``c`` (room for two regions), so ``a`` must have been closed by then."""
    from aiosync.core.wire import DirectPlaneSpec
    from aiosync.planes.direct import DirectReceiverPlane
    from aiosync.planes.shm import ShmSenderPlane

    shares = [share_tensors(torch.nn.Linear(64, 64)) for _ in range(3)]
    a, b, c = (s.handle for s in shares)
    spec_list = [TensorSpec("w", "uint8", (512,), 0, 512)]
    ring = ShmSenderPlane(1, 4096)
    room = DirectPlaneSpec(ring.spec, 2 * a.size + 512)
    plane = DirectReceiverPlane(room, torch.device("cpu"), None)
    used = calculate_aligned_size(a.size)
    two = [spec_list[0], TensorSpec("v", "uint8", (512,), used, 512)]
    try:
        plane.parts(1, used, spec_list, [a], 0)
        plane.parts(0, 512, spec_list, [], 1)  # a ring bucket
        plane.parts(0, 512, spec_list, [], 2)
        assert len(plane.parts(1, 2 * used, two, [b, c], 3)) == 2
    finally:
        plane.close()
        ring.close()
        for s in shares:
            s.close()
