"""Direct mode on the CPU: engines read a trainer's shared tensors in place (issue 10, item 2).

The trainer's module is moved into one shared segment (:func:`aiosync.share_tensors`);
a sender with ``SenderConfig(direct=True)`` sends its parameters as direct buckets and
everything else (temporaries) packed, in the same version.
"""

from __future__ import annotations

import contextlib
import gc
import os

import anyio
import pytest
import torch

from aiosync import (
    ModuleSink,
    RejectedError,
    SenderConfig,
    SyncReport,
    WeightReceiver,
    WeightSender,
    share_tensors,
)
from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.layout import TensorSpec
from aiosync.core.wire import CudaRegion, DirectPlaneSpec, ShmHandle
from aiosync.planes.direct import MAX_REGIONS_PER_BUCKET, DirectReceiverPlane
from aiosync.planes.shared_tensors import ATTRIBUTE, find_shared
from aiosync.planes.shm import ShmSenderPlane
from aiosync.runtime import run

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    """Parameters of several dtypes, a persistent buffer, and a tied pair."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 24)
        self.low = torch.nn.Parameter(torch.randn(33, 7).to(torch.bfloat16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.arange(5, dtype=torch.float64))


def memfds() -> int:
    """This process's open descriptors on aiosync memfds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += "memfd:aiosync" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def step(model: Net, version: int) -> None:
    """An optimizer step's worth of change, in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.full_like(p, 0.5 + version))


def source(model: Net) -> dict[str, torch.Tensor]:
    """The module's parameters plus two temporaries (a cast and a gathered-like clone)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors["scale"] = model.scale * 2  # a temporary computed from a buffer
    tensors["proj.bias"] = model.proj.bias.detach().clone()  # a temporary copy
    return tensors


def check_equal(engine: Net, sent: dict[str, torch.Tensor]) -> None:
    got: dict[str, torch.Tensor] = dict(engine.named_parameters())
    got["scale"] = engine.scale
    for name, tensor in sent.items():
        assert torch.equal(got[name], tensor), name


def expected_split(sent: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(direct, packed) bytes: parameters in the segment go direct, the rest packed."""
    direct = sum(
        t.nbytes
        for t in sent.values()
        if isinstance(t, torch.nn.Parameter) and find_shared(t) is not None
    )
    return direct, sum(t.nbytes for t in sent.values()) - direct


async def stream(
    model: Net,
    versions: int,
    between: object = None,
) -> tuple[list[SyncReport], WeightReceiver]:
    torch.manual_seed(1)
    engine = Net()
    reports = []
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        config = SenderConfig(direct=True, buffer_bytes=4096)
        async with WeightSender(receiver.endpoint, config=config) as sender:
            for version in range(versions):
                if callable(between):
                    between(model, version)
                step(model, version)
                sent = source(model)
                report = await sender.send(sent)
                check_equal(engine, sent)
                reports.append(report)
                direct, packed = expected_split(sent)
                assert (report.direct_bytes, report.packed_bytes) == (direct, packed)
        assert not receiver._planes  # the session's regions are closed with it
    return reports, receiver


def ten_versions() -> None:
    torch.manual_seed(0)
    model = Net()
    shared = share_tensors(model)
    assert getattr(model, ATTRIBUTE) is shared
    assert model.head.weight is model.embed.weight  # still tied

    async def main() -> None:
        reports, _ = await stream(model, 10)
        assert all(r.direct_bytes > 0 and r.packed_bytes > 0 for r in reports)
        # the two temporaries are not parameters: packed, and the note says why
        assert all(r.direct_note.startswith("2 tensors") for r in reports)
        assert all("not persistent" in r.direct_note for r in reports)

    run(main)
    shared.close()


def test_ten_versions_bit_exact_with_the_byte_split_exact() -> None:
    """... and nothing left open once the module is gone (the mapping's own descriptor
    lives as long as a tensor views the segment)."""
    gc.collect()  # what earlier tests left for the collector is not this test's
    before = memfds()
    ten_versions()
    gc.collect()
    assert memfds() == before
    second = share_tensors(Net())  # never closed: its module's end closes it
    assert memfds() > before
    del second
    gc.collect()
    assert memfds() == before


def test_steady_versions_are_read_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a version was split, the next ones (the split kept) skip the reading thread."""
    import aiosync.trainer.sender as sender_module

    threaded: list[int] = []
    read_ahead = sender_module.read_ahead

    def counted(read: object, plane: object, version: int) -> object:
        threaded.append(version)
        return read_ahead(read, plane, version)  # type: ignore[arg-type]

    monkeypatch.setattr(sender_module, "read_ahead", counted)
    torch.manual_seed(0)
    model = Net()
    with share_tensors(model):
        run(lambda: stream(model, 4))  # bit-exact and the byte split checked each version
    assert threaded == [0]


def test_a_module_as_source_goes_direct_whole() -> None:
    torch.manual_seed(0)
    model = Net()
    with share_tensors(model):

        async def main() -> None:
            engine = Net()
            async with WeightReceiver(ModuleSink(engine)) as receiver:
                config = SenderConfig(direct=True)
                async with WeightSender(receiver.endpoint, config=config) as sender:
                    report = await sender.send(model)
            total = sum(t.nbytes for t in [*model.parameters(), model.scale])
            assert report.direct_bytes == report.bytes == total
            assert torch.equal(engine.proj.weight, model.proj.weight)
            assert torch.equal(engine.scale, model.scale)  # a buffer in the segment: direct

        run(main)


def test_a_replaced_storage_is_packed_then_a_new_segment_is_opened() -> None:
    """Version 3 gives one parameter new (unshared) memory: it is packed and the report
    says why; version 6 moves the module into a new segment: the engine opens it, and
    closes the old one once a whole version did not read it."""
    torch.manual_seed(0)
    model = Net()
    share_tensors(model)
    notes: dict[int, str] = {}

    def between(model: Net, version: int) -> None:
        if version == 3:
            model.proj.weight.data = model.proj.weight.detach().clone()
        if version == 6:
            getattr(model, ATTRIBUTE).close()
            delattr(model, ATTRIBUTE)
            share_tensors(model)

    async def main() -> None:
        reports, _ = await stream(model, 9, between)
        for r in reports:
            notes[r.version] = r.direct_note
        assert reports[3].packed_bytes - reports[2].packed_bytes == model.proj.weight.nbytes
        assert reports[8].packed_bytes == reports[0].packed_bytes

    run(main)
    assert notes[2] == notes[6]
    assert "not in a shared segment" not in notes[2]
    assert "1 tensors" in notes[3]
    assert "not in a shared segment" in notes[3]
    getattr(model, ATTRIBUTE).close()


def test_named_tensors_only_and_the_packed_event_waits_for_the_commit() -> None:
    torch.manual_seed(0)
    model = Net()
    with share_tensors(model):

        async def main() -> None:
            engine = Net()
            async with WeightReceiver(ModuleSink(engine)) as receiver:
                config = SenderConfig(direct={"proj.weight"})
                async with WeightSender(receiver.endpoint, config=config) as sender:
                    packed = anyio.Event()
                    seen: list[bool] = []
                    receiver_version = []

                    async def watch() -> None:
                        await packed.wait()
                        seen.append(True)
                        receiver_version.append(receiver.current_version)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(watch)
                        report = await sender.send(source(model), packed=packed)
            assert report.direct_bytes == model.proj.weight.nbytes
            assert receiver_version == [0]  # set only once the engines had read

        run(main)


def plane() -> tuple[ShmSenderPlane, DirectReceiverPlane]:
    ring = ShmSenderPlane(1, 4096)
    return ring, DirectReceiverPlane(DirectPlaneSpec(ring.spec, 1 << 20), torch.device("cpu"), None)


def spec(offset: int, nbytes: int) -> TensorSpec:
    return TensorSpec("w", "uint8", (nbytes,), offset, nbytes)


def test_hostile_region_specs_are_refused_with_a_clear_error() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    shared = share_tensors(model)
    good = shared.handle
    second = share_tensors(torch.nn.Linear(64, 64))
    other = second.handle
    ring, receiver = plane()
    try:
        size = -(-good.size // 512) * 512
        ok = receiver.parts(1, size, [spec(0, 512)], [good], 0)
        assert len(ok) == 1
        assert ok[0][0].numel() == good.size
        cases: list[tuple[object, str]] = [
            (lambda: receiver.parts(1, size, [spec(0, 1)], [], 0), "0 regions"),
            (
                lambda: receiver.parts(1, 0, [], [good] * (MAX_REGIONS_PER_BUCKET + 1), 0),
                "regions (1-",
            ),
            (lambda: receiver.parts(1, 2 * size, [], [good, good], 0), "named twice"),
            (lambda: receiver.parts(1, size + 512, [spec(0, 1)], [good], 0), "bytes for a"),
            (
                lambda: receiver.parts(1, 2 * size, [spec(size - 512, 1024)], [good, other], 0),
                "past the end",
            ),
            (lambda: receiver.parts(0, size, [spec(0, 1)], [good], 0), "ring buffer 0"),
            (lambda: receiver.view(1, 10), "without its regions"),
            (
                lambda: receiver.parts(1, 512, [spec(0, 1)], [ShmHandle(good.name, 0)], 0),
                "region of 0 bytes",
            ),
            (
                lambda: receiver.parts(1, 2 << 20, [], [ShmHandle(good.name, 2 << 20)], 0),
                "most",
            ),
            (
                lambda: receiver.parts(1, 512, [spec(0, 1)], [ShmHandle("/etc/passwd", 10)], 0),
                "no sealed memfd",
            ),
            (
                lambda: receiver.parts(1, 512, [spec(0, 1)], [CudaRegion(b"x" * 64, 10)], 0),
                "no sealed memfd",
            ),
        ]
        for call, text in cases:
            with pytest.raises(ProtocolError, match=text.replace("(", r"\(")):
                call()  # type: ignore[operator]
        with pytest.raises(AiosyncError, match=r"size|bytes"):  # a size the segment is not
            receiver.parts(1, size + 512, [spec(0, 1)], [ShmHandle(good.name, good.size + 512)], 1)
    finally:
        receiver.close()
        ring.close()
        shared.close()
        second.close()


def test_a_bucket_naming_regions_on_a_packed_session_is_refused() -> None:
    """A sender that is not in direct mode cannot make an engine open its regions."""
    from aiosync.core.engine_actions import Apply
    from aiosync.planes import view_parts
    from aiosync.planes.shm import ShmReceiverPlane

    ring = ShmSenderPlane(1, 4096)
    receiver = ShmReceiverPlane(ring.spec)
    try:
        action = Apply("peer", 0, 1, 0, 512, [spec(0, 1)], [ShmHandle("x", 512)])
        with pytest.raises(ProtocolError, match="not in direct mode"):
            view_parts(receiver, action)
    finally:
        receiver.close()
        ring.close()


def test_an_engine_refuses_a_version_whose_region_lies_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: regions whose sizes do not add up to the bucket fail the version."""
    import aiosync.trainer.direct as reader_module

    honest = reader_module.direct_plans

    def lying(*args: object) -> object:
        plans, metas, moved = honest(*args)  # type: ignore[arg-type]
        for plan in plans:
            plan.regions = [ShmHandle(r.name, r.size + 4096) for r in plan.regions]  # type: ignore[union-attr]
        return plans, metas, moved

    monkeypatch.setattr(reader_module, "direct_plans", lying)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with share_tensors(model):

        async def main() -> None:
            engine = torch.nn.Linear(8, 8)
            async with WeightReceiver(ModuleSink(engine)) as receiver:
                config = SenderConfig(direct=True)
                async with WeightSender(receiver.endpoint, config=config) as sender:
                    with pytest.raises(RejectedError, match=r"regions of .* bytes for a direct"):
                        await sender.send(model)
                assert receiver.current_version is None

        run(main)


def test_a_region_of_more_tensors_than_a_bucket_holds_spans_buckets() -> None:
    torch.manual_seed(0)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(5000))
    engine = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(3)) for _ in range(5000))
    with share_tensors(model):

        async def main() -> None:
            async with WeightReceiver(ModuleSink(engine)) as receiver:
                config = SenderConfig(direct=True)
                async with WeightSender(receiver.endpoint, config=config) as sender:
                    for _ in range(2):
                        report = await sender.send(model)
                        assert report.direct_bytes == report.bytes == 5000 * 12
                        assert report.buckets == 2  # 4096 tensors a bucket at most
                        assert all(torch.equal(a, b) for a, b in zip(engine, model, strict=True))
                        with torch.no_grad():
                            for p in model:
                                p.mul_(2)

        run(main)


def test_a_closed_segment_between_versions_sends_its_tensors_packed() -> None:
    """The split kept from the last version is checked: a closed segment is not read."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    shared = share_tensors(model)

    async def main() -> None:
        engine = torch.nn.Linear(16, 16)
        async with WeightReceiver(ModuleSink(engine)) as receiver:
            config = SenderConfig(direct=True)
            async with WeightSender(receiver.endpoint, config=config) as sender:
                first = await sender.send(model)
                shared.close()
                with torch.no_grad():
                    model.weight.add_(1)
                second = await sender.send(model)
        assert first.direct_bytes == first.bytes
        assert second.direct_bytes == 0
        assert "not in a shared segment (aiosync.share_tensors) (2)" in second.direct_note
        assert torch.equal(engine.weight, model.weight)

    run(main)


@pytest.mark.parametrize("how", ["state_dict", "pairs"])
def test_plain_tensors_to_a_direct_sender_are_packed_and_the_note_says_why(how: str) -> None:
    """Issue 25.7: a state_dict (detached tensors) or a list of plain pairs goes packed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)

    async def main() -> None:
        engine = torch.nn.Linear(16, 16)
        async with WeightReceiver(ModuleSink(engine)) as receiver:
            config = SenderConfig(direct=True)
            async with WeightSender(receiver.endpoint, config=config) as sender:
                state = model.state_dict()
                sent = state if how == "state_dict" else [(n, t.clone()) for n, t in state.items()]
                report = await sender.send(sent)
        assert report.direct_bytes == 0
        assert "2 tensors" in report.direct_note
        assert "not persistent" in report.direct_note
        assert "state_dict()" in report.direct_note
        assert torch.equal(engine.weight, model.weight)

    run(main)
