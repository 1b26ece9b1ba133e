"""End-to-end streams between a sender and a receiver in one process (real ZMQ, real shm)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import anyio
import pytest
import torch

from aiosync import (
    CallbackSink,
    ModuleSink,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.layout import pack_bucket, plan_buckets
from aiosync.memory import ShmSegment
from aiosync.pipeline import SyncProgress
from aiosync.transports.zmq import SenderChannel
from aiosync.wire import PROTOCOL_VERSION, Bucket, Hello, decode, encode
from tests.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)


def bump(weights: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A new 'training step': every tensor changes."""
    out = {}
    for name, t in weights.items():
        if t.dtype == torch.bool:
            out[name] = t ^ bool(version % 2)
        else:
            out[name] = t + version
    return out


async def test_module_sink_receives_every_version_bit_exact() -> None:
    base = mixed_weights()
    target = zeros_like(base)
    async with (
        WeightReceiver(ModuleSink(target)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        for version in range(3):
            weights = bump(base, version)
            report = await sender.send(weights.items(), version=version)
            assert receiver.current_version == version
            assert report.tensors == len(weights)
            assert report.bytes == sum(t.numel() * t.element_size() for t in weights.values())
            assert report.buckets > len(weights) // 2  # the big tensor needs several buckets
            assert_same(target, {k: v.contiguous() for k, v in weights.items()})
        assert receiver.servable
        assert not receiver.failures


async def test_nn_module_parameters_and_buffers_are_filled_by_name() -> None:
    torch.manual_seed(0)
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    engine = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    with torch.no_grad():
        trainer[1].running_mean.add_(3)
    async with (
        WeightReceiver(ModuleSink(engine)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(trainer.state_dict().items())
    assert_same(trainer.state_dict(), engine.state_dict())


async def test_callback_sink_gets_whole_tensors_in_load_weights_shape() -> None:
    weights = mixed_weights(seed=3)
    got: dict[str, torch.Tensor] = {}
    calls = 0

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        nonlocal calls
        calls += 1
        for name, tensor in pairs:
            got[name] = tensor.clone()  # views are only valid during the call

    commits: list[int] = []
    sink = CallbackSink(load_weights, on_commit=commits.append)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(weights.items(), version=7)
    assert commits == [7]
    assert calls >= 2
    assert_same(got, {k: v.contiguous() for k, v in weights.items()})


async def test_progress_is_reported_per_bucket_up_to_the_total() -> None:
    weights = mixed_weights()
    seen: list[SyncProgress] = []
    async with (
        WeightReceiver(ModuleSink(zeros_like(weights))) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        report = await sender.send(weights.items(), progress=seen.append)
    assert [p.buckets for p in seen] == list(range(1, report.buckets + 1))
    assert seen[-1].bytes == report.bytes
    assert seen[-1].tensors == report.tensors


async def test_default_version_follows_the_receivers_current_one() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    async with WeightReceiver(ModuleSink(target)) as receiver:
        async with WeightSender(receiver.endpoint, config=SMALL) as sender:
            assert (await sender.send(weights.items())).version == 0
            assert (await sender.send(weights.items())).version == 1
        async with WeightSender(receiver.endpoint, config=SMALL) as sender:
            assert sender.remote_version == 1
            assert (await sender.send(weights.items())).version == 2
            with pytest.raises(Exception, match="not newer"):
                await sender.send(weights.items(), version=2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda w: w.update({"not.in.model": torch.ones(3)}), "no such parameter"),
        (lambda w: w.update({"embed.weight": torch.ones(64, 31)}), r"float32\[64, 31\]"),
        (lambda w: w.update({"embed.weight": torch.ones(64, 32, dtype=torch.float64)}), "float64"),
    ],
    ids=["unknown-name", "shape", "dtype"],
)
async def test_engine_rejection_names_the_tensor_and_keeps_the_version(change, match) -> None:
    good = mixed_weights()
    target = zeros_like(good)
    async with (
        WeightReceiver(ModuleSink(target, staged=True)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(good.items(), version=0)
        bad = bump(good, 1)
        change(bad)
        with pytest.raises(RejectedError, match=match) as info:
            await sender.send(bad.items(), version=1)
        assert info.value.tensor in {"not.in.model", "embed.weight"}
        assert info.value.version == 1
        assert receiver.current_version == 0
        assert receiver.servable  # staged: nothing visible changed
        assert receiver.last_failure is not None
        assert [f.version for f in receiver.failures] == [1]  # recorded once, abort included
        assert_same(target, {k: v.contiguous() for k, v in good.items()})
        # the session survives a rejection: the next good version goes through
        await sender.send(bump(good, 2).items(), version=2)
        assert receiver.current_version == 2


async def test_in_place_rejection_mid_stream_marks_engine_not_servable() -> None:
    good = mixed_weights()
    target = zeros_like(good)
    async with (
        WeightReceiver(ModuleSink(target)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(good.items(), version=0)
        bad = dict(bump(good, 1))
        bad["zz.unknown"] = torch.ones(4)  # last: earlier buckets are already applied
        with pytest.raises(RejectedError, match=r"zz\.unknown"):
            await sender.send(bad.items(), version=1)
        assert receiver.current_version == 0
        assert not receiver.servable
        await sender.send(bump(good, 2).items(), version=2)
        assert receiver.servable
        assert receiver.current_version == 2


async def test_callback_errors_reach_the_sender_with_tensor_names() -> None:
    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("engine out of memory")

    async with (
        WeightReceiver(CallbackSink(load_weights)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(RejectedError, match="engine out of memory") as info:
            await sender.send(mixed_weights().items())
        assert info.value.tensor == "embed.weight"
        assert receiver.current_version is None


async def test_slow_engine_makes_sender_time_out_not_hang() -> None:
    release = threading.Event()

    def slow(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        # runs in the receiver's worker thread: held until the sender has given up
        release.wait(timeout=60)

    config = SenderConfig(buffer_bytes=64 * 1024, timeout=0.5)
    async with WeightReceiver(CallbackSink(slow)) as receiver:
        try:
            async with WeightSender(receiver.endpoint, config=config) as sender:
                with pytest.raises(SyncTimeoutError, match="no ack") as info:
                    await sender.send(mixed_weights().items(), version=4)
                assert info.value.version == 4
                with pytest.raises(Exception, match="unusable"):
                    await sender.send(mixed_weights().items(), version=5)
                release.set()  # let the engine finish before the sender closes
        finally:
            release.set()
        assert receiver.current_version is None


async def test_sender_without_receiver_fails_within_timeout(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    config = SenderConfig(buffer_bytes=4096, timeout=0.3)
    with anyio.fail_after(5), pytest.raises(Exception, match="no reply to hello"):
        async with WeightSender(endpoint, config=config):
            pass


async def test_wait_for_version_times_out_with_a_clear_error() -> None:
    async with WeightReceiver(ModuleSink({})) as receiver:
        with pytest.raises(SyncTimeoutError, match="still at version None"):
            await receiver.wait_for_version(3, timeout=0.2)


async def test_silent_trainer_mid_stream_is_reported_and_version_kept() -> None:
    good = mixed_weights()
    target = zeros_like(good)
    # the good version 0 must never look silent: its buckets are milliseconds apart
    config = ReceiverConfig(stream_timeout=1.0)
    async with WeightReceiver(ModuleSink(target), config=config) as receiver:
        async with WeightSender(receiver.endpoint, config=SMALL) as sender:
            await sender.send(good.items(), version=0)
        # A raw session that sends one bucket of version 1 and then nothing.
        segment = ShmSegment.create(64 * 1024)
        try:
            async with SenderChannel.connect(receiver.endpoint) as channel:
                await channel.send(
                    encode(Hello(PROTOCOL_VERSION, "s1", "stalling", [segment.handle]))
                )
                decode(await channel.recv())
                plan = next(plan_buckets(bump(good, 1).items(), 64 * 1024))
                pack_bucket(segment.tensor, plan)
                await channel.send(encode(Bucket(0, 1, 0, plan.used, plan.specs)))
                assert decode(await channel.recv()).ok  # type: ignore[union-attr]
                with anyio.fail_after(20):  # hang guard: the stream timeout is 1 s
                    while not receiver.failures:
                        await anyio.sleep(0.05)
        finally:
            segment.close()
        failure = receiver.failures[-1]
        assert failure.version == 1
        assert "silent" in failure.reason
        assert receiver.current_version == 0
        assert not receiver.servable


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def wait_for_fds_closed(before: set[str]) -> None:
    """Wait (10 s at most) until no descriptor opened since ``before`` is left."""
    with anyio.fail_after(10):
        while not open_fds() <= before:
            await anyio.sleep(0.05)


async def test_cancelled_send_releases_everything_and_keeps_the_version() -> None:
    started = anyio.Event()
    release = threading.Event()

    def slow(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        anyio.from_thread.run_sync(started.set)
        release.wait(timeout=60)  # held until the send is cancelled

    fds = open_fds()
    async with WeightReceiver(CallbackSink(slow), config=ReceiverConfig(stream_timeout=0.5)) as rx:
        async with (
            WeightSender(rx.endpoint, config=SMALL) as sender,
            anyio.create_task_group() as tg,
        ):

            async def send() -> None:
                await sender.send(mixed_weights().items(), version=3)

            tg.start_soon(send)
            with anyio.fail_after(10):
                await started.wait()
            tg.cancel_scope.cancel()
            release.set()  # the send is cancelled while the engine was still applying
        with anyio.fail_after(10):
            while not rx.failures:
                await anyio.sleep(0.05)
        assert rx.current_version is None
        assert rx.failures[-1].version == 3
    # sockets, shared-memory maps and zmq pipes all closed (once the loop drops transports)
    await wait_for_fds_closed(fds)


async def test_many_sessions_leak_no_file_descriptors() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    fds = open_fds()
    async with WeightReceiver(ModuleSink(target)) as receiver:
        for version in range(5):
            async with WeightSender(receiver.endpoint, config=SMALL) as sender:
                await sender.send(weights.items(), version=version)
    await wait_for_fds_closed(fds)


async def test_module_sink_follows_a_parameter_whose_storage_was_replaced() -> None:
    trainer = torch.nn.Linear(32, 32)
    engine = torch.nn.Linear(32, 32)
    async with (
        WeightReceiver(ModuleSink(engine)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(trainer.state_dict().items(), version=0)
        engine.weight.data = torch.zeros(32, 32)  # e.g. an engine reloading its weights
        with torch.no_grad():
            trainer.weight.add_(1)
        await sender.send(trainer.state_dict().items(), version=1)
    assert_same(trainer.state_dict(), engine.state_dict())
