"""An engine's limits: what any one peer may send, hold, or make it remember.

The pure rules through the session machine, then the limits a live receiver states and a
sender plans to (buckets split, a manifest left out), and one oversized frame.
"""

from __future__ import annotations

import pytest
import torch

from aiosync import (
    CallbackSink,
    ModuleSink,
    PeerGoneError,
    ReceiverConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.inproc import InprocListener
from aiosync.channels.zmq import ZmqChannel
from aiosync.core.engine_actions import Apply, CommitSink, Note, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits, shorten
from aiosync.core.manifest import TensorMeta
from aiosync.core.wire import (
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    Abort,
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    Hello,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    decode,
)

PEER = "peer-1"
BUF = 1 << 16


def engine(**limits: int | bool) -> EngineSession:
    return EngineSession(
        expectations=None,
        staged=False,
        stream_timeout=10,
        session_timeout=60,
        limits=Limits(**limits),  # type: ignore[arg-type]
    )


def hello(sizes: tuple[int, ...] = (BUF, BUF), sender: str = "trainer") -> Hello:
    buffers = [ShmHandle(f"aiosync-1-2-{i:016x}", size) for i, size in enumerate(sizes)]
    return Hello(PROTOCOL_MIN, PROTOCOL_MAX, "s", sender, ShmPlaneSpec(buffers))


def replies(actions: list[object]) -> list[object]:
    return [a.message for a in actions if isinstance(a, Reply)]


def open_session(machine: EngineSession, peer: str = PEER, **kw: object) -> list[object]:
    actions = machine.receive(peer, hello(**kw), 0.0)  # type: ignore[arg-type]
    if any(isinstance(m, Abort) for m in replies(actions)):
        return replies(actions)
    return replies(machine.plane_opened(peer))


def commit(machine: EngineSession, version: int, peer: str = PEER) -> None:
    """Stream one float32[1] tensor as ``version`` and commit it."""
    assert replies(machine.receive(peer, Begin(version), 0.0)) == [Ack(version, 0, True)]
    spec = TensorSpec("w", "float32", (1,), 0, 4)
    [apply] = machine.receive(peer, Bucket(version, 1, 0, 512, specs=[spec]), 0.0)
    assert isinstance(apply, Apply)
    machine.applied(peer, 1, 0.0)
    assert replies(machine.receive(peer, Complete(version, 2, 1, 1), 0.0)) == [
        Ack(version, 2, True)
    ]
    assert machine.receive(peer, Commit(version, 3), 0.0) == [CommitSink(peer, version)]
    machine.commit_done(peer, version, 0.0)
    assert machine.current_version == version


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        Limits(max_sessions=0)


def test_ready_states_the_engines_limits() -> None:
    machine = engine(max_bucket_tensors=7)
    [ready] = open_session(machine)
    assert isinstance(ready, Ready)
    assert ready.limits.max_bucket_tensors == 7


@pytest.mark.parametrize(
    ("limits", "sizes", "text"),
    [
        ({"max_buffers": 2}, (BUF,) * 3, "3 buffers"),
        ({"max_session_bytes": 2 * BUF - 1}, (BUF, BUF), f"{2 * BUF} bytes"),
    ],
)
def test_a_plane_past_the_limits_is_refused(
    limits: dict[str, int], sizes: tuple[int, ...], text: str
) -> None:
    machine = engine(**limits)
    [abort] = open_session(machine, sizes=sizes)
    assert isinstance(abort, Abort)
    assert text in abort.reason
    assert machine.sessions == {}


def test_sessions_at_once_are_bounded() -> None:
    machine = engine(max_sessions=2)
    for peer in ("a", "b"):
        assert isinstance(open_session(machine, peer)[0], Ready)
    [abort] = open_session(machine, "c")
    assert isinstance(abort, Abort)
    assert "2 sessions" in abort.reason
    assert isinstance(open_session(machine, "a")[0], Ready)  # a known peer may reconnect


def test_peer_chosen_strings_are_cut_before_they_are_kept() -> None:
    machine = engine(max_name_length=100)
    open_session(machine, sender="x" * 100_000)
    [session] = machine.sessions.values()
    assert len(session.name) < 200
    machine.receive(PEER, Begin(1), 0.0)
    machine.receive(PEER, Abort("y" * 100_000, 1), 0.0)
    assert len(machine.failures[-1].reason) < 300
    assert shorten("abc", 5) == "abc"


def test_a_manifest_past_the_limit_is_refused_before_anything_moves() -> None:
    machine = engine(max_manifest_tensors=3)
    open_session(machine)
    manifest = [TensorMeta(f"t{i}", "float32", (1,)) for i in range(4)]
    [ack] = replies(machine.receive(PEER, Begin(1, manifest), 0.0))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "4 tensors" in (ack.error or "")
    assert machine.owner is None


def test_a_tensor_name_past_the_limit_is_refused() -> None:
    machine = engine(max_name_length=10)
    open_session(machine)
    [ack] = replies(machine.receive(PEER, Begin(1, [TensorMeta("n" * 11, "float32", (1,))]), 0))
    assert isinstance(ack, Ack)
    assert not ack.ok


def test_a_bucket_past_the_limit_ends_the_session() -> None:
    machine = engine(max_bucket_tensors=2)
    open_session(machine)
    machine.receive(PEER, Begin(1), 0.0)
    specs = [TensorSpec(f"t{i}", "float32", (1,), 512 * i, 4) for i in range(3)]
    actions = machine.receive(PEER, Bucket(1, 1, 0, 2048, specs=specs), 0.0)
    assert not any(isinstance(a, Apply) for a in actions)
    [abort] = replies(actions)
    assert isinstance(abort, Abort)
    assert "3 tensors" in abort.reason


def test_failures_kept_are_bounded_newest_last() -> None:
    machine = engine(max_failures=3)
    open_session(machine)
    for version in range(1, 11):
        machine.receive(PEER, Begin(version), 0.0)
        machine.receive(PEER, Abort(f"gave up {version}", version), 0.0)
    assert [f.version for f in machine.failures] == [8, 9, 10]


def test_versions_may_jump_only_so_far() -> None:
    machine = engine(max_version_step=100)
    open_session(machine)
    commit(machine, 10**12)  # the first version may be any number
    [ack] = replies(machine.receive(PEER, Begin(10**12 + 101), 0.0))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "jumps more than 100" in (ack.error or "")
    commit(machine, 10**12 + 100)


def test_an_abusive_version_cannot_move_an_empty_engine() -> None:
    """The reported attack: a huge version with no buckets. It needs a begin, and a version
    without tensors commits only when the sender says so (and a sink requiring nothing)."""
    machine = engine()
    open_session(machine)
    machine.receive(PEER, Begin(2**63 - 1), 0.0)
    [ack] = replies(machine.receive(PEER, Complete(2**63 - 1, 1, 0, 0), 0.0))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert machine.current_version is None


@pytest.mark.parametrize("allowed", [False, True])
def test_a_rebase_is_taken_only_where_allowed_and_is_logged(allowed: bool) -> None:
    machine = engine(allow_rebase=allowed)
    open_session(machine)
    commit(machine, 500)
    actions = machine.receive(PEER, Begin(3, rebase=True), 0.0)
    [ack] = replies(actions)
    assert isinstance(ack, Ack)
    assert ack.ok is allowed
    notes = [a for a in actions if isinstance(a, Note)]
    assert bool(notes) is allowed
    if allowed:
        assert "restarts the numbering at 3" in notes[0].text
        machine.receive(PEER, Abort("done", 3), 0.0)
    assert machine.current_version == 500


# --- through a live receiver -----------------------------------------------------------


async def test_a_sender_splits_buckets_to_the_engines_limit() -> None:
    weights = {f"w{i}": torch.full((1,), float(i)) for i in range(40)}
    model = {name: torch.zeros(1) for name in weights}
    config = ReceiverConfig(limits=Limits(max_bucket_tensors=8))
    async with (
        WeightReceiver(ModuleSink(model), config=config) as receiver,
        WeightSender(receiver.endpoint) as sender,
    ):
        report = await sender.send(weights, version=0)
    assert report.buckets == 5
    assert all(torch.equal(model[n], t) for n, t in weights.items())


async def test_a_manifest_past_the_limit_is_left_out_and_the_version_still_streams() -> None:
    weights = {f"w{i}": torch.full((2,), float(i)) for i in range(30)}
    model = {name: torch.zeros(2) for name in weights}
    config = ReceiverConfig(limits=Limits(max_manifest_tensors=10))
    async with (
        WeightReceiver(ModuleSink(model), config=config) as receiver,
        WeightSender(receiver.endpoint) as sender,
    ):
        await sender.send(weights, version=0)
        assert receiver.current_version == 0
    assert all(torch.equal(model[n], t) for n, t in weights.items())


async def test_an_oversized_frame_cuts_that_peer_and_the_engine_keeps_serving() -> None:
    """ZMQ drops a frame past the limit before the engine allocates it, and the peer's
    connection with it; an in-process channel has no such guard, and the engine refuses
    the frame itself."""
    config = ReceiverConfig(limits=Limits(max_message_bytes=4096))
    async with WeightReceiver(CallbackSink(lambda pairs: None), config=config) as receiver:
        channel = ZmqChannel.connect(receiver.endpoint)
        try:
            await channel.send(b"\x00" * 10_000)
            with pytest.raises(PeerGoneError):
                await channel.recv()
        finally:
            await channel.aclose()
        async with WeightSender(receiver.endpoint) as sender:
            await sender.send([("x", torch.ones(3))], version=1)
        assert receiver.current_version == 1
    listener = InprocListener()
    async with WeightReceiver(CallbackSink(lambda pairs: None), listener, config=config) as rx:
        peer = listener.connect()
        await peer.send(b"\x00" * 10_000)
        reply = decode(await peer.recv())
        assert isinstance(reply, Abort)
        assert "10000-byte message" in reply.reason
        assert rx.protocol_errors == 1
