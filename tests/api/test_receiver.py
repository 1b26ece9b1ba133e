"""The receiver under contention and faults: busy senders, failing sinks, vanished senders,
versions refused whole before any byte moves, and the event loops it runs on.

A :class:`RawSender` drives a receiver by hand with the protocol's messages over a real
:class:`ZmqChannel` and a real :class:`ShmSenderPlane`, so a test decides when a stream
ends (or never does).
"""

from __future__ import annotations

import os
import signal
import threading
import uuid

import anyio
import pytest
import torch

from aiosync import (
    AiosyncError,
    BusyError,
    CallbackSink,
    MismatchError,
    ModuleSink,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    UsageError,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.zmq import ZmqChannel
from aiosync.core.layout import BucketPlan, TensorSpec, plan_buckets
from aiosync.core.manifest import TensorMeta, build_manifest
from aiosync.core.wire import (
    GOODBYE_SEQ,
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    Goodbye,
    Hello,
    Message,
    Ready,
    Slot,
    decode,
    encode,
)
from aiosync.planes.shm import ShmSenderPlane
from aiosync.runtime import require_asyncio
from tests.helpers.models import assert_same, mixed_weights, zeros_like
from tests.processes.test_processes import next_event, peer

SMALL = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
CAPACITY = 64 * 1024
GUARD = 30  # seconds: a hang guard only, never a measured bound
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


class RawSender:
    """A hand-driven session: one message at a time, sequence numbers counted per version."""

    def __init__(self, channel: ZmqChannel, plane: ShmSenderPlane, name: str) -> None:
        self.channel = channel
        self.plane = plane
        self.name = name
        self.session = uuid.uuid4().hex
        self.seq = 0
        self.manifest: list[TensorMeta] | None = None

    @classmethod
    async def open(cls, endpoint: str, name: str = "raw-sender") -> RawSender:
        """Connect and say hello; the engine must answer ready."""
        plane = ShmSenderPlane(1, CAPACITY)
        raw = cls(ZmqChannel.connect(endpoint), plane, name)
        hello = Hello(PROTOCOL, PROTOCOL, raw.session, name, plane.spec)
        ready = await raw.request(hello)
        assert isinstance(ready, Ready), ready
        return raw

    async def close(self) -> None:
        await self.channel.aclose()
        self.plane.close()

    async def request(self, message: Message) -> Message:
        await self.channel.send(encode(message))
        with anyio.fail_after(GUARD):
            return decode(await self.channel.recv())

    async def ack(self, message: Message) -> Ack:
        reply = await self.request(message)
        assert isinstance(reply, Ack), reply
        return reply

    async def begin(self, version: int, manifest: list[TensorMeta] | None = None) -> Ack:
        self.seq, self.manifest = 0, manifest
        return await self.ack(Begin(version, manifest))

    def plan(self, weights: dict[str, torch.Tensor]) -> BucketPlan:
        plan = next(plan_buckets(weights.items(), CAPACITY))
        assert plan.whole_tensors == len(weights)
        return plan

    async def bucket(self, version: int, weights: dict[str, torch.Tensor]) -> Ack:
        """Pack ``weights`` (one bucket's worth) and send them as the next bucket."""
        plan = self.plan(weights)
        self.plane.pack(0, plan)
        self.seq += 1
        if self.manifest is None:
            return await self.ack(Bucket(version, self.seq, 0, plan.used, specs=plan.specs))
        entries = {meta.name: i for i, meta in enumerate(self.manifest)}
        slots = [Slot(entries[s.name], s.offset, s.nbytes, s.start) for s in plan.specs]
        return await self.ack(Bucket(version, self.seq, 0, plan.used, slots=slots))

    async def complete(self, version: int, buckets: int, tensors: int) -> Ack:
        self.seq += 1
        return await self.ack(Complete(version, self.seq, buckets, tensors))

    async def commit(self, version: int) -> Ack:
        self.seq += 1
        return await self.ack(Commit(version, self.seq))

    async def goodbye(self) -> Ack:
        ack = await self.ack(Goodbye(self.session))
        assert ack.seq == GOODBYE_SEQ
        return ack


async def wait_until(condition: object, what: str) -> None:
    """Poll ``condition()`` (an event's stand-in) until true; the guard only catches hangs."""
    with anyio.fail_after(GUARD):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


# --------------------------------------------------------------------------------------
# several senders
# --------------------------------------------------------------------------------------


async def test_second_sender_is_told_busy_then_succeeds_on_retry() -> None:
    small = {"a": torch.full((4,), 7.0), "b": torch.full((4,), 8.0)}
    target = zeros_like(small)
    async with WeightReceiver(ModuleSink(target, staged=True)) as receiver:
        raw = await RawSender.open(receiver.endpoint)
        try:
            assert (await raw.begin(5)).ok  # version 5 is open
            assert (await raw.bucket(5, {"a": small["a"]})).ok
            async with WeightSender(receiver.endpoint, config=SMALL) as other:
                busy = {k: v + 1 for k, v in small.items()}
                with pytest.raises(BusyError, match="streaming; try again later") as info:
                    await other.send(busy.items(), version=9)
                assert info.value.version == 9
                assert raw.name in str(info.value)  # says who is streaming
                # the refused sender must not commit or disturb the open stream
                assert receiver.current_version is None
                assert target["a"].eq(0).all()  # staged: nothing visible yet
                assert (await raw.bucket(5, {"b": small["b"]})).ok
                assert (await raw.complete(5, 2, 2)).ok
                assert receiver.current_version is None  # prepared, not committed
                assert (await raw.commit(5)).ok
                assert receiver.current_version == 5
                assert_same(target, small)
                await other.send(busy.items(), version=9)  # the retry goes through
                assert receiver.current_version == 9
                assert_same(target, busy)
        finally:
            await raw.close()


async def test_messages_from_an_idle_session_leave_the_open_stream_alone() -> None:
    small = {"a": torch.full((4,), 3.0)}
    target = zeros_like(small)
    async with WeightReceiver(ModuleSink(target, staged=True)) as receiver:
        a = await RawSender.open(receiver.endpoint, "a")
        b = await RawSender.open(receiver.endpoint, "b")
        try:
            assert (await a.begin(1)).ok
            assert (await a.bucket(1, small)).ok
            # b never opened a stream: its complete and commit are refused, nothing moves
            refused = await b.ack(Complete(100, 1, 0, 0))
            assert not refused.ok
            assert "no open stream for version 100" in (refused.error or "")
            refused = await b.ack(Commit(1, 2))  # even naming a's version
            assert not refused.ok
            assert receiver.current_version is None
            busy = await b.begin(100)
            assert not busy.ok
            assert busy.busy
            assert "try again later" in (busy.error or "")
            await b.goodbye()
            assert (await a.complete(1, 1, 1)).ok
            assert (await a.commit(1)).ok
            assert receiver.current_version == 1
            assert_same(target, small)
            assert receiver.failures == []  # a busy refusal is not a failed stream
        finally:
            await a.close()
            await b.close()


async def test_a_refused_streams_later_bucket_is_never_applied() -> None:
    """A stream refused as busy stays refused after the other one commits."""
    small = {"a": torch.full((4,), 3.0)}
    target = zeros_like(small)
    async with WeightReceiver(ModuleSink(target)) as receiver:  # in place: a write would show
        a = await RawSender.open(receiver.endpoint, "a")
        b = await RawSender.open(receiver.endpoint, "b")
        try:
            assert (await a.begin(1)).ok
            assert not (await b.begin(2)).ok  # busy
            assert (await a.bucket(1, small)).ok
            assert (await a.complete(1, 1, 1)).ok
            assert (await a.commit(1)).ok
            late = await b.bucket(2, {"a": torch.full((4,), 99.0)})
            assert not late.ok
            assert "no open stream for version 2" in (late.error or "")
            assert_same(target, small)
            assert receiver.current_version == 1
            assert receiver.servable
        finally:
            await a.close()
            await b.close()


# --------------------------------------------------------------------------------------
# faults in the engine
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        "apply",
        "commit",
        "on_commit",
    ],
)
async def test_receiver_keeps_serving_when_the_engine_raises(where: str) -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    armed = [True]

    class Faulty(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            if where == "apply" and armed[0]:
                raise KeyError("index corrupted")
            super().apply_bucket(bucket, specs)

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
            with pytest.raises(RejectedError, match=r"index corrupted|reload failed") as info:
                await sender.send(weights.items(), version=0)
            assert receiver.endpoint in str(info.value)  # names the engine
            assert receiver.current_version is None
            assert receiver.failures[-1].version == 0
            assert not receiver.servable  # in place: the weights may be mixed
        armed[0] = False
        await sender.send(weights.items(), version=1)
        assert receiver.current_version == 1
        assert receiver.servable
    assert_same(target, {k: v.contiguous() for k, v in weights.items()})


async def test_goodbye_in_mid_stream_is_a_failure_and_in_place_engine_not_servable() -> None:
    small = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0)}
    async with WeightReceiver(ModuleSink(zeros_like(small))) as receiver:
        raw = await RawSender.open(receiver.endpoint)
        try:
            assert (await raw.begin(2)).ok
            assert (await raw.bucket(2, {"a": small["a"]})).ok
            await raw.goodbye()
        finally:
            await raw.close()
        assert receiver.failures[-1].version == 2
        assert "goodbye" in receiver.failures[-1].reason
        assert receiver.current_version is None
        assert not receiver.servable
        assert receiver.sessions == 0


async def test_abort_in_mid_stream_discards_a_staged_version() -> None:
    small = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0)}
    target = zeros_like(small)
    async with WeightReceiver(ModuleSink(target, staged=True)) as receiver:
        raw = await RawSender.open(receiver.endpoint)
        try:
            assert (await raw.begin(2)).ok
            assert (await raw.bucket(2, {"a": small["a"]})).ok
            await raw.channel.send(encode(Abort("trainer gave up", 2)))
            await wait_until(lambda: receiver.failures, "the abort")
            assert "trainer gave up" in receiver.failures[-1].reason
            # the session lives on: a new version from scratch commits only its own bytes
            assert (await raw.begin(3)).ok
            assert (await raw.bucket(3, {"b": small["b"]})).ok
            refused = await raw.complete(3, 1, 1)
            assert not refused.ok  # "a" is required and was only in the aborted stream
            assert "misses 1 required tensors: a" in (refused.error or "")
        finally:
            await raw.close()
        assert receiver.current_version is None
        assert receiver.servable
        assert target["a"].eq(0).all() and target["b"].eq(0).all()  # noqa: PT018


async def test_hello_with_a_protocol_range_the_engine_does_not_speak_is_refused() -> None:
    async with WeightReceiver(ModuleSink({})) as receiver:
        plane = ShmSenderPlane(1, CAPACITY)
        channel = ZmqChannel.connect(receiver.endpoint)
        try:
            low, high = PROTOCOL + 1, PROTOCOL + 4
            await channel.send(encode(Hello(low, high, "s", "future", plane.spec)))
            with anyio.fail_after(GUARD):
                reply = decode(await channel.recv())
            assert isinstance(reply, Abort)
            assert f"the sender speaks protocols {low}-{high}" in reply.reason
            assert f"this engine protocol {PROTOCOL} " in reply.reason
            assert receiver.sessions == 0
            assert receiver.protocol_errors == 1
        finally:
            await channel.aclose()
            plane.close()


# --------------------------------------------------------------------------------------
# versions refused whole, before any byte moves
# --------------------------------------------------------------------------------------


def module_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("fault", ["missing", "unknown"])
@pytest.mark.parametrize("form", ["items", "dict", "module-state"])
async def test_missing_or_unknown_key_is_refused_before_any_byte_is_applied(
    fault: str, form: str
) -> None:
    torch.manual_seed(0)
    trainer = torch.nn.Sequential(
        torch.nn.Linear(8, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 64)
    )
    engine = torch.nn.Sequential(
        torch.nn.Linear(8, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 64)
    )
    async with (
        WeightReceiver(ModuleSink(engine)) as receiver,  # in place: any write would show
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(trainer.state_dict(), version=0)
        before = module_weights(engine)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1)
        state = dict(trainer.state_dict())
        if fault == "missing":
            del state["2.bias"]  # the last tensor: every other would already be applied
            name, match = "2.bias", r"misses 1 required tensors: 2\.bias"
        else:
            state["zz.unknown"] = torch.ones(4)  # last, after every known tensor
            name, match = "zz.unknown", "no such parameter"
        source = {"items": state.items(), "dict": state, "module-state": list(state.items())}
        with pytest.raises(RejectedError, match=match) as info:
            await sender.send(source[form], version=1)
        assert info.value.tensor == name
        assert info.value.version == 1
        assert receiver.endpoint in str(info.value)
        assert receiver.current_version == 0
        assert receiver.servable  # nothing was applied, in place or not
        assert_same(module_weights(engine), before)
        assert [f.version for f in receiver.failures] == [1]
        # the engine keeps serving: the full version goes through
        await sender.send(trainer.state_dict(), version=2)
        assert receiver.current_version == 2
        assert_same(module_weights(engine), module_weights(trainer))


async def test_a_refused_manifest_refuses_the_streams_buckets_too() -> None:
    small = {"a": torch.full((4,), 3.0)}
    target = zeros_like(small)
    async with WeightReceiver(ModuleSink(target)) as receiver:
        raw = await RawSender.open(receiver.endpoint)
        try:
            wrong = build_manifest([("a", torch.ones(5))], CAPACITY)
            refused = await raw.begin(1, wrong)
            assert not refused.ok
            assert refused.tensor == "a"
            assert "float32[5]" in (refused.error or "")
            late = await raw.bucket(1, small)  # a sender ignoring the refusal
            assert not late.ok
            assert_same(target, zeros_like(small))
            assert receiver.servable
            # with a good manifest the same session streams by slots
            right = build_manifest(small.items(), CAPACITY)
            assert (await raw.begin(2, right)).ok
            assert (await raw.bucket(2, small)).ok
            assert (await raw.complete(2, 1, 1)).ok
            assert (await raw.commit(2)).ok
        finally:
            await raw.close()
        assert receiver.current_version == 2
        assert_same(target, small)


# --------------------------------------------------------------------------------------
# bad input on the sender's side
# --------------------------------------------------------------------------------------


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
        with pytest.raises(MismatchError, match="meta") as meta:
            await sender.send([("m", torch.empty(3, device="meta"))])
        assert meta.value.tensor == "m"
        assert receiver.current_version is None
        await sender.send([("x", torch.ones(2))], version=5)  # the session is still fine
        assert receiver.current_version == 5


async def test_a_meta_tensor_among_others_is_named() -> None:
    pairs = [(f"ok.{i}", torch.ones(2)) for i in range(3)] + [("m", torch.empty(3, device="meta"))]
    async with (
        WeightReceiver(CallbackSink(lambda pairs: None)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(MismatchError, match="meta") as meta:
            await sender.send(pairs, version=0)
        assert meta.value.tensor == "m"  # shown as "tensor 'm'" in the message
        assert receiver.current_version is None


# --------------------------------------------------------------------------------------
# sessions that go quiet
# --------------------------------------------------------------------------------------


@only_asyncio
async def test_idle_sender_killed_has_its_session_and_buffers_released() -> None:
    weights = mixed_weights()
    config = ReceiverConfig(session_timeout=1.0, stream_timeout=5.0)
    async with WeightReceiver(ModuleSink(zeros_like(weights)), config=config) as receiver:
        with peer("trainer", "--endpoint", receiver.endpoint, "--stall-after", "0") as trainer:
            assert (await next_event(trainer))["event"] == "synced"
            assert (await next_event(trainer))["event"] == "stalled"  # version 1: not yet sent
            assert receiver.sessions == 1
            assert memfd_maps_of(trainer.pid)  # the trainer's buffers, which the engine maps
            trainer.send_signal(signal.SIGKILL)
            await wait_until(lambda: receiver.sessions == 0, "the session to expire")
            trainer.wait(timeout=GUARD)
        assert receiver.current_version == 0
        assert receiver.servable
        assert not memfd_maps_of(trainer.pid)  # released with the session: nothing to sweep


def memfd_maps_of(pid: int) -> list[str]:
    """This process's mappings of sealed shared-memory buffers that process ``pid`` made."""
    marker = f"/memfd:aiosync-{os.stat('/proc/self/ns/pid').st_ino}-{pid}-"
    with open("/proc/self/maps") as maps:
        return [line for line in maps if marker in line]


async def test_keepalives_hold_an_idle_session_open() -> None:
    """Of two idle senders, the silent one's session expires; the one sending keepalives
    (ten per session timeout) outlives it and still streams."""
    weights = mixed_weights()
    config = ReceiverConfig(session_timeout=1.0)
    pinging = SenderConfig(buffer_bytes=64 * 1024, timeout=10, keepalive=0.1)
    silent = SenderConfig(buffer_bytes=64 * 1024, timeout=10, keepalive=3600)
    async with WeightReceiver(ModuleSink(zeros_like(weights)), config=config) as receiver:
        async with (
            WeightSender(receiver.endpoint, config=pinging) as alive,
            WeightSender(receiver.endpoint, config=silent) as quiet,
        ):
            await alive.send(weights.items(), version=0)
            assert receiver.sessions == 2
            await wait_until(lambda: receiver.sessions == 1, "the silent session to expire")
            await alive.send(weights.items(), version=1)
            assert receiver.sessions == 1
            with pytest.raises(AiosyncError, match="ended the session"):
                await quiet.send(weights.items(), version=2)
        assert receiver.current_version == 1


# --------------------------------------------------------------------------------------
# event loops
# --------------------------------------------------------------------------------------


def test_receiver_and_sender_refuse_trio() -> None:
    pytest.importorskip("trio")  # in the test extra; skipped only where it is absent

    async def main() -> list[str]:
        refused = []
        for make in (
            lambda: WeightReceiver(ModuleSink({})),
            lambda: WeightSender("ipc:///nonexistent"),
        ):
            try:
                async with make():
                    pass
            except UsageError as exc:
                refused.append(str(exc))
        return refused

    refused = anyio.run(main, backend="trio")
    assert len(refused) == 2
    assert all("asyncio" in message for message in refused)


def test_require_asyncio_refuses_a_thread_without_a_loop() -> None:
    errors: list[BaseException] = []

    def probe() -> None:
        try:
            require_asyncio("WeightReceiver")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(timeout=GUARD)
    assert len(errors) == 1
    assert isinstance(errors[0], UsageError)
    assert "WeightReceiver needs an asyncio event loop" in str(errors[0])


async def test_require_asyncio_accepts_the_running_loop() -> None:
    require_asyncio("WeightReceiver")  # asyncio and uvloop alike
