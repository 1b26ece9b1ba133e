"""The begin sent before the read (aiosync.pipeline.early_begin), on the last manifest's guess.

Each test records, in one list, what the trainer sent (message types, per engine) and when
it read its tensors, then checks the order, what the engines committed and what they
recorded as failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender, share_tensors
from aiosync.core.errors import MismatchError
from aiosync.core.layout import BucketPlan
from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.trainer_session import FleetVote, Policy
from aiosync.core.wire import Begin, Bucket, Message, decode
from aiosync.pipeline import early_begin
from aiosync.pipeline.fanout import BucketFanout, _Packed
from aiosync.pipeline.version_spec import VersionSpec
from tests.helpers.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, timeout=10)


class Logged(Mapping[str, torch.Tensor]):
    """A mapping of tensors that notes in ``log`` each time its pairs are read."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], log: list[str], fail: bool = False
    ) -> None:
        self.tensors, self.log, self.fail = tensors, log, fail

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:  # items() iterates through this
        if self.log[-1:] != ["read"]:  # one entry for the reads of one version
            self.log.append("read")
        if self.fail:
            raise RuntimeError("the trainer's tensors are gone")
        return iter(self.tensors)


def record_sends(sender: WeightSender, log: list[str], tagged: bool = False) -> None:
    """Note each message ``sender`` sends, by type (and engine, if ``tagged``)."""
    for name, link in sender._links.items():
        channel: Any = link.channel
        send = channel.send

        async def recorded(
            payload: bytes, send: Callable[..., Any] = send, name: str = name
        ) -> None:
            message = decode(payload)
            kinds = [type(message).__name__.lower()]
            if isinstance(message, Begin) and message.first is not None:
                kinds.append("bucket")  # bucket 1 inside the begin's message
            log.extend(f"{kind}@{name}" if tagged else kind for kind in kinds)
            await send(payload)

        channel.send = recorded


def version_log(log: list[str]) -> list[str]:
    """The entries up to and including the first bucket (where the start's order shows)."""
    first = next(i for i, entry in enumerate(log) if entry.startswith("bucket"))
    return log[: first + 1]


def contiguous(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.contiguous() for name, t in weights.items()}


@asynccontextmanager
async def logged_pair(
    sink: ModuleSink, log: list[str] | None, config: SenderConfig = SMALL
) -> AsyncIterator[tuple[WeightReceiver, WeightSender]]:
    """An engine with ``sink`` and a sender to it whose sends go to ``log`` (if given)."""
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        if log is not None:
            record_sends(sender, log)
        yield receiver, sender


async def test_a_repeated_manifest_begins_before_the_read_and_commits() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    log: list[str] = []
    async with logged_pair(ModuleSink(target), log) as (receiver, sender):
        await sender.send(Logged(weights, log), version=0)
        assert version_log(log) == ["read", "begin", "bucket"]  # nothing to guess from
        for version in (1, 2):
            log.clear()
            fresh = mixed_weights(seed=version)  # new tensors, same names, dtypes, shapes
            await sender.send(Logged(fresh, log), version=version)
            assert version_log(log) == ["begin", "read", "bucket"]
            assert "abort" not in log
            assert receiver.current_version == version
            assert_same(target, contiguous(fresh))
        assert receiver.failures == []


async def test_a_changed_manifest_withdraws_the_guess_and_begins_again() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    log: list[str] = []
    half = {n: t.half() if t.is_floating_point() else t for n, t in mixed_weights(1).items()}
    async with logged_pair(ModuleSink(target, cast=True), log) as (receiver, sender):
        await sender.send(weights, version=0)
        log.clear()
        await sender.send(Logged(half, log), version=1)  # other dtypes: another manifest
        assert version_log(log) == ["begin", "read", "abort", "begin", "bucket"]
        assert receiver.current_version == 1
        assert receiver.failures == []  # a withdrawn begin is no failure of the engine's
        assert receiver.withdrawn == 1
        assert receiver.servable
        log.clear()
        await sender.send(Logged(half, log), version=2)  # the new manifest is the guess now
        assert version_log(log) == ["begin", "read", "bucket"]
    expected = {n: t.to(target[n].dtype) for n, t in contiguous(half).items()}
    assert_same(target, expected)


async def test_a_failed_read_withdraws_the_begin_and_the_next_send_works() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    log: list[str] = []
    async with logged_pair(ModuleSink(target), log) as (receiver, sender):
        await sender.send(weights, version=0)
        log.clear()
        with pytest.raises(Exception, match="tensors are gone"):
            await sender.send(Logged(weights, log, fail=True), version=1)
        assert log == ["begin", "read", "abort"]
        fresh = mixed_weights(seed=5)
        await sender.send(fresh, version=1)  # the same version, begun again
        assert receiver.current_version == 1
        assert receiver.failures == []
    assert_same(target, contiguous(fresh))


async def test_a_generator_is_never_guessed() -> None:
    weights = mixed_weights()
    log: list[str] = []
    async with logged_pair(ModuleSink(zeros_like(weights)), log) as (receiver, sender):
        await sender.send(weights, version=0)
        log.clear()

        def pairs() -> Iterator[tuple[str, torch.Tensor]]:
            log.append("read")
            yield from weights.items()

        await sender.send(pairs(), version=1)
        assert log.index("read") < log.index("begin")
        assert receiver.failures == []


@pytest.mark.parametrize(("policy", "early"), [("all", False), ("available", True)])
async def test_two_engines_begin_early_only_under_policy_available(
    policy: str, early: bool
) -> None:
    weights = mixed_weights()
    targets = [zeros_like(weights), zeros_like(weights)]
    log: list[str] = []
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10, policy=policy)
    async with (
        WeightReceiver(ModuleSink(targets[0])) as one,
        WeightReceiver(ModuleSink(targets[1])) as two,
        WeightSender([one.endpoint, two.endpoint], config=config) as sender,
    ):
        record_sends(sender, log, tagged=True)
        await sender.send(weights, version=0)
        log.clear()
        await sender.send(Logged(weights, log), version=1)
        begins = [i for i, entry in enumerate(log) if entry.startswith("begin@")]
        assert len(begins) == 2  # one each
        assert (max(begins) < log.index("read")) is early
        assert one.current_version == two.current_version == 1
    for target in targets:
        assert_same(target, contiguous(weights))


# --------------------------------------------------------------------------------------
# direct mode: bucket 1 goes with the begin once a split is kept
# --------------------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Parameters of two dtypes and a persistent buffer."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)
        self.low = torch.nn.Parameter(torch.randn(33, 7).to(torch.bfloat16))
        self.register_buffer("scale", torch.arange(5, dtype=torch.float64))


def stepped(model: Net, version: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 + version)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameter and buffer objects (``state_dict()`` makes new ones)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@asynccontextmanager
async def direct_pair(
    model: torch.nn.Module, sink: ModuleSink, log: list[str] | None = None
) -> AsyncIterator[tuple[WeightReceiver, WeightSender]]:
    """``model`` in a shared segment, streamed in direct mode to ``sink`` (sends logged)."""
    config = SenderConfig(direct=True, buffer_bytes=64 * 1024, timeout=10)
    with share_tensors(model):
        async with logged_pair(sink, log, config) as pair:
            yield pair


async def test_a_kept_direct_split_sends_bucket_1_before_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    log: list[str] = []
    confirm = BucketFanout._confirmed_first

    def confirmed(self: BucketFanout, packed: _Packed | None) -> _Packed:
        log.append("confirmed")
        return confirm(self, packed)

    monkeypatch.setattr(BucketFanout, "_confirmed_first", confirmed)
    async with direct_pair(model, ModuleSink(engine), log) as (receiver, sender):
        orders = []
        for version in range(4):
            stepped(model, version)
            log.clear()
            report = await sender.send(Logged(tensors(model), log))
            orders.append(version_log(log))
            assert report.direct_bytes == report.bytes  # every tensor read in place
            assert_same(state(engine), state(model))
        assert receiver.failures == []
    assert orders[0] == ["read", "begin", "bucket"]  # nothing to guess from
    assert orders[1] == ["begin", "read", "bucket"]  # the split was new: kept from now on
    assert orders[2] == orders[3] == ["begin", "bucket"]  # bucket 1 before the read...
    assert log[2:4] == ["read", "confirmed"]  # ...which then confirms it


@pytest.mark.parametrize("together", [True, False])
async def test_bucket_1_rides_in_the_begin_unless_the_two_are_too_large_together(
    together: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    encode_begin = early_begin.encode_begin

    def tight(
        version: int,
        manifest: list[TensorMeta] | None,
        flags: dict[str, bool],
        limits: list[Limits],
        first: bytes | None = None,
    ) -> tuple[bytes, list[TensorMeta] | None]:
        """The engines' message limit is the begin's own size: bucket 1 no longer fits in."""
        alone, _ = encode_begin(version, manifest, flags, limits)
        most = [msgspec.structs.replace(x, max_message_bytes=len(alone)) for x in limits]
        return encode_begin(version, manifest, flags, most, first)

    if not together:
        monkeypatch.setattr(early_begin, "encode_begin", tight)
    torch.manual_seed(0)
    model, engine = Net(), Net()
    async with direct_pair(model, ModuleSink(engine)) as (receiver, sender):
        sent: list[Message] = []
        for link in sender._links.values():
            channel: Any = link.channel
            send = channel.send

            async def recorded(payload: bytes, send: Callable[..., Any] = send) -> None:
                sent.append(decode(payload))
                await send(payload)

            channel.send = recorded
        for version in range(4):
            stepped(model, version)
            sent.clear()
            await sender.send(tensors(model))
            assert_same(state(engine), state(model))
        assert receiver.failures == []
    begin = sent[0]
    assert isinstance(begin, Begin)
    assert receiver.current_version == 3
    if together:  # one message: the begin carries bucket 1
        assert begin.first is not None
        assert begin.first.seq == 1
        assert begin.first.regions
        assert not any(isinstance(m, Bucket) and m.seq == 1 for m in sent)
    else:  # two messages, one after the other
        assert begin.first is None
        assert isinstance(sent[1], Bucket)
        assert sent[1].seq == 1


async def test_a_moved_tensor_withdraws_bucket_1_and_the_version_begins_again() -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    log: list[str] = []
    async with direct_pair(model, ModuleSink(engine), log) as (receiver, sender):
        for version in range(3):
            stepped(model, version)
            await sender.send(tensors(model), version=version)
        model.proj.weight.data = model.proj.weight.detach() + 1  # new, unshared memory
        log.clear()
        report = await sender.send(Logged(tensors(model), log), version=3)
        assert log[:4] == ["begin", "bucket", "read", "abort"]
        assert log[4:6] == ["begin", "bucket"]  # version 3 again, split afresh
        assert report.packed_bytes == model.proj.weight.nbytes
        assert receiver.current_version == 3
        assert receiver.servable
        assert [f.version for f in receiver.failures] == [3]  # a bucket had gone
        assert_same(state(engine), state(model))


def test_bucket_1_as_read_must_be_the_bytes_sent_before() -> None:
    """The fanout's last check: a bucket 1 that differs from what went early fails."""
    link = SimpleNamespace(timeout=1.0)
    fanout = BucketFanout(
        links={"e": link},  # type: ignore[dict-item]
        plane=SimpleNamespace(count=2),  # type: ignore[arg-type]
        vote=FleetVote(["e"], Policy.ALL),
        guard=None,  # type: ignore[arg-type]
        spec=VersionSpec(3, None, begun=b"begin", sent_first=b"sent"),
    )
    with pytest.raises(MismatchError, match="bucket 1 as read"):
        fanout._confirmed_first(_Packed(1, 0, b"other", BucketPlan()))
    fanout._sent_first = b"sent"
    confirmed = fanout._confirmed_first(_Packed(1, 0, b"sent", BucketPlan()))
    assert confirmed.sent
    assert fanout._sent_first is None  # checked once


async def test_a_bucket_1_sent_early_that_the_read_contradicts_fails_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fanout's last check, end to end: a bucket 1 sent early that is not the version's
    fails that version; from then on bucket 1 goes after the read, and versions commit."""
    import aiosync.pipeline.early_begin as early_begin
    from aiosync.pipeline.fanout import kept_first_payload as right

    torch.manual_seed(0)
    model, engine = Net(), Net()
    log: list[str] = []

    def wrong(version: int, plan: BucketPlan, *args: Any, **kwargs: Any) -> bytes | None:
        return right(version + 100, plan, *args, **kwargs)  # one the read would not make

    async with direct_pair(model, ModuleSink(engine), log) as (receiver, sender):
        for version in range(3):
            stepped(model, version)
            await sender.send(tensors(model), version=version)
        monkeypatch.setattr(early_begin, "kept_first_payload", wrong)
        stepped(model, 3)
        with pytest.raises(MismatchError, match="bucket 1 as read"):
            await sender.send(tensors(model), version=3)
        assert receiver.current_version == 2
        log.clear()
        await sender.send(Logged(tensors(model), log), version=3)
        assert version_log(log) == ["begin", "read", "bucket"]  # bucket 1 after the read now
        assert receiver.current_version == 3
        assert receiver.servable
        assert_same(state(engine), state(model))


async def test_an_engine_decodes_an_unchanged_manifest_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiosync.core import wire

    decoded: list[int] = []
    own = wire._manifest_decoder

    class Counted:
        def decode(self, data: bytes) -> Any:
            decoded.append(len(data))
            return own.decode(data)

    monkeypatch.setattr(wire, "_manifest_decoder", Counted())
    weights = mixed_weights()
    target = zeros_like(weights)
    async with logged_pair(ModuleSink(target), None) as (receiver, sender):
        for version in range(4):
            fresh = mixed_weights(seed=version)  # new tensors, same names, dtypes, shapes
            await sender.send(fresh, version=version)
            assert_same(target, fresh)
        assert receiver.current_version == 3
    assert len(decoded) == 1  # the first begin's; the next three reuse its list
