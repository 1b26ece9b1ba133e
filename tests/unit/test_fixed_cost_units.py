"""Pieces of a version's fixed cost, one at a time (no engine process; see
tests/api/test_version_fixed_cost.py for whole versions).

- the ``begin`` encoded from the manifest's kept bytes is the same message, byte for byte;
- an engine takes an unchanged manifest and a count-only completion check as light work
  (no thread hop), and nothing else; a refused completion or version with messages in
  flight after it commits and applies nothing (pure machine);
- who may send ``commit`` with ``complete``; a layout's plans say which one is the last;
- a DEALER channel takes a message already waiting without polling, in order.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from aiosync import SenderConfig
from aiosync.core.engine_actions import CommitSink
from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.trainer_session import Policy
from aiosync.core.where_to_run import LOOP_ENTRIES
from aiosync.core.wire import (
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    Slot,
    _BeginBytes,
    decode,
    encode,
)
from aiosync.pipeline.begin import _MANIFESTS, _RawBegin, encode_begin
from aiosync.pipeline.stream import StreamRun
from aiosync.pipeline.version_spec import VersionSpec
from tests.unit.test_engine_session import (
    MANIFEST,
    PEER,
    ack_of,
    applies,
    connected,
    model,
    replies,
    send,
    stream,
)

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)

# --------------------------------------------------------------------------------------
# the begin's bytes
# --------------------------------------------------------------------------------------

LLAMA = [TensorMeta(f"layer.{i}.w", "bfloat16", (i + 1, 16)) for i in range(291)]


@pytest.mark.parametrize(
    "manifest",
    [None, [], MANIFEST, LLAMA, [TensorMeta("big", "uint8", (1 << 20,), chunks=3)]],
    ids=["none", "empty", "small", "291", "chunked"],
)
@pytest.mark.parametrize("flags", [{}, {"empty": True}, {"rebase": True}])
def test_a_begin_from_kept_manifest_bytes_is_the_same_message(
    manifest: list[TensorMeta] | None, flags: dict[str, bool]
) -> None:
    assert _RawBegin.__struct_fields__ == Begin.__struct_fields__  # a new field: here too
    assert _BeginBytes.__struct_fields__ == Begin.__struct_fields__  # and in the memo's
    raw = None if manifest is None else msgspec.Raw(msgspec.msgpack.encode(manifest))
    assert msgspec.msgpack.encode(_RawBegin(7, raw, **flags)) == encode(Begin(7, manifest, **flags))


def test_a_begin_carrying_bucket_1_from_its_encoded_bytes_is_the_same_message() -> None:
    bucket = Bucket(7, 1, 2, 512, slots=[Slot(0, 0, 16)], regions=[])
    payload, carried = encode_begin(
        7, LLAMA, {"empty": False, "rebase": False}, [Limits()], encode(bucket)
    )
    assert carried is LLAMA
    assert payload == encode(Begin(7, LLAMA, first=bucket))
    assert decode(payload) == Begin(7, LLAMA, first=bucket)


def test_the_manifests_bytes_are_kept_by_identity_only() -> None:
    manifest = list(LLAMA)
    kept = _MANIFESTS.put(manifest)
    assert _MANIFESTS.get(manifest) is kept
    assert _MANIFESTS.get(list(LLAMA)) is None  # equal but another list: encoded afresh
    manifest.append(TensorMeta("x", "float32", (1,)))  # nobody does this; and if so:
    assert _MANIFESTS.get(manifest) is kept  # the same object (a sender's lists are fresh)


# --------------------------------------------------------------------------------------
# the engine's light checks (pure machine)
# --------------------------------------------------------------------------------------


def test_an_unchanged_manifest_is_light_and_a_changed_one_is_not() -> None:
    engine = connected(model())
    assert not engine.light(PEER, Begin(0, MANIFEST))  # nothing remembered yet
    stream(engine, 0, manifest=MANIFEST)
    send(engine, Complete(0, 3, 2, 2))
    assert engine.light(PEER, Begin(1, list(MANIFEST)))
    changed = [MANIFEST[0], TensorMeta("b", "float32", (5,))]
    assert not engine.light(PEER, Begin(1, changed))
    assert not engine.light(PEER, Begin(1, None))
    assert not engine.light(PEER, Bucket(1, 1, 0, 512, slots=[Slot(0, 0, 16)]))


class _CountedList(list[TensorMeta]):
    """A decoded manifest that counts how often it is compared entry by entry."""

    compared = 0

    def __ne__(self, other: object) -> bool:
        type(self).compared += 1
        return list.__ne__(self, other)  # type: ignore[arg-type]


def test_a_begin_s_unchanged_manifest_is_compared_once_for_triage_and_opening() -> None:
    engine = connected(model())
    stream(engine, 0, manifest=MANIFEST)
    send(engine, Complete(0, 3, 2, 2))
    send(engine, Commit(0, 4))
    decoded = _CountedList(MANIFEST)
    assert engine.light(PEER, Begin(1, decoded))
    assert ack_of(send(engine, Begin(1, decoded))).ok  # the stream opens, replaying
    assert _CountedList.compared == 1
    other = _CountedList([MANIFEST[0], TensorMeta("b", "float32", (5,))])
    assert not engine.light(PEER, Begin(2, other))  # a changed one is still compared
    assert _CountedList.compared == 2


def test_a_manifest_past_the_light_bound_is_never_light() -> None:
    big = [TensorMeta(f"t{i}", "float32", (1,)) for i in range(LOOP_ENTRIES + 1)]
    engine = connected()
    send(engine, Begin(0, big))
    engine.memory = type("Memory", (), {"manifest": big, "same_manifest": lambda s, m: True})()  # type: ignore[assignment]
    assert not engine.light(PEER, Begin(1, big))


def test_a_completion_is_light_with_a_manifest_and_not_when_half_replayed() -> None:
    engine = connected(model())
    stream(engine, 0, manifest=MANIFEST)
    assert engine.light(PEER, Complete(0, 3, 2, 2))
    assert not engine.light(PEER, Complete(1, 3, 2, 2))  # not the open stream's version
    send(engine, Complete(0, 3, 2, 2))
    send(engine, Commit(0, 4))
    stream(engine, 1, manifest=MANIFEST, names=("a",))  # replays the first bucket only
    assert not engine.light(PEER, Complete(1, 2, 1, 1))  # ending the replay walks tensors
    fresh = connected(model())
    stream(fresh, 0)  # no manifest: coverage is counted at completion
    assert not fresh.light(PEER, Complete(0, 3, 2, 2))
    bare = connected()
    stream(bare, 0)  # no manifest, no expectations: counts only
    assert bare.light(PEER, Complete(0, 3, 2, 2))


# --------------------------------------------------------------------------------------
# refusals with messages in flight (pure machine)
# --------------------------------------------------------------------------------------


def test_a_commit_sent_with_a_refused_completion_commits_nothing() -> None:
    engine = connected(model())
    stream(engine, 0, manifest=MANIFEST, names=("a",))  # b never sent
    assert not ack_of(send(engine, Complete(0, 2, 1, 1))).ok
    actions = send(engine, Commit(0, 3))  # already on its way when the refusal went out
    assert not any(isinstance(a, CommitSink) for a in actions)
    assert ack_of(actions) == Ack(0, 3, False, error="stream already failed")
    assert engine.current_version is None
    assert engine.owner is None


def test_a_refused_version_applies_no_bucket_sent_before_the_refusal_arrived() -> None:
    engine = connected(model())
    wrong = [TensorMeta("a", "float32", (5,)), MANIFEST[1]]
    assert not ack_of(send(engine, Begin(0, wrong))).ok
    early = [
        Bucket(0, 1, 0, 512, slots=[Slot(0, 0, 16)]),
        Bucket(0, 2, 1, 512, slots=[Slot(1, 0, 16)]),
    ]
    after = [a for bucket in early for a in send(engine, bucket)]
    after += send(engine, Complete(0, 3, 2, 2)) + send(engine, Commit(0, 4))
    assert applies(after) == []
    assert not any(isinstance(a, CommitSink) for a in after)
    acks = [m for m in replies(after) if isinstance(m, Ack)]
    assert [(m.seq, m.ok) for m in acks] == [(1, False), (2, False), (3, False), (4, False)]
    assert engine.current_version is None
    assert engine.servable


class _Link:
    def __init__(self, name: str, window: object = None) -> None:
        self.name, self.window = name, window


class _Voting(StreamRun):
    async def _complete(self, link: Any) -> None:  # a topology's vote across engines
        await super()._complete(link)


@pytest.mark.parametrize(
    ("links", "policy", "subclass", "expected"),
    [
        (1, Policy.ALL, False, True),
        (3, Policy.AVAILABLE, False, True),
        (3, Policy.ALL, False, False),
        (1, Policy.ALL, True, False),
        (1, Policy.AVAILABLE, True, False),
    ],
)
def test_who_may_commit_at_once(links: int, policy: Policy, subclass: bool, expected: bool) -> None:
    kind = _Voting if subclass else StreamRun
    run = kind(
        links=[_Link(f"e{i}") for i in range(links)],  # type: ignore[misc]
        plane=None,  # type: ignore[arg-type]
        policy=policy,
        spec=VersionSpec(0, None),
    )
    assert run._may_commit_at_once() is expected


def test_a_req_socket_keeps_two_phases() -> None:
    run = StreamRun(
        links=[_Link("req", window=object())],  # type: ignore[list-item]
        plane=None,  # type: ignore[arg-type]
        policy=Policy.ALL,
        spec=VersionSpec(0, None),
    )
    assert not run._may_commit_at_once()


# --------------------------------------------------------------------------------------
# the stream's end: complete and commit right after the last bucket
# --------------------------------------------------------------------------------------


def test_a_layouts_plans_say_when_the_last_one_was_handed_out() -> None:
    from aiosync.core.planning import lay_out

    weights = {
        "a": torch.zeros(10),
        "big": torch.arange(3000, dtype=torch.float32),  # 12000 bytes: chunked in 4096
        "c": torch.zeros(3),
    }
    layout = lay_out(weights.items(), 4096, 4096)
    assert layout is not None
    plans = layout.buckets(4096)
    seen = []
    while True:
        plan = next(plans, None)
        if plan is None:
            break
        seen.append(([s.name for s in plan.specs], plans.done))
    assert [done for _, done in seen] == [False] * (len(seen) - 1) + [True]
    assert [s for names, _ in seen for s in names].count("big") == 3
    empty = lay_out([], 4096, 4096)
    assert empty is not None
    assert empty.buckets(4096).done


# --------------------------------------------------------------------------------------
# a DEALER channel takes a message already waiting without polling
# --------------------------------------------------------------------------------------


async def test_messages_already_waiting_arrive_in_order_and_a_lost_peer_is_still_seen() -> None:
    import anyio

    from aiosync.channels.zmq import ZmqChannel, ZmqListener
    from aiosync.core.errors import PeerGoneError

    listener = ZmqListener.open(None)
    channel = ZmqChannel.connect(listener.endpoint)
    try:
        await channel.send(b"hello")
        with anyio.fail_after(10):
            peer = await listener.accept()
            assert await peer.recv() == b"hello"
            for i in range(20):
                await peer.send(b"%d" % i)
            while not channel._socket.poll(0):  # wait until they are there, unread
                await anyio.sleep(0.01)
            assert [await channel.recv() for _ in range(20)] == [b"%d" % i for i in range(20)]
            await listener.aclose()  # the engine goes away
            with pytest.raises(PeerGoneError):
                await channel.recv()
    finally:
        await channel.aclose()
        await listener.aclose()
