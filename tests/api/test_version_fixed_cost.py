"""Whole versions between a sender and in-process engines: the fixed cost cut, the
guarantees kept (pieces one at a time: tests/unit/test_fixed_cost_units.py).

- one engine (or policy ``available``): ``complete`` and ``commit`` go right after the
  last bucket, without waiting for an ack; several engines under ``all`` still vote in
  two phases, and a snapshot check still stands between the packing and any commit;
- a refused completion or last bucket with the ends in flight commits nothing, and the
  session goes on (the acks still due are skipped); a refused commit after a good
  completion is reported; a refused version applies nothing, also with buckets sent
  before the refusal arrived.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiosync import ModuleSink, RejectedError, SenderConfig, WeightSender
from aiosync.core.errors import ProtocolError
from aiosync.core.stream_state import StreamState
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import Ack, Complete
from tests.api.test_stream import bump, contiguous, receivers, refusing_target
from tests.helpers.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)

# --------------------------------------------------------------------------------------
# the pipeline: when the commit follows the completion at once
# --------------------------------------------------------------------------------------


@pytest.fixture
def order(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """What each link sent (``sent``, seq) and matched (``acked``, seq), in order."""
    events: list[tuple[str, str, int]] = []
    sent, ack = LinkSession.sent, LinkSession.ack

    def record_sent(self: LinkSession, seq: int) -> None:
        events.append((self.peer, "sent", seq))
        sent(self, seq)

    def record_ack(self: LinkSession, message: Ack) -> Ack | None:
        matched = ack(self, message)
        if matched is not None:
            events.append((self.peer, "acked", matched.seq))
        return matched

    monkeypatch.setattr(LinkSession, "sent", record_sent)
    monkeypatch.setattr(LinkSession, "ack", record_ack)
    return events


def _ends(events: list[tuple[str, str, int]], engine: str, complete: int) -> list[str]:
    """The order of one engine's completion and commit: sent / acked marks."""
    mine = [(kind, seq) for peer, kind, seq in events if peer == engine]
    wanted = [("sent", complete), ("sent", complete + 1), ("acked", complete)]
    return [f"{kind} {seq - complete}" for kind, seq in mine if (kind, seq) in wanted]


@pytest.mark.parametrize(("count", "policy"), [(1, "all"), (2, "available"), (2, "all")])
async def test_the_commit_waits_for_the_completion_only_where_a_vote_needs_it(
    count: int, policy: str, order: list[tuple[str, str, int]]
) -> None:
    base = mixed_weights()
    targets = [zeros_like(base) for _ in range(count)]
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10, policy=policy)
    async with receivers(targets) as engines:
        endpoints = [engine.endpoint for engine in engines]
        async with WeightSender(endpoints, config=config) as sender:
            for version in range(2):
                order.clear()
                report = await sender.send(bump(base, version).items(), version=version)
                assert report.committed == endpoints
                assert [e.current_version for e in engines] == [version] * count
                for target in targets:
                    assert_same(target, contiguous(bump(base, version)))
                pipelined = count == 1 or policy == "available"
                for endpoint in endpoints:
                    expected = (
                        ["sent 0", "sent 1", "acked 0"]
                        if pipelined
                        else ["sent 0", "acked 0", "sent 1"]
                    )
                    assert _ends(order, endpoint, report.buckets + 1) == expected
                if not pipelined:  # no commit before every completion was acked
                    complete, commit = report.buckets + 1, report.buckets + 2
                    acks = [i for i, e in enumerate(order) if e[1:] == ("acked", complete)]
                    commits = [i for i, e in enumerate(order) if e[1:] == ("sent", commit)]
                    assert max(acks) < min(commits)


def _failing_check(times: int) -> Any:
    """``StreamState.check_whole`` that refuses its first ``times`` calls."""
    check = StreamState.check_whole
    left = [times]

    def check_whole(self: StreamState, complete: Complete) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise ProtocolError("planted: not whole")
        check(self, complete)

    return check_whole


async def test_a_refused_completion_with_its_commit_in_flight_commits_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = mixed_weights()
    target = zeros_like(base)
    async with (
        receivers([target]) as (engine,),
        WeightSender(engine.endpoint, config=SMALL) as sender,
    ):
        await sender.send(base.items(), version=0)
        monkeypatch.setattr(StreamState, "check_whole", _failing_check(1))
        with pytest.raises(RejectedError, match="planted: not whole") as info:
            await sender.send(bump(base, 1).items(), version=1)
        assert info.value.version == 1
        assert engine.current_version == 0
        assert engine.servable  # staged: nothing visible changed
        assert_same(target, contiguous(base))
        # the commit's refusal was skipped as a leftover: the session goes on
        report = await sender.send(bump(base, 2).items(), version=2)
        assert report.committed == [engine.endpoint]
        assert engine.current_version == 2
        assert_same(target, contiguous(bump(base, 2)))


async def test_under_available_a_refused_completion_leaves_only_that_engine_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = mixed_weights()
    targets = [zeros_like(base), zeros_like(base)]
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10, policy="available")
    async with receivers(targets) as engines:
        endpoints = [engine.endpoint for engine in engines]
        async with WeightSender(endpoints, config=config) as sender:
            monkeypatch.setattr(StreamState, "check_whole", _failing_check(1))
            report = await sender.send(base.items(), version=0)
            (failed,) = report.failed
            assert "planted" in (failed.error or "")
            (committed,) = report.committed
            versions = {e.endpoint: e.current_version for e in engines}
            assert versions == {committed: 0, failed.engine: None}
            for engine, target in zip(engines, targets, strict=True):
                expected = contiguous(base) if engine.endpoint == committed else zeros_like(base)
                assert_same(target, expected)


async def test_a_refused_completion_under_all_with_two_engines_commits_neither(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = mixed_weights()
    targets = [zeros_like(base), zeros_like(base)]
    async with (
        receivers(targets) as engines,
        WeightSender([e.endpoint for e in engines], config=SMALL) as sender,
    ):
        monkeypatch.setattr(StreamState, "check_whole", _failing_check(1))
        with pytest.raises(RejectedError, match="planted"):
            await sender.send(base.items(), version=0)
        assert [e.current_version for e in engines] == [None, None]
        for target in targets:
            assert_same(target, zeros_like(base))


class _FailingCommit(ModuleSink):
    """A staged sink whose commit fails (after a good completion check)."""

    def commit(self, version: int) -> None:
        raise RuntimeError("planted: cannot swap")


async def test_a_refused_commit_after_a_good_completion_is_reported_and_keeps_the_version() -> None:
    base = mixed_weights()
    target = zeros_like(base)
    sink = _FailingCommit(target, staged=True)
    async with (
        receivers([target], [sink]) as (engine,),
        WeightSender(engine.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(RejectedError, match="planted: cannot swap") as info:
            await sender.send(base.items(), version=0)
        assert info.value.peer == engine.endpoint
        assert engine.current_version is None


async def test_a_refused_manifest_with_buckets_in_flight_applies_nothing() -> None:
    """One engine: buckets follow the begin before it is accepted; the engine refuses the
    version and every bucket after it, and an in-place sink is never written."""
    base = mixed_weights()
    target = refusing_target(base)
    before = {k: v.clone() for k, v in target.items()}
    applied: list[int] = []

    class Counting(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list[Any]) -> None:
            applied.append(len(specs))
            super().apply_bucket(bucket, specs)

    config = SenderConfig(buffer_bytes=4096, num_buffers=4, timeout=10)
    async with (
        receivers([target], [Counting(target)]) as (engine,),
        WeightSender(engine.endpoint, config=config) as sender,
    ):
        with pytest.raises(RejectedError, match="model has") as info:
            await sender.send(base.items(), version=0)
        assert info.value.tensor == "embed.weight"
        assert applied == []
        assert engine.current_version is None
        assert engine.servable  # in place, and still servable: nothing was written
        assert_same(target, before)


class _SlowLast(ModuleSink):
    """Applies the bucket holding ``lm_head.weight`` late (widens the window, no timing
    is asserted): the trainer's completion goes out before that bucket's ack."""

    def apply_bucket(self, bucket: torch.Tensor, specs: list[Any]) -> None:
        if any(spec.name == "lm_head.weight" for spec in specs):
            import time

            time.sleep(0.2)
        super().apply_bucket(bucket, specs)


@pytest.mark.parametrize(
    ("engines", "snapshot", "commit_early"),
    [(1, False, True), (1, True, False), (2, False, False), (2, True, False)],
    ids=["one", "one-snapshot", "two-all", "two-all-snapshot"],
)
async def test_the_completion_follows_the_last_bucket_and_the_commit_where_nothing_stands_between(
    engines: int, snapshot: bool, commit_early: bool, order: list[tuple[str, str, int]]
) -> None:
    """The completion always goes right after the last bucket (a prepare commits nothing);
    the commit too with one engine, but not over a snapshot check or a fleet's vote."""
    base = mixed_weights()
    targets = [zeros_like(base) for _ in range(engines)]
    sinks = [_SlowLast(target, staged=True) for target in targets]
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10, check_snapshot=snapshot)
    async with (
        receivers(targets, sinks) as fleet,  # type: ignore[arg-type]
        WeightSender([e.endpoint for e in fleet], config=config) as sender,
    ):
        for version in range(2):
            order.clear()
            report = await sender.send(bump(base, version).items(), version=version)
            assert [e.current_version for e in fleet] == [version] * engines
            for target in targets:
                assert_same(target, contiguous(bump(base, version)))
            last, complete = report.buckets, report.buckets + 1
            for engine in fleet:
                marks = [(kind, seq) for peer, kind, seq in order if peer == engine.endpoint]
                acked_last = marks.index(("acked", last))
                assert marks.index(("sent", complete)) < acked_last
                assert (marks.index(("sent", complete + 1)) < acked_last) is commit_early
            if engines > 1:  # no commit before every engine prepared
                acks = [i for i, e in enumerate(order) if e[1:] == ("acked", complete)]
                commits = [i for i, e in enumerate(order) if e[1:] == ("sent", complete + 1)]
                assert max(acks) < min(commits)


class _RefusesLast(ModuleSink):
    """A staged sink that fails on the bucket holding ``lm_head.weight`` while armed."""

    armed = False

    def apply_bucket(self, bucket: torch.Tensor, specs: list[Any]) -> None:
        if self.armed and any(spec.name == "lm_head.weight" for spec in specs):
            raise RuntimeError("planted: out of memory")
        super().apply_bucket(bucket, specs)


async def test_a_refused_last_bucket_with_the_ends_in_flight_commits_nothing() -> None:
    base = mixed_weights()
    target = zeros_like(base)
    sink = _RefusesLast(target, staged=True)
    async with (
        receivers([target], [sink]) as (engine,),
        WeightSender(engine.endpoint, config=SMALL) as sender,
    ):
        await sender.send(base.items(), version=0)
        sink.armed = True
        with pytest.raises(RejectedError, match="planted: out of memory"):
            await sender.send(bump(base, 1).items(), version=1)
        assert engine.current_version == 0
        assert engine.servable
        assert_same(target, contiguous(base))
        assert [f.version for f in engine.failures] == [1]
        sink.armed = False  # the completion's and the commit's refusals are skipped
        await sender.send(bump(base, 2).items(), version=2)
        assert engine.current_version == 2
        assert_same(target, contiguous(bump(base, 2)))


# --------------------------------------------------------------------------------------
# several engines under 'all': bucket 1 is packed while the engines check the begin
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("refused", [False, True])
async def test_under_all_bucket_1_is_packed_early_but_published_only_once_all_accepted(
    refused: bool, order: list[tuple[str, str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosync.planes.shm import ShmSenderPlane

    pack, publish = ShmSenderPlane.pack, ShmSenderPlane.publish

    def spy_pack(self: ShmSenderPlane, index: int, plan: Any) -> None:
        order.append(("plane", "packed", index))
        pack(self, index, plan)

    async def spy_publish(self: ShmSenderPlane, index: int, used: int) -> None:
        order.append(("plane", "published", index))
        await publish(self, index, used)

    monkeypatch.setattr(ShmSenderPlane, "pack", spy_pack)
    monkeypatch.setattr(ShmSenderPlane, "publish", spy_publish)
    base = mixed_weights()
    targets = [zeros_like(base), refusing_target(base) if refused else zeros_like(base)]
    before = [{k: v.clone() for k, v in t.items()} for t in targets]
    async with (
        receivers(targets) as engines,
        WeightSender([e.endpoint for e in engines], config=SMALL) as sender,
    ):
        if refused:
            with pytest.raises(RejectedError, match="model has"):
                await sender.send(base.items(), version=0)
            assert [e.current_version for e in engines] == [None, None]
            packed = [e for e in order if e[1] == "packed"]
            assert packed == [("plane", "packed", 0)]  # bucket 1, then the refusal: no more
            assert not [e for e in order if e[1] == "published"]
            assert not [e for e in order if e[1:] == ("sent", 1)]
            for target, old in zip(targets, before, strict=True):
                assert_same(target, old)
            return
        report = await sender.send(base.items(), version=0)
        assert report.committed == [e.endpoint for e in engines]
        last_begin_ack = max(i for i, e in enumerate(order) if e[1:] == ("acked", 0))
        first_pack = min(i for i, e in enumerate(order) if e[1] == "packed")
        assert first_pack < last_begin_ack  # bucket 1 packed while the engines checked
        first_out = min(
            i for i, e in enumerate(order) if e[1] == "published" or e[1:] == ("sent", 1)
        )
        assert last_begin_ack < first_out
