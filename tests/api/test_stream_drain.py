"""A plane's ``drain`` (its sends still reading the trainer's tensors) and a version's end.

The engines' closing messages (complete, commit) do not wait for the drain: each engine
checks for itself that it holds every bucket whole. The trainer's ``packed`` event does:
its tensors are free only once no send reads them. A send task whose ack task ended (the
version is being cancelled) raises the cancellation, not a closed stream's error.
"""

from __future__ import annotations

import anyio
import pytest

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from tests.api.test_stream import GUARD, bump, contiguous
from tests.helpers.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)


@pytest.mark.parametrize(("engines", "policy"), [(1, "all"), (2, "available")])
async def test_the_engines_commit_while_the_plane_still_drains(engines: int, policy: str) -> None:
    """Where each engine's commit depends on its own check alone (one engine, or policy
    ``available``: see ``StreamRun._may_commit_at_once``)."""
    base = mixed_weights()
    targets = [zeros_like(base) for _ in range(engines)]
    async with (
        WeightReceiver(ModuleSink(targets[0])) as first,
        WeightReceiver(ModuleSink(targets[-1])) as last,
    ):
        receivers = [first, last][:engines]
        endpoints = [r.endpoint for r in receivers]
        async with WeightSender(endpoints, config=SMALL) as sender:
            packed = anyio.Event()
            seen: dict[str, object] = {}

            async def drain() -> None:  # held until every engine committed the version
                seen["packed when draining"] = packed.is_set()
                with anyio.fail_after(GUARD):
                    while any(r.current_version != 0 for r in receivers):
                        await anyio.sleep(0.01)
                seen["drained"] = True

            sender._plane.drain = drain  # type: ignore[union-attr]
            weights = bump(base, 1)
            report = await sender.send(weights, version=0, packed=packed, policy=policy)
    assert seen == {"packed when draining": False, "drained": True}
    assert report.committed == endpoints
    for target in targets:
        assert_same(target, contiguous(weights))


async def test_under_a_collective_plane_the_commit_waits_for_the_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``joins_all``: the complete still leaves before the drain, the commit only after it
    (an engine's receives ending does not show they carried this version)."""
    from aiosync.core.trainer_session import LinkSession

    events: list[tuple[str, int]] = []
    sent = LinkSession.sent

    def record(self: LinkSession, seq: int) -> None:
        events.append(("sent", seq))
        sent(self, seq)

    monkeypatch.setattr(LinkSession, "sent", record)
    base = mixed_weights()
    target = zeros_like(base)
    async with (
        WeightReceiver(ModuleSink(target)) as receiver,
        WeightSender([receiver.endpoint], config=SMALL) as sender,
    ):
        committed_while_draining: list[object] = []

        async def drain() -> None:
            await anyio.sleep(0.05)  # the links send their closing messages meanwhile
            committed_while_draining.append(receiver.current_version)
            events.append(("drained", 0))

        plane = sender._plane
        monkeypatch.setattr(plane, "drain", drain, raising=False)
        monkeypatch.setattr(plane, "joins_all", True, raising=False)
        weights = bump(base, 1)
        report = await sender.send(weights, version=0)
    complete, commit = report.buckets + 1, report.buckets + 2
    order = [e for e in events if e in {("sent", complete), ("sent", commit), ("drained", 0)}]
    assert order == [("sent", complete), ("drained", 0), ("sent", commit)]
    assert committed_while_draining == [None]
    assert_same(target, contiguous(weights))


async def test_a_bucket_sent_after_its_ack_loop_ended_raises_the_cancellation() -> None:
    """A zmq send that completes at once passes no checkpoint: the send task then finds
    the ack loop's stream closed (the task group is being cancelled) and must raise the
    cancellation, not a broken stream that would hide it."""
    from types import SimpleNamespace

    from aiosync.core.layout import BucketPlan
    from aiosync.pipeline.fanout import BucketFanout, _Packed

    sent: list[bytes] = []

    async def send(payload: bytes, *args: object) -> None:
        sent.append(payload)  # done at once, as zmq's send often is

    link = SimpleNamespace(window=None, send=send, session=SimpleNamespace(sent=lambda seq: None))
    inflight_tx, inflight_rx = anyio.create_memory_object_stream[_Packed](4)
    inflight_rx.close()  # the ack loop has ended
    fanout = SimpleNamespace(version=3, timeout=1.0)
    packed = _Packed(1, 0, b"bucket", BucketPlan())
    with anyio.CancelScope() as scope:
        scope.cancel()
        await BucketFanout._send_one(fanout, link, packed, inflight_tx)  # type: ignore[arg-type]
    assert scope.cancelled_caught
    assert sent == [b"bucket"]
    inflight_tx.close()
