"""The receiver under contention and faults: busy senders, failing sinks, vanished senders."""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

from aiosync import (
    AiosyncError,
    CallbackSink,
    MismatchError,
    ModuleSink,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.layout import TensorSpec, pack_bucket, plan_buckets
from aiosync.memory import ShmSegment
from aiosync.transports.zmq import SenderChannel
from aiosync.wire import PROTOCOL_VERSION, Ack, Bucket, Complete, Goodbye, Hello, decode, encode
from tests.models import assert_same, mixed_weights, zeros_like
from tests.test_processes import next_event, peer

SMALL = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


class RawSender:
    """A hand-driven session: one bucket at a time, so a test decides when a stream ends."""

    def __init__(self, channel: SenderChannel, segment: ShmSegment) -> None:
        self.channel = channel
        self.segment = segment
        self.seq = 0

    async def request(self, message: Bucket | Complete | Hello | Goodbye) -> object:
        await self.channel.send(encode(message))
        with anyio.fail_after(10):
            return decode(await self.channel.recv())

    async def bucket(self, version: int, weights: dict[str, torch.Tensor]) -> Ack:
        plan = next(plan_buckets(weights.items(), self.segment.size))
        pack_bucket(self.segment.tensor, plan)
        reply = await self.request(Bucket(self.seq, version, 0, plan.used, plan.specs))
        self.seq += 1
        assert isinstance(reply, Ack)
        return reply

    async def complete(self, version: int, buckets: int, tensors: int) -> Ack:
        reply = await self.request(Complete(self.seq, version, buckets, tensors))
        self.seq += 1
        assert isinstance(reply, Ack)
        return reply


async def open_raw(endpoint: str, segment: ShmSegment) -> RawSender:
    channel = SenderChannel.connect(endpoint)
    raw = RawSender(channel, segment)
    await raw.request(Hello(PROTOCOL_VERSION, "raw", "raw-sender", [segment.handle]))
    return raw


async def test_second_sender_is_told_busy_then_succeeds_on_retry() -> None:
    small = {"a": torch.full((4,), 7.0), "b": torch.full((4,), 8.0)}
    target = zeros_like(small)
    segment = ShmSegment.create(64 * 1024)
    try:
        async with WeightReceiver(ModuleSink(target, staged=True)) as receiver:
            raw = await open_raw(receiver.endpoint, segment)
            try:
                assert (await raw.bucket(5, {"a": small["a"]})).ok  # version 5 is open
                async with WeightSender(receiver.endpoint, config=SMALL) as other:
                    busy = {k: v + 1 for k, v in small.items()}
                    with pytest.raises(RejectedError, match="streaming; try again later"):
                        await other.send(busy.items(), version=9)
                    # a commit from the busy sender must not commit the open stream
                    assert receiver.current_version is None
                    assert target["a"].eq(0).all()  # staged: nothing visible yet
                    assert (await raw.bucket(5, {"b": small["b"]})).ok
                    assert (await raw.complete(5, 2, 2)).ok
                    assert receiver.current_version == 5
                    assert_same(target, small)
                    await other.send(busy.items(), version=9)  # the retry goes through
                    assert receiver.current_version == 9
                    assert_same(target, busy)
            finally:
                raw.channel.close()
    finally:
        segment.close()


async def test_complete_or_goodbye_from_an_idle_session_leaves_the_open_stream_alone() -> None:
    small = {"a": torch.full((4,), 3.0)}
    target = zeros_like(small)
    seg_a, seg_b = ShmSegment.create(64 * 1024), ShmSegment.create(64 * 1024)
    try:
        async with WeightReceiver(ModuleSink(target, staged=True)) as receiver:
            a = await open_raw(receiver.endpoint, seg_a)
            b = await open_raw(receiver.endpoint, seg_b)
            try:
                assert (await a.bucket(1, small)).ok
                refused = await b.complete(100, 0, 0)  # an empty version, while a streams
                assert not refused.ok
                assert "try again later" in (refused.error or "")
                assert receiver.current_version is None
                await b.request(Goodbye("raw"))
                assert (await a.complete(1, 1, 1)).ok
                assert receiver.current_version == 1
                assert_same(target, small)
            finally:
                a.channel.close()
                b.channel.close()
    finally:
        seg_a.close()
        seg_b.close()


@pytest.mark.parametrize("where", ["check", "commit", "on_commit"])
async def test_receiver_keeps_serving_when_the_engine_raises(where: str) -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    armed = [True]

    class Faulty(ModuleSink):
        def check(self, spec: TensorSpec) -> None:
            if where == "check" and armed[0]:
                raise KeyError("index corrupted")
            super().check(spec)

        def commit(self, version: int) -> None:
            if where == "commit" and armed[0]:
                raise RuntimeError("reload failed")
            super().commit(version)

    def on_commit(version: int) -> None:
        if where == "on_commit" and armed[0]:
            raise RuntimeError("hook failed")

    receiver = WeightReceiver(Faulty(target), on_commit=on_commit)
    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        if where == "on_commit":
            await sender.send(weights.items(), version=0)  # committed; the hook's error is logged
            assert receiver.current_version == 0
        else:
            with pytest.raises(RejectedError, match=r"index corrupted|reload failed"):
                await sender.send(weights.items(), version=0)
            assert receiver.current_version is None
            assert receiver.failures[-1].version == 0
            if where == "commit":
                assert not receiver.servable
        armed[0] = False
        await sender.send(weights.items(), version=1)
        assert receiver.current_version == 1
        assert receiver.servable
    assert_same(target, {k: v.contiguous() for k, v in weights.items()})


async def test_goodbye_in_mid_stream_is_a_failure_and_in_place_engine_not_servable() -> None:
    small = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0)}
    segment = ShmSegment.create(64 * 1024)
    try:
        async with WeightReceiver(ModuleSink(zeros_like(small))) as receiver:
            raw = await open_raw(receiver.endpoint, segment)
            try:
                assert (await raw.bucket(2, {"a": small["a"]})).ok
                await raw.request(Goodbye("raw"))
            finally:
                raw.channel.close()
            assert receiver.failures[-1].version == 2
            assert "goodbye" in receiver.failures[-1].reason
            assert receiver.current_version is None
            assert not receiver.servable
            assert receiver.sessions == 0
    finally:
        segment.close()


async def test_send_raises_aiosync_errors_naming_the_tensor_for_bad_input() -> None:
    async with (
        WeightReceiver(CallbackSink(lambda pairs: None)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(MismatchError, match="cannot be streamed") as info:
            await sender.send([("u", torch.zeros(3, dtype=torch.uint16))])
        assert info.value.tensor == "u"
        with pytest.raises(AiosyncError, match="twice") as dup:
            await sender.send([("x", torch.ones(2)), ("x", torch.ones(2))])
        assert dup.value.tensor == "x"
        await sender.send([("x", torch.ones(2))], version=5)  # the session is still fine
        assert receiver.current_version == 5


@only_asyncio
async def test_idle_sender_killed_has_its_session_and_buffers_released() -> None:
    weights = mixed_weights()
    config = ReceiverConfig(session_timeout=1.0, stream_timeout=5.0)
    async with WeightReceiver(ModuleSink(zeros_like(weights)), config=config) as receiver:
        with peer("trainer", "--endpoint", receiver.endpoint, "--stall-after", "0") as trainer:
            assert (await next_event(trainer))["event"] == "synced"
            assert (await next_event(trainer))["event"] == "stalled"  # version 1: not yet sent
            assert receiver.sessions == 1
            trainer.send_signal(signal.SIGKILL)
            with anyio.fail_after(20):  # hang guard only
                while receiver.sessions:
                    await anyio.sleep(0.05)
        assert receiver.current_version == 0
        assert receiver.servable


async def test_keepalives_hold_an_idle_session_open() -> None:
    weights = mixed_weights()
    config = ReceiverConfig(session_timeout=1.0)
    keepalive = SenderConfig(buffer_bytes=64 * 1024, timeout=10, keepalive=0.1)
    async with WeightReceiver(ModuleSink(zeros_like(weights)), config=config) as receiver:
        async with WeightSender(receiver.endpoint, config=keepalive) as sender:
            await sender.send(weights.items(), version=0)
            await anyio.sleep(2.5)  # well past session_timeout, with keepalives flowing
            assert receiver.sessions == 1
            await sender.send(weights.items(), version=1)
        assert receiver.current_version == 1
