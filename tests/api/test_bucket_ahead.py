"""A packed bucket 1 sent ahead of its packing (``Bucket.after``), on the CPU.

The CUDA plane orders such a bucket with a counter in the trainer's device memory: the
trainer's plane hands out a value (``arm``), its next pack of that buffer sets the
counter, and the engine's reads wait until the counter reaches it (``wait_after``). Here a
shared-memory plane is given those hooks with the counter simulated on the host (a wait
blocks until the pack set it, so every apply goes to a worker thread here: a GPU wait
never holds the engine's loop, a simulated one would), so the whole host protocol runs
without a GPU: bucket 1
goes inside the begin before the read, each version names the next value, the reads wait,
a withdrawn guess or a failed read releases the counter, and every version is bit-exact.
The GPU side (the counter itself) is tested in ``tests/gpu/test_cuda_counters.py``.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.core import wire
from aiosync.core.engine_actions import Apply
from aiosync.core.errors import MismatchError, ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.layout_memory import LayoutMemory
from aiosync.core.wire import Begin, Bucket, decode
from aiosync.engine.quick_apply import QuickApplies
from aiosync.pipeline.early_begin import EarlyBegin
from aiosync.pipeline.fanout import kept_first_payload
from aiosync.planes import BucketContext, ReceiverPlane, view_parts
from aiosync.planes.shm import ShmReceiverPlane, ShmSenderPlane
from tests.api.test_early_begin import Logged

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])
CONFIG = SenderConfig(buffer_bytes=8192, num_buffers=2, timeout=10)  # two tensors a bucket


class Counter:
    """The trainer's counter, simulated: waits block until a pack set the value."""

    def __init__(self) -> None:
        self.value = 0
        self.changed = threading.Condition()
        self.armed: list[tuple[int, int]] = []  # (buffer, value) handed out
        self.released: list[int] = []  # values set by disarm (no pack came)
        self.waits: list[int] = []  # values the engine's reads waited for

    def set(self, value: int) -> None:
        with self.changed:
            self.value = max(self.value, value)
            self.changed.notify_all()

    def wait(self, value: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.value >= value, timeout=10), value
        self.waits.append(value)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Give the shared-memory planes the CUDA plane's counter hooks, on ``Counter``."""
    made = Counter()
    state: dict[str, tuple[int, int] | None] = {"armed": None}
    pack = ShmSenderPlane.pack

    def arm(self: ShmSenderPlane, index: int, words: list[int]) -> int:
        assert words == [0], words  # the one engine's word
        assert state["armed"] is None, "one bucket ahead at a time"
        value = len(made.armed) + 1
        made.armed.append((index, value))
        state["armed"] = (index, value)
        return value

    def disarm(self: ShmSenderPlane) -> None:
        armed, state["armed"] = state["armed"], None
        if armed is not None:
            made.released.append(armed[1])
            made.set(armed[1])

    def packed(self: ShmSenderPlane, index: int, plan: BucketPlan) -> None:
        pack(self, index, plan)
        armed = state["armed"]
        if armed is not None and armed[0] == index:
            state["armed"] = None
            made.set(armed[1])

    def wait_after(
        self: ShmReceiverPlane, value: int, context: BucketContext | None = None
    ) -> None:
        made.wait(value)

    monkeypatch.setattr(ShmSenderPlane, "arm", arm, raising=False)
    monkeypatch.setattr(ShmSenderPlane, "spec_for_link", lambda self: (self.spec, 0), raising=False)
    monkeypatch.setattr(ShmSenderPlane, "disarm", disarm, raising=False)
    monkeypatch.setattr(ShmSenderPlane, "pack", packed)
    monkeypatch.setattr(ShmReceiverPlane, "wait_after", wait_after, raising=False)
    monkeypatch.setattr(QuickApplies, "quick", lambda self, action: False)
    return made


def weights(step: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Five float32[1024] (4 KiB each: two a bucket), in the order of ``names``."""
    names = names or [f"w{i}" for i in range(5)]
    return {name: torch.full((1024,), float(step * 10 + int(name[1:]))) for name in names}


def record_buckets(sender: WeightSender) -> list[tuple[str, int | None]]:
    """Bucket messages as sent: ("begin", after of the bucket inside) or ("bucket", after)."""
    sent: list[tuple[str, int | None]] = []
    for link in sender._links.values():
        channel: Any = link.channel
        send = channel.send

        async def recorded(payload: bytes, send: Any = send) -> None:
            message = decode(payload)
            if isinstance(message, Begin) and message.first is not None:
                sent.append(("begin", message.first.after))
            elif isinstance(message, Bucket):
                sent.append(("bucket", message.after))
            await send(payload)

        channel.send = recorded
    return sent


@asynccontextmanager
async def pair() -> AsyncIterator[
    tuple[dict[str, torch.Tensor], WeightReceiver, WeightSender, list[tuple[str, int | None]]]
]:
    """A zeroed model, its engine, a sender to it that has sent versions 0 and 1, and the
    bucket messages sent from then on."""
    model = {name: torch.zeros_like(t) for name, t in weights(0).items()}
    async with (
        WeightReceiver(ModuleSink(model)) as receiver,
        WeightSender(receiver.endpoint, config=CONFIG) as sender,
    ):
        sent = record_buckets(sender)
        for version in range(2):
            await sender.send(weights(version), version=version)
            assert all(torch.equal(model[n], t) for n, t in weights(version).items()), version
        yield model, receiver, sender, sent


@only_asyncio
async def test_bucket_1_goes_ahead_of_its_packing_from_the_second_version(
    counter: Counter,
) -> None:
    async with pair() as (model, receiver, sender, sent):
        for version in range(2, 4):
            await sender.send(weights(version), version=version)
            assert all(torch.equal(model[n], t) for n, t in weights(version).items()), version
        assert receiver.current_version == 3
    firsts = [entry for entry in sent if entry[0] == "begin"]
    assert firsts == [("begin", 1), ("begin", 2), ("begin", 3)]  # versions 1-3, inside the begin
    assert all(after is None for kind, after in sent if kind == "bucket")
    assert counter.armed == [(0, 1), (0, 2), (0, 3)]  # into buffer 0, a value each
    assert counter.waits == [1, 2, 3]  # the engine's reads of bucket 1 waited for each
    assert counter.released == []  # every one was set by its pack


@only_asyncio
async def test_a_changed_layout_withdraws_the_bucket_and_releases_its_counter(
    counter: Counter,
) -> None:
    turned = [f"w{i}" for i in reversed(range(5))]
    async with pair() as (model, receiver, sender, sent):
        await sender.send(weights(2, turned), version=2)  # another order: another layout
        assert all(torch.equal(model[n], t) for n, t in weights(2).items())
        assert receiver.current_version == 2
        assert receiver.servable
        await sender.send(weights(3, turned), version=3)  # ahead again, on the new layout
        assert all(torch.equal(model[n], t) for n, t in weights(3).items())
    assert [value for _, value in counter.armed] == [1, 2, 3]
    assert counter.waits == [1, 2, 3]
    assert counter.released == []  # version 2's read packed its (new) bucket 1: counter set
    assert [after for kind, after in sent if kind == "begin"] == [1, 2, 3]
    plain = [after for kind, after in sent if kind == "bucket"]
    assert plain == [None] * (3 + 2 + 3 + 2)  # version 2 went again whole, after the read


@only_asyncio
async def test_a_failed_read_releases_the_counter_the_engine_waits_for(
    counter: Counter,
) -> None:
    async with pair() as (model, receiver, sender, _sent):
        with pytest.raises((MismatchError, RuntimeError)):
            await sender.send(Logged(weights(2), ["begin"], fail=True), version=2)
        assert counter.released == [2]  # no pack came: the withdrawal set the counter
        assert receiver.current_version == 1
        await sender.send(weights(2), version=2)
        assert all(torch.equal(model[n], t) for n, t in weights(2).items())
    assert counter.waits == [1, 2, 3]  # the withdrawn bucket's reads went on at its release


def test_a_bucket_ahead_reaches_the_plane_before_its_view() -> None:
    calls: list[Any] = []

    class Plane(ReceiverPlane):
        def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
            calls.append(("view", index))
            return torch.zeros(used, dtype=torch.uint8)

        def close(self) -> None:
            pass

    class Counted(Plane):
        def wait_after(self, value: int, context: BucketContext | None = None) -> None:
            calls.append(("wait_after", value))

    specs = [TensorSpec("w", "float32", (1,), 0, 4)]
    view_parts(Counted(), Apply(None, 1, 1, 0, 4, specs, after=7))  # type: ignore[arg-type]
    assert calls == [("wait_after", 7), ("view", 0)]
    with pytest.raises(ProtocolError, match="no counter"):  # a plane without a counter
        view_parts(Plane(), Apply(None, 1, 1, 0, 4, specs, after=7))  # type: ignore[arg-type]


def test_the_kept_first_payload_of_a_ring_plan_names_its_counter_value() -> None:
    memory = LayoutMemory()
    pairs = list(weights(0).items())
    assert memory.kept_first() is None
    layout = memory.lay_out(pairs, 8192, 64)
    assert layout is not None
    first = layout.items[0]
    assert isinstance(first, BucketPlan)
    assert memory.kept_first() is None  # no slots made for it yet
    first.slots = [
        wire.Slot(entry, s.offset, s.nbytes, s.start)
        for entry, s in zip(first.entries, first.specs, strict=True)
    ]
    assert memory.kept_first() is first
    sent = kept_first_payload(5, first, 9)
    as_read = kept_first_payload(5, first, 9, as_read=True)
    assert kept_first_payload(5, first) is None  # a ring plan goes ahead only with a value
    message, plain = decode(sent or b""), decode(as_read or b"")
    assert isinstance(message, Bucket)
    assert isinstance(plain, Bucket)
    assert (message.version, message.seq, message.buffer, message.after) == (5, 1, 0, 9)
    assert plain == wire.Bucket(5, 1, 0, first.used, slots=first.slots)  # the fanout's bytes
    rebuilt = memory.lay_out(list(weights(1).items()), 8192, 64)
    assert rebuilt is not None
    again = rebuilt.items[0]
    assert isinstance(again, BucketPlan)
    early = EarlyBegin(5, layout.manifest, b"", [], first, as_read)
    assert again is not first
    assert early.holds(rebuilt.manifest, again)  # the same kept specs: the guess holds
    other = memory.lay_out([("w0", torch.zeros(3)), *pairs[1:]], 8192, 64)
    assert other is not None
    assert not early.holds(layout.manifest, other.items[0])  # type: ignore[arg-type]
