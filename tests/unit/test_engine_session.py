"""Unit tests of the engine's session machine (:mod:`aiosync.core.engine_session`).

In the style of h11: feed messages in, check the actions that come out and the state left
behind. The IO layer is played by :func:`carry_out`, the way the engine loop does it: an
``OpenPlane`` is answered with ``plane_opened``, an ``Apply`` with ``applied`` (or
``apply_failed``), a ``CommitSink`` with ``commit_done`` (or ``commit_failed``), and their
follow-up actions run before the next message. No process, no socket, no buffer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec
import pytest

from aiosync.core.engine_actions import (
    Action,
    Apply,
    ClosePlane,
    CommitSink,
    Committed,
    Discard,
    OpenPlane,
    Reply,
    SyncFailure,
)
from aiosync.core.engine_session import EngineSession, Phase
from aiosync.core.errors import AiosyncError, MismatchError, ProtocolError
from aiosync.core.layout import TensorSpec, calculate_aligned_size
from aiosync.core.limits import Limits
from aiosync.core.manifest import Expectations, Expected, TensorMeta
from aiosync.core.wire import (
    GOODBYE_SEQ,
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    CudaPlaneSpec,
    Goodbye,
    Hello,
    Message,
    Ping,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    Slot,
    decode,
)

PEER = "trainer-0"
RIVAL = "trainer-1"
SESSION = "session-abc"
BUF = 4096
STREAM_TIMEOUT = 10.0
SESSION_TIMEOUT = 60.0

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def plane(sizes: Sequence[int] = (BUF, BUF)) -> ShmPlaneSpec:
    return ShmPlaneSpec([ShmHandle(f"aiosync-test-{i}", size) for i, size in enumerate(sizes)])


def hello(
    session: str = SESSION,
    *,
    sizes: Sequence[int] = (BUF, BUF),
    low: int = PROTOCOL,
    high: int = PROTOCOL,
) -> Hello:
    return Hello(low, high, session, "trainer", plane(sizes))


def model(
    required: Sequence[str] = ("a", "b"), aliases: dict[str, str] | None = None
) -> Expectations:
    """What a small model's sink takes: two float32[4], a big uint8 and a strided target."""
    return Expectations(
        {
            "a": Expected("float32", (4,)),
            "b": Expected("float32", (4,)),
            "big": Expected("uint8", (6000,)),
            "strided": Expected("float32", (1024, 2), chunkable=False),
        },
        frozenset(required),
        aliases or {},
    )


def machine(
    expectations: Expectations | None = None, *, staged: bool = False, current: int | None = None
) -> EngineSession:
    engine = EngineSession(
        expectations=expectations,
        staged=staged,
        stream_timeout=STREAM_TIMEOUT,
        session_timeout=SESSION_TIMEOUT,
    )
    engine.current_version = current
    return engine


def carry_out(
    engine: EngineSession,
    actions: list[Action],
    now: float = 0.0,
    *,
    apply_error: AiosyncError | None = None,
    commit_error: AiosyncError | None = None,
) -> list[Action]:
    """Every action in the order the engine loop meets it, IO follow-ups included."""
    done: list[Action] = []
    queue = deque(actions)
    while queue:
        action = queue.popleft()
        done.append(action)
        follow: list[Action] = []
        if isinstance(action, OpenPlane):
            follow = engine.plane_opened(action.peer)
        elif isinstance(action, Apply):
            if apply_error is not None:
                follow = engine.apply_failed(action.peer, action.seq, apply_error)
            else:
                follow = engine.applied(action.peer, action.seq, now)
        elif isinstance(action, CommitSink):
            if commit_error is not None:
                follow = engine.commit_failed(action.peer, action.version, commit_error)
            else:
                follow = engine.commit_done(action.peer, action.version, now)
        queue.extendleft(reversed(follow))
    return done


def send(
    engine: EngineSession,
    message: Message,
    peer: str = PEER,
    now: float = 0.0,
    **io: AiosyncError | None,
) -> list[Action]:
    """Deliver one message and carry out what it asks for."""
    return carry_out(engine, engine.receive(peer, message, now), now, **io)


def replies(actions: list[Action], peer: str = PEER) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Reply) and a.peer == peer]


def reply(actions: list[Action], peer: str = PEER) -> Message:
    (message,) = replies(actions, peer)
    return message


def ack_of(actions: list[Action], peer: str = PEER) -> Ack:
    message = reply(actions, peer)
    assert isinstance(message, Ack), message
    return message


def applies(actions: list[Action]) -> list[Apply]:
    return [a for a in actions if isinstance(a, Apply)]


def connected(
    expectations: Expectations | None = None,
    *,
    staged: bool = False,
    current: int | None = None,
    peers: Sequence[str] = (PEER,),
    sizes: Sequence[int] = (BUF, BUF),
) -> EngineSession:
    engine = machine(expectations, staged=staged, current=current)
    for peer in peers:
        ready = reply(send(engine, hello(f"session-{peer}", sizes=sizes), peer), peer)
        assert ready == Ready(f"session-{peer}", PROTOCOL, current)
    return engine


def whole(name: str, offset: int = 0, n: int = 4) -> TensorSpec:
    """A whole float32[n] tensor at ``offset``."""
    return TensorSpec(name, "float32", (n,), offset, 4 * n)


def chunk(name: str, start: int, nbytes: int, total: int = 6000) -> TensorSpec:
    """Bytes ``start``..``start+nbytes`` of a uint8[total] tensor, at offset 0."""
    return TensorSpec(name, "uint8", (total,), 0, nbytes, start)


def used(ends: list[int]) -> int:
    return calculate_aligned_size(max(ends, default=0))


def by_specs(version: int, seq: int, specs: list[TensorSpec], buffer: int = 0) -> Bucket:
    return Bucket(version, seq, buffer, used([s.offset + s.nbytes for s in specs]), specs=specs)


def by_slots(version: int, seq: int, slots: list[Slot], buffer: int = 0) -> Bucket:
    return Bucket(version, seq, buffer, used([s.offset + s.nbytes for s in slots]), slots=slots)


MANIFEST = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,))]


def stream(
    engine: EngineSession,
    version: int,
    peer: str = PEER,
    *,
    manifest: list[TensorMeta] | None = None,
    names: Sequence[str] = ("a", "b"),
    now: float = 0.0,
) -> list[Action]:
    """Begin ``version`` and send each whole float32[4] of ``names`` in a bucket of its own."""
    actions = send(engine, Begin(version, manifest), peer, now)
    assert reply(actions, peer) == Ack(version, 0, True)
    for seq, name in enumerate(names, start=1):
        if manifest is None:
            bucket = by_specs(version, seq, [whole(name)], buffer=seq % 2)
        else:
            entry = [m.name for m in manifest].index(name)
            bucket = by_slots(version, seq, [Slot(entry, 0, 16)], buffer=seq % 2)
        step = send(engine, bucket, peer, now)
        assert reply(step, peer) == Ack(version, seq, True), step
        actions += step
    return actions


def finish(
    engine: EngineSession, version: int, buckets: int, tensors: int, peer: str = PEER
) -> list[Action]:
    """Complete and commit ``version`` after ``buckets`` buckets."""
    actions = send(engine, Complete(version, buckets + 1, buckets, tensors), peer)
    assert reply(actions, peer) == Ack(version, buckets + 1, True), actions
    return actions + send(engine, Commit(version, buckets + 2), peer)


def is_protocol_abort(actions: list[Action], peer: str, text: str) -> bool:
    messages = replies(actions, peer)
    return (
        len(messages) >= 1
        and isinstance(messages[0], Abort)
        and text in messages[0].reason
        and ClosePlane(peer) in actions
    )


# --------------------------------------------------------------------------------------
# hello and protocol negotiation
# --------------------------------------------------------------------------------------


def test_hello_opens_the_plane_and_replies_only_once_it_is_open() -> None:
    engine = machine()
    actions = engine.receive(PEER, hello(), 0.0)
    assert actions == [OpenPlane(PEER, plane())]
    assert engine.sessions[PEER].phase is Phase.OPENING
    assert engine.plane_opened(PEER) == [Reply(PEER, Ready(SESSION, PROTOCOL, None))]
    assert engine.sessions[PEER].phase is Phase.IDLE
    assert engine.sessions[PEER].sizes == [BUF, BUF]


@pytest.mark.parametrize("current", [None, 0, 7])
def test_ready_carries_the_committed_version(current: int | None) -> None:
    engine = machine(current=current)
    actions = send(engine, hello())
    assert reply(actions) == Ready(SESSION, PROTOCOL, current)


def test_hello_with_a_cuda_plane() -> None:
    engine = machine()
    cuda = CudaPlaneSpec(0, 8192, [b"h" * 64])
    opening = engine.receive(PEER, Hello(PROTOCOL, PROTOCOL, SESSION, "t", cuda), 0.0)
    assert opening == [OpenPlane(PEER, cuda)]
    engine.plane_opened(PEER)
    assert engine.sessions[PEER].sizes == [8192]


@pytest.mark.parametrize(
    "theirs", [(PROTOCOL, PROTOCOL), (2, PROTOCOL), (PROTOCOL, PROTOCOL + 4), (0, 100)]
)
def test_a_range_that_holds_the_one_protocol_gets_it(theirs: tuple[int, int]) -> None:
    engine = machine()
    ready = reply(send(engine, hello(low=theirs[0], high=theirs[1])))
    assert ready == Ready(SESSION, PROTOCOL, None)
    assert engine.protocol_errors == 0


@pytest.mark.parametrize(("low", "high"), [(PROTOCOL + 1, PROTOCOL + 3), (2, 4), (0, 1), (3, 1)])
def test_disjoint_protocol_ranges_abort_naming_both(low: int, high: int) -> None:
    engine = machine()
    actions = engine.receive(PEER, hello(low=low, high=high), 0.0)
    (abort,) = replies(actions)
    assert isinstance(abort, Abort)
    assert f"the sender speaks protocols {low}-{high}" in abort.reason
    assert f"this engine protocol {PROTOCOL}" in abort.reason
    assert not any(isinstance(a, OpenPlane) for a in actions)
    assert PEER not in engine.sessions
    assert engine.protocol_errors == 1


@pytest.mark.parametrize(
    "sizes",
    [(), (BUF,) * (Limits().max_buffers + 1), (BUF, 0), (-1,)],
    ids=["none", "many", "zero", "neg"],
)
def test_hello_with_no_buffers_too_many_or_empty_ones_is_refused(sizes: tuple[int, ...]) -> None:
    engine = machine()
    actions = engine.receive(PEER, hello(sizes=sizes), 0.0)
    (abort,) = replies(actions)
    assert isinstance(abort, Abort)
    assert f"{len(sizes)} buffers" in abort.reason
    assert not any(isinstance(a, OpenPlane) for a in actions)
    assert PEER not in engine.sessions


def test_hello_with_the_most_buffers_allowed() -> None:
    engine = machine()
    assert isinstance(reply(send(engine, hello(sizes=(512,) * Limits().max_buffers))), Ready)


def test_plane_that_fails_to_open_refuses_the_session() -> None:
    engine = machine()
    engine.receive(PEER, hello(), 0.0)
    actions = engine.plane_failed(PEER, "no such segment")
    assert actions == [Reply(PEER, Abort("session refused: no such segment")), ClosePlane(PEER)]
    assert PEER not in engine.sessions
    assert engine.protocol_errors == 1
    late = reply(send(engine, Begin(1)))
    assert isinstance(late, Abort)
    assert "begin before hello" in late.reason


def test_message_while_the_plane_opens_is_a_protocol_error() -> None:
    engine = machine()
    engine.receive(PEER, hello(), 0.0)
    actions = engine.receive(PEER, Begin(1), 0.0)
    assert is_protocol_abort(actions, PEER, "before the session was ready")
    assert PEER not in engine.sessions


@pytest.mark.parametrize(
    "message",
    [
        Begin(1),
        by_specs(1, 1, [whole("a")]),
        Complete(1, 1, 0, 0),
        Commit(1, 2),
        Goodbye(SESSION),
        Ready(SESSION, 2, None),
        Ack(1, 0, True),
    ],
    ids=lambda m: type(m).__name__,
)
def test_message_before_hello_is_answered_with_an_abort(message: Message) -> None:
    engine = machine()
    actions = engine.receive(PEER, message, 0.0)
    (abort,) = replies(actions)
    assert isinstance(abort, Abort)
    assert f"{type(message).__name__.lower()} before hello" in abort.reason
    assert PEER in abort.reason
    assert not any(isinstance(a, Apply | CommitSink | Discard) for a in actions)
    assert engine.protocol_errors == 1
    assert engine.sessions == {}


@pytest.mark.parametrize("message", [Abort("late"), Abort("late", 3), Ping(SESSION)])
def test_abort_or_ping_before_hello_is_ignored(message: Message) -> None:
    engine = machine()
    assert engine.receive(PEER, message, 0.0) == []
    assert engine.protocol_errors == 0


@pytest.mark.parametrize("message", [Ready(SESSION, 2, None), Ack(1, 0, True)])
def test_engine_side_message_from_a_sender_is_a_protocol_error(message: Message) -> None:
    engine = connected()
    actions = engine.receive(PEER, message, 0.0)
    assert is_protocol_abort(actions, PEER, f"unexpected {type(message).__name__}")
    assert PEER not in engine.sessions


def test_second_hello_in_mid_stream_replaces_the_session() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = engine.receive(PEER, hello("session-new"), 5.0)
    assert actions == [Discard(1), ClosePlane(PEER), OpenPlane(PEER, plane())]
    assert engine.failures == [SyncFailure(f"trainer@{PEER}", 1, "sender reconnected")]
    assert engine.owner is None
    assert reply(carry_out(engine, actions)) == Ready("session-new", PROTOCOL, None)


# --------------------------------------------------------------------------------------
# begin: accepted, refused, busy
# --------------------------------------------------------------------------------------


def test_begin_is_accepted_and_takes_the_sink() -> None:
    engine = connected(model())
    actions = send(engine, Begin(1, MANIFEST))
    assert actions == [Reply(PEER, Ack(1, 0, True))]
    assert engine.owner == PEER
    assert engine.sessions[PEER].phase is Phase.STREAMING
    assert engine.failures == []


@pytest.mark.parametrize("version", [5, 4, 0, -1])
def test_begin_of_a_version_not_newer_is_refused(version: int) -> None:
    engine = connected(current=5)
    ack = reply(send(engine, Begin(version)))
    assert isinstance(ack, Ack)
    assert (ack.version, ack.seq, ack.ok, ack.busy) == (version, 0, False, False)
    assert "not newer than current 5" in (ack.error or "")
    assert engine.owner is None
    assert [f.version for f in engine.failures] == [version]
    after = send(engine, by_specs(version, 1, [whole("a")]))
    assert applies(after) == []
    assert not ack_of(after).ok


BAD_MANIFESTS = {
    "unknown": ([*MANIFEST, TensorMeta("ghost", "float32", (4,))], "ghost", "no such parameter"),
    "missing": (MANIFEST[:1], "b", "misses 1 required tensors: b"),
    "shape": ([MANIFEST[0], TensorMeta("b", "float32", (5,))], "b", "float32[5]"),
    "dtype": ([MANIFEST[0], TensorMeta("b", "bfloat16", (4,))], "b", "bfloat16[4]"),
    "chunked into a strided target": (
        [*MANIFEST, TensorMeta("strided", "float32", (1024, 2), chunks=2)],
        "strided",
        "contiguous target",
    ),
}


@pytest.mark.parametrize("case", BAD_MANIFESTS, ids=list(BAD_MANIFESTS))
def test_manifest_that_does_not_fit_is_refused_before_any_apply(case: str) -> None:
    manifest, tensor, text = BAD_MANIFESTS[case]
    engine = connected(model(), current=1)
    ack = reply(send(engine, Begin(2, manifest)))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert not ack.busy
    assert ack.tensor == tensor
    assert text in (ack.error or "")
    assert engine.owner is None
    assert engine.servable  # in place, and nothing was written
    # the sender does not wait for the refusal: its buckets are refused, never applied
    later = send(engine, by_slots(2, 1, [Slot(0, 0, 16)]))
    later += send(engine, Complete(2, 2, 1, 1))
    later += send(engine, Commit(2, 3))
    assert not any(isinstance(a, Apply | CommitSink | Committed) for a in later)
    assert all(isinstance(m, Ack) and not m.ok for m in replies(later))
    assert len(engine.failures) == 1
    assert engine.failures[0].version == 2
    assert engine.current_version == 1
    assert engine.servable


@pytest.mark.parametrize(
    ("manifest", "text"),
    [
        ([TensorMeta("a", "float32", (-4,))], "negative dimension"),
        ([TensorMeta("a", "float32", (4,), chunks=0)], "chunk count"),
        ([TensorMeta("a", "float32", (4,)), TensorMeta("a", "float32", (4,))], "listed twice"),
        ([TensorMeta("a", "float4", (4,))], "unknown dtype"),
    ],
)
def test_malformed_manifest_is_refused(manifest: list[TensorMeta], text: str) -> None:
    engine = connected()  # accepts any tensor: only the manifest's own form is at fault
    ack = reply(send(engine, Begin(1, manifest)))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert text in (ack.error or "")
    assert engine.owner is None


def test_manifest_entry_with_an_unknown_dtype_is_named() -> None:
    engine = connected()
    manifest = [TensorMeta("a", "float32", (4,)), TensorMeta("layers.3.w", "float4", (4,))]
    ack = reply(send(engine, Begin(1, manifest)))
    assert isinstance(ack, Ack)
    assert ack.tensor == "layers.3.w"


def test_begin_accepted_by_an_engine_that_takes_anything() -> None:
    engine = connected(None)
    manifest = [TensorMeta("anything", "int8", (3, 5))]
    assert reply(send(engine, Begin(1, manifest))) == Ack(1, 0, True)


def test_second_begin_from_the_streaming_peer_is_a_protocol_error() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Begin(2))
    assert is_protocol_abort(actions, PEER, "begin of version 2 while version 1 is open")
    assert Discard(1) in actions
    assert engine.owner is None
    assert [f.version for f in engine.failures] == [1]


def test_begin_from_a_rival_while_one_streams_is_busy() -> None:
    engine = connected(model(), peers=(PEER, RIVAL))
    stream(engine, 1, manifest=MANIFEST, names=("a",))
    actions = send(engine, Begin(2, MANIFEST), RIVAL)
    ack = reply(actions, RIVAL)
    assert isinstance(ack, Ack)
    assert (ack.version, ack.seq, ack.ok, ack.busy) == (2, 0, False, True)
    assert f"trainer@{PEER} is streaming" in (ack.error or "")
    assert replies(actions, PEER) == []
    assert not any(isinstance(a, Discard) for a in actions)
    assert engine.failures == []  # busy is not a failure: a retry may succeed
    # the first stream goes on untouched and commits
    step = send(engine, by_slots(1, 2, [Slot(1, 0, 16)]))
    assert len(applies(step)) == 1
    finish(engine, 1, 2, 2)
    assert engine.current_version == 1
    # the rival may retry now
    assert reply(send(engine, Begin(2, MANIFEST), RIVAL), RIVAL) == Ack(2, 0, True)


REFUSALS = ["busy", "bad manifest", "not newer", "never begun"]


@pytest.mark.parametrize("refusal", REFUSALS)
def test_refused_streams_bucket_is_never_applied_even_after_another_stream_commits(
    refusal: str,
) -> None:
    """The bug issue 7 names: a refused stream's late bucket wrote into an in-place model."""
    engine = connected(model(), current=3, peers=(PEER, RIVAL))
    rival_version = 2 if refusal == "not newer" else 9
    if refusal == "not newer":
        stream(engine, 5, manifest=MANIFEST, names=())
        assert not ack_of(send(engine, Begin(rival_version, MANIFEST), RIVAL), RIVAL).ok
    elif refusal == "busy":
        stream(engine, 5, manifest=MANIFEST, names=())
        assert ack_of(send(engine, Begin(rival_version, MANIFEST), RIVAL), RIVAL).busy
    elif refusal == "bad manifest":
        assert not ack_of(send(engine, Begin(rival_version, MANIFEST[:1]), RIVAL), RIVAL).ok
        stream(engine, 5, manifest=MANIFEST, names=())
    else:  # the rival's begin was lost: its buckets come with no stream open
        stream(engine, 5, manifest=MANIFEST, names=())
    rival: list[Action] = send(engine, by_slots(rival_version, 1, [Slot(0, 0, 16)]), RIVAL)
    ours = send(engine, by_slots(5, 1, [Slot(0, 0, 16)]))
    ours += send(engine, by_slots(5, 2, [Slot(1, 0, 16)], buffer=1))
    ours += finish(engine, 5, 2, 2)
    assert engine.current_version == 5
    assert [a.peer for a in applies(ours)] == [PEER, PEER]
    # the rival's stream goes on sending as if accepted: none of it may reach the sink
    rival += send(engine, by_slots(rival_version, 2, [Slot(1, 0, 16)], buffer=1), RIVAL)
    rival += send(engine, Complete(rival_version, 3, 2, 2), RIVAL)
    rival += send(engine, Commit(rival_version, 4), RIVAL)
    assert not any(isinstance(a, Apply | CommitSink | Committed | Discard) for a in rival)
    assert all(isinstance(m, Ack) and not m.ok for m in replies(rival, RIVAL))
    assert engine.current_version == 5
    assert engine.servable
    assert engine.owner is None


# --------------------------------------------------------------------------------------
# buckets
# --------------------------------------------------------------------------------------


def test_bucket_by_manifest_slots_applies_the_manifest_entries() -> None:
    manifest = [
        TensorMeta("a", "float32", (4,)),
        TensorMeta("big", "uint8", (6000,), chunks=2),
        TensorMeta("b", "float32", (4,)),
    ]
    engine = connected(model(), current=0)
    assert reply(send(engine, Begin(1, manifest))) == Ack(1, 0, True)
    bucket = by_slots(1, 1, [Slot(2, 0, 16), Slot(0, 512, 16)], buffer=1)
    actions = engine.receive(PEER, bucket, 0.0)
    specs = [whole("b", 0), whole("a", 512)]
    assert actions == [Apply(PEER, 1, 1, 1, 1024, specs)]
    assert engine.current_version == 0  # nothing is visible before commit
    assert reply(engine.applied(PEER, 1, 0.0)) == Ack(1, 1, True)
    first = engine.receive(PEER, by_slots(1, 2, [Slot(1, 0, 4096, 0)]), 0.0)
    assert applies(first)[0].specs == [chunk("big", 0, 4096)]
    engine.applied(PEER, 2, 0.0)
    last = engine.receive(PEER, by_slots(1, 3, [Slot(1, 0, 1904, 4096)], buffer=1), 0.0)
    assert applies(last)[0].specs == [chunk("big", 4096, 1904)]
    engine.applied(PEER, 3, 0.0)
    stream_state = engine.sessions[PEER].stream
    assert stream_state is not None
    assert (stream_state.buckets, stream_state.tensors) == (3, 3)
    assert stream_state.done == {"a", "b", "big"}
    assert stream_state.partial == {}
    finish(engine, 1, 3, 3)
    assert engine.current_version == 1


def test_bucket_by_specs_applies_the_named_tensors() -> None:
    engine = connected(model())
    send(engine, Begin(1))
    specs = [whole("a", 0), whole("b", 512)]
    actions = engine.receive(PEER, by_specs(1, 1, specs), 0.0)
    assert actions == [Apply(PEER, 1, 1, 0, 1024, specs)]


def test_in_place_apply_makes_the_engine_unservable_until_commit() -> None:
    engine = connected(model())
    stream(engine, 1, names=("a",))
    assert not engine.servable
    send(engine, by_specs(1, 2, [whole("b")]))
    assert not engine.servable
    finish(engine, 1, 2, 2)
    assert engine.servable
    assert engine.current_version == 1


def test_staged_apply_keeps_the_engine_servable() -> None:
    engine = connected(model(), staged=True)
    stream(engine, 1)
    assert engine.servable


def test_zero_byte_tensors_count() -> None:
    engine = connected()
    send(engine, Begin(1))
    empty = TensorSpec("e", "float32", (0, 3), 0, 0)
    assert len(applies(send(engine, by_specs(1, 1, [empty, whole("a", 0)])))) == 1
    finish(engine, 1, 1, 2)
    assert engine.current_version == 1


def test_a_bucket_with_no_tensors_is_a_protocol_error_that_applies_nothing() -> None:
    engine = connected()
    send(engine, Begin(1))
    actions = send(engine, Bucket(1, 1, 0, 0))
    assert is_protocol_abort(actions, PEER, "bucket of 0 tensors")
    assert applies(actions) == []
    assert engine.owner is None
    assert engine.servable


@pytest.mark.parametrize(("current", "version"), [(None, 0), (None, 9), (1, 10)])
def test_versions_may_start_at_zero_and_skip_ahead(current: int | None, version: int) -> None:
    engine = connected(current=current)
    stream(engine, version, names=("a",))
    finish(engine, version, 1, 1)
    assert engine.current_version == version


def test_bucket_may_fill_its_whole_buffer() -> None:
    engine = connected()
    send(engine, Begin(1))
    full = TensorSpec("full", "uint8", (BUF,), 0, BUF)
    assert applies(send(engine, Bucket(1, 1, 1, BUF, specs=[full])))[0].specs == [full]


def test_bucket_with_an_unknown_dtype_is_refused_naming_the_tensor() -> None:
    engine = connected()  # takes any tensor: the layout check still runs
    send(engine, Begin(1))
    actions = send(engine, Bucket(1, 1, 0, 512, specs=[TensorSpec("x", "float4", (4,), 0, 2)]))
    assert applies(actions) == []
    ack = reply(actions)
    assert isinstance(ack, Ack)
    assert "unknown dtype 'float4'" in (ack.error or "")
    assert ack.tensor == "x"


BAD_BUCKETS: dict[str, tuple[Begin, Bucket, str, str | None]] = {
    "slots without a manifest": (Begin(1), by_slots(1, 1, [Slot(0, 0, 16)]), "manifest", None),
    "specs with a manifest": (
        Begin(1, MANIFEST),
        by_specs(1, 1, [whole("a")]),
        "repeats names",
        None,
    ),
    "no such manifest entry": (
        Begin(1, MANIFEST),
        by_slots(1, 1, [Slot(2, 0, 16)]),
        "no manifest entry 2",
        None,
    ),
    "unknown tensor": (Begin(1), by_specs(1, 1, [whole("ghost")]), "no such parameter", "ghost"),
    "wrong shape": (Begin(1), by_specs(1, 1, [whole("a", n=5)]), "float32[5]", "a"),
    "no such buffer": (Begin(1), by_specs(1, 1, [whole("a")], buffer=2), "no buffer 2", None),
    "bigger than its buffer": (
        Begin(1),
        Bucket(1, 1, 0, BUF + 512, specs=[whole("a")]),
        "claims",
        None,
    ),
    "overlapping": (
        Begin(1),
        Bucket(1, 1, 0, 1024, specs=[whole("a", 512), whole("b", 0)]),
        "overlapping",
        "b",
    ),
    "misaligned": (Begin(1), Bucket(1, 1, 0, 1024, specs=[whole("a", 100)]), "misaligned", "a"),
    "past used bytes": (Begin(1), Bucket(1, 1, 0, 8, specs=[whole("a")]), "run past", "a"),
    "twice in one bucket": (
        Begin(1),
        by_specs(1, 1, [whole("a", 0), whole("a", 512)]),
        "sent twice",
        "a",
    ),
    "chunk not from byte 0": (
        Begin(1),
        by_specs(1, 1, [chunk("big", 1024, 1024)]),
        "expected 0",
        "big",
    ),
    "chunk into a strided target": (
        Begin(1),
        by_specs(1, 1, [TensorSpec("strided", "float32", (1024, 2), 0, 4096)]),
        "contiguous target",
        "strided",
    ),
    "chunks other than the manifest's": (
        Begin(1, [TensorMeta("a", "float32", (4,), chunks=2)]),
        by_slots(1, 1, [Slot(0, 0, 16)]),
        "sent in 1 pieces, manifest said 2",
        "a",
    ),
}


@pytest.mark.parametrize("case", BAD_BUCKETS, ids=list(BAD_BUCKETS))
def test_bad_bucket_is_refused_before_it_is_applied(case: str) -> None:
    begin, bucket, text, tensor = BAD_BUCKETS[case]
    engine = connected(model(required=()), current=0)
    assert ack_of(send(engine, begin)).ok
    actions = send(engine, bucket)
    assert applies(actions) == []
    ack = reply(actions)
    assert isinstance(ack, Ack)
    assert (ack.version, ack.seq, ack.ok) == (1, 1, False)
    assert text in (ack.error or ""), ack.error
    if tensor is not None:
        assert ack.tensor == tensor
    assert Discard(1) in actions
    assert engine.owner is None
    assert len(engine.failures) == 1
    assert engine.servable  # nothing was written
    # the stream is over: whatever else it sends is refused, never applied
    later = send(engine, by_specs(1, 2, [whole("b")]))
    assert applies(later) == []
    assert reply(later) == Ack(1, 2, False, error="stream already failed")
    assert len(engine.failures) == 1


CHUNK_ERRORS = {
    "skipped": ([chunk("big", 0, 1024)], [chunk("big", 2048, 1024)], "expected 1024"),
    "repeated": ([chunk("big", 0, 1024)], [chunk("big", 0, 1024)], "expected 1024"),
    "whole while partial": (
        [chunk("big", 0, 1024)],
        [TensorSpec("big", "uint8", (6000,), 0, 6000)],
        "expected 1024",
    ),
    "other shape": ([chunk("big", 0, 1024)], [chunk("big", 1024, 1024, total=7000)], "disagree"),
    "after it was whole": ([whole("a")], [whole("a")], "sent twice"),
}


@pytest.mark.parametrize("case", CHUNK_ERRORS)
def test_chunk_order_and_duplicates_are_refused(case: str) -> None:
    first, second, text = CHUNK_ERRORS[case]
    engine = connected(sizes=(8192, 8192))
    send(engine, Begin(1))
    assert len(applies(send(engine, by_specs(1, 1, first)))) == 1
    actions = send(engine, by_specs(1, 2, second))
    assert applies(actions) == []
    ack = reply(actions)
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert text in (ack.error or ""), ack.error
    assert ack.tensor == second[0].name


def test_chunked_tensor_sent_again_after_its_last_chunk_is_refused() -> None:
    engine = connected()
    send(engine, Begin(1))
    send(engine, by_specs(1, 1, [chunk("big", 0, 4096)]))
    send(engine, by_specs(1, 2, [chunk("big", 4096, 1904)]))
    actions = send(engine, by_specs(1, 3, [chunk("big", 0, 4096)]))
    assert applies(actions) == []
    assert "sent twice" in (ack_of(actions).error or "")


def test_chunks_interleaved_with_other_tensors_are_fine() -> None:
    engine = connected(model())
    send(engine, Begin(1))
    send(engine, by_specs(1, 1, [chunk("big", 0, 4096)]))
    send(engine, by_specs(1, 2, [whole("a"), TensorSpec("b", "float32", (4,), 512, 16)]))
    send(engine, by_specs(1, 3, [chunk("big", 4096, 1904)]))
    finish(engine, 1, 3, 3)
    assert engine.current_version == 1


@pytest.mark.parametrize("seq", [0, 2, 5, -1])
def test_bucket_out_of_sequence_ends_the_session(seq: int) -> None:
    engine = connected()
    send(engine, Begin(1))
    actions = send(engine, by_specs(1, seq, [whole("a")]))
    assert applies(actions) == []
    assert is_protocol_abort(actions, PEER, f"bucket seq {seq} out of order (expected 1)")
    assert Discard(1) in actions
    assert PEER not in engine.sessions
    assert engine.owner is None


def test_duplicated_bucket_ends_the_session_before_a_second_apply() -> None:
    engine = connected()
    send(engine, Begin(1))
    bucket = by_specs(1, 1, [whole("a")])
    assert len(applies(send(engine, bucket))) == 1
    actions = send(engine, bucket)
    assert applies(actions) == []
    assert is_protocol_abort(actions, PEER, "out of order")


def test_bucket_of_another_version_is_refused_and_the_stream_goes_on() -> None:
    engine = connected()
    stream(engine, 2, names=("a",))
    actions = send(engine, by_specs(3, 2, [whole("b")]))
    assert actions == [Reply(PEER, Ack(3, 2, False, error="no open stream for version 3"))]
    assert engine.owner == PEER
    assert len(applies(send(engine, by_specs(2, 2, [whole("b")])))) == 1


@pytest.mark.parametrize("staged", [False, True])
def test_apply_failed_discards_refuses_and_records_once(staged: bool) -> None:
    engine = connected(model(), staged=staged, current=0)
    stream(engine, 1, names=("a",))
    boom = MismatchError("sink could not copy", tensor="b")
    actions = send(engine, by_specs(1, 2, [whole("b")]), apply_error=boom)
    assert [type(a) for a in actions] == [Apply, Discard, Reply]
    assert actions[1] == Discard(1)
    assert reply(actions) == Ack(1, 2, False, error="sink could not copy", tensor="b")
    assert engine.failures == [SyncFailure(f"trainer@{PEER}", 1, "sink could not copy")]
    assert engine.owner is None
    assert engine.servable is staged  # in place: part of version 1 is in the weights
    assert engine.protocol_errors == 0
    # later messages of the stream and its abort add nothing
    later = send(engine, by_specs(1, 3, [whole("c")]))
    later += send(engine, Complete(1, 4, 3, 3))
    later += send(engine, Abort("sink failed", 1))
    assert not any(isinstance(a, Apply | Discard | CommitSink) for a in later)
    assert len(engine.failures) == 1
    assert engine.current_version == 0


def test_applied_or_apply_failed_after_the_session_ended_is_ignored() -> None:
    engine = connected()
    send(engine, Begin(1))
    engine.receive(PEER, by_specs(1, 1, [whole("a")]), 0.0)
    engine.receive(PEER, Goodbye(f"session-{PEER}"), 0.0)
    assert engine.applied(PEER, 1, 0.0) == []
    assert engine.apply_failed(PEER, 1, AiosyncError("late")) == []
    assert len(engine.failures) == 1


# --------------------------------------------------------------------------------------
# complete
# --------------------------------------------------------------------------------------


def test_complete_prepares_without_committing() -> None:
    engine = connected(model(), current=0)
    stream(engine, 1)
    actions = send(engine, Complete(1, 3, 2, 2))
    assert actions == [Reply(PEER, Ack(1, 3, True))]
    assert engine.sessions[PEER].phase is Phase.PREPARED
    assert engine.current_version == 0
    assert engine.owner == PEER


def test_complete_missing_required_tensors_is_refused_without_a_manifest() -> None:
    engine = connected(model(required=("a", "b", "big")), current=0)
    stream(engine, 1, names=("a",))
    actions = send(engine, Complete(1, 2, 1, 1))
    ack = reply(actions)
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "misses 2 required tensors: b, big" in (ack.error or "")
    assert ack.tensor == "b"
    assert Discard(1) in actions
    commit = send(engine, Commit(1, 3))
    assert not any(isinstance(a, CommitSink) for a in actions + commit)
    assert engine.current_version == 0
    assert len(engine.failures) == 1


def test_alias_covers_the_tensor_it_is_tied_to() -> None:
    tied = Expectations(
        {"embed": Expected("float32", (4,)), "head": Expected("float32", (4,))},
        frozenset({"embed", "head"}),
        {"head": "embed"},
    )
    for sent in ("embed", "head"):
        engine = connected(tied)
        stream(engine, 1, names=(sent,))
        finish(engine, 1, 1, 1)
        assert engine.current_version == 1, sent
        manifest = [TensorMeta(sent, "float32", (4,))]
        engine = connected(tied)
        assert reply(send(engine, Begin(1, manifest))) == Ack(1, 0, True)


@pytest.mark.parametrize(("buckets", "tensors"), [(1, 2), (3, 2), (2, 3), (0, 0)])
def test_complete_with_counts_the_engine_did_not_see_is_refused(buckets: int, tensors: int) -> None:
    engine = connected()
    stream(engine, 1)
    ack = reply(send(engine, Complete(1, 3, buckets, tensors)))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert f"sender counted {buckets} buckets / {tensors} tensors" in (ack.error or "")
    assert "engine applied 2 / 2" in (ack.error or "")


def test_complete_with_a_chunked_tensor_unfinished_is_refused() -> None:
    engine = connected()
    send(engine, Begin(1))
    send(engine, by_specs(1, 1, [chunk("big", 0, 4096)]))
    ack = reply(send(engine, Complete(1, 2, 1, 0)))
    assert isinstance(ack, Ack)
    assert (ack.ok, ack.tensor) == (False, "big")
    assert "incomplete" in (ack.error or "")


def test_complete_with_manifest_tensors_unsent_is_refused() -> None:
    engine = connected()  # requires nothing: only the manifest's own promise is broken
    stream(engine, 1, manifest=MANIFEST, names=("a",))
    ack = reply(send(engine, Complete(1, 2, 1, 1)))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "1 manifest tensors unsent" in (ack.error or "")


@pytest.mark.parametrize("seq", [1, 3, 0])
def test_complete_out_of_sequence_ends_the_session(seq: int) -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Complete(1, seq, 1, 1))
    assert is_protocol_abort(actions, PEER, f"complete seq {seq} out of order")
    assert Discard(1) in actions


def test_complete_of_a_version_not_open_is_refused() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Complete(2, 2, 1, 1))
    assert actions == [Reply(PEER, Ack(2, 2, False, error="no open stream for version 2"))]
    assert engine.owner == PEER


def test_complete_twice_ends_the_session() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    send(engine, Complete(1, 2, 1, 1))
    actions = send(engine, Complete(1, 3, 1, 1))
    assert is_protocol_abort(actions, PEER, "out of order")
    assert engine.current_version is None


def test_an_empty_version_commits_only_when_begun_as_empty() -> None:
    engine = connected()
    stream(engine, 1, manifest=[], names=())
    ack = reply(send(engine, Complete(1, 1, 0, 0)))
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "no tensors" in (ack.error or "")
    assert engine.current_version is None
    assert reply(send(engine, Begin(2, [], empty=True))) == Ack(2, 0, True)
    finish(engine, 2, 0, 0)
    assert engine.current_version == 2


# --------------------------------------------------------------------------------------
# commit
# --------------------------------------------------------------------------------------


def test_commit_before_complete_ends_the_session() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Commit(1, 2))
    assert is_protocol_abort(actions, PEER, "commit of version 1 not prepared")
    assert not any(isinstance(a, CommitSink) for a in actions)
    assert Discard(1) in actions
    assert engine.current_version is None


def test_commit_with_the_wrong_seq_ends_the_session() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    send(engine, Complete(1, 2, 1, 1))
    actions = send(engine, Commit(1, 4))
    assert is_protocol_abort(actions, PEER, "not prepared")
    assert engine.current_version is None


def test_commit_of_a_version_not_open_is_refused() -> None:
    engine = connected()
    assert send(engine, Commit(1, 2)) == [
        Reply(PEER, Ack(1, 2, False, error="no open stream for version 1"))
    ]


def test_commit_asks_the_sink_then_moves_the_version() -> None:
    engine = connected(model(), current=4)
    stream(engine, 5)
    send(engine, Complete(5, 3, 2, 2))
    actions = engine.receive(PEER, Commit(5, 4), 1.0)
    assert actions == [CommitSink(PEER, 5)]
    assert engine.sessions[PEER].phase is Phase.COMMITTING
    assert engine.current_version == 4  # not before the sink says so
    assert not engine.servable
    done = engine.commit_done(PEER, 5, 2.0)
    assert done == [Reply(PEER, Ack(5, 4, True)), Committed(5)]
    assert engine.current_version == 5
    assert engine.servable
    assert engine.owner is None
    assert engine.sessions[PEER].phase is Phase.IDLE
    assert engine.sessions[PEER].stream is None
    assert engine.failures == []
    # the next version may begin; an old one may not
    assert not ack_of(send(engine, Begin(5))).ok
    assert ack_of(send(engine, Begin(6))).ok


@pytest.mark.parametrize("staged", [False, True])
def test_commit_failed_leaves_the_version_and_marks_not_servable(staged: bool) -> None:
    engine = connected(model(), staged=staged, current=4)
    stream(engine, 5)
    send(engine, Complete(5, 3, 2, 2))
    error = AiosyncError("engine failed to commit: disk full", version=5)
    actions = send(engine, Commit(5, 4), commit_error=error)
    assert actions == [
        CommitSink(PEER, 5),
        Discard(5),
        Reply(PEER, Ack(5, 4, False, error="engine failed to commit: disk full")),
    ]
    assert engine.current_version == 4
    assert not engine.servable
    assert engine.owner is None
    assert [f.version for f in engine.failures] == [5]
    # a later version that commits makes the engine servable again
    stream(engine, 6)
    finish(engine, 6, 2, 2)
    assert engine.servable
    assert engine.current_version == 6


def test_commit_done_after_the_session_ended_still_commits() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    send(engine, Complete(1, 2, 1, 1))
    engine.receive(PEER, Commit(1, 3), 0.0)
    engine.sessions.pop(PEER)
    assert engine.commit_done(PEER, 1, 0.0) == [Committed(1)]
    assert engine.current_version == 1
    assert engine.owner is None


# --------------------------------------------------------------------------------------
# abort, goodbye, undecodable frames, close
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, None])
def test_abort_mid_stream_discards_and_records(version: int | None) -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Abort("trainer gave up", version))
    assert actions == [Discard(1)]
    assert engine.failures == [SyncFailure(f"trainer@{PEER}", 1, "sender aborted: trainer gave up")]
    assert engine.owner is None
    assert engine.sessions[PEER].phase is Phase.IDLE
    # the same version may be streamed again from scratch
    stream(engine, 1)
    finish(engine, 1, 2, 2)
    assert engine.current_version == 1


def test_a_withdrawn_begin_is_dropped_unrecorded_and_may_begin_again() -> None:
    engine = connected()
    stream(engine, 1, names=())  # the begin alone
    assert send(engine, Abort("manifest changed", 1, withdrawn=True)) == [Discard(1)]
    assert engine.failures == []
    assert engine.withdrawn == 1  # counted, though not a failure
    assert engine.owner is None
    stream(engine, 1)
    finish(engine, 1, 2, 2)
    assert engine.current_version == 1


def test_withdrawn_after_a_bucket_is_an_abort_like_any_other() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))  # a bucket came: the sender cannot take it back quietly
    assert send(engine, Abort("manifest changed", 1, withdrawn=True)) == [Discard(1)]
    assert [f.version for f in engine.failures] == [1]
    assert engine.withdrawn == 0


def test_abort_of_a_prepared_version_discards_it() -> None:
    engine = connected(staged=True)
    stream(engine, 1, names=("a",))
    send(engine, Complete(1, 2, 1, 1))
    assert send(engine, Abort("another engine failed", 1)) == [Discard(1)]
    assert send(engine, Commit(1, 3)) == [
        Reply(PEER, Ack(1, 3, False, error="stream already failed"))
    ]
    assert engine.current_version is None


def test_abort_of_another_version_or_while_idle_is_ignored() -> None:
    engine = connected()
    assert send(engine, Abort("nothing open", 1)) == []
    stream(engine, 2, names=("a",))
    assert send(engine, Abort("stale", 1)) == []
    assert engine.owner == PEER
    assert engine.failures == []


def test_goodbye_mid_stream_acks_discards_and_records() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    actions = send(engine, Goodbye(f"session-{PEER}"))
    # the plane is released before the ack, so a sender that exits at once finds it free
    assert actions == [Discard(1), ClosePlane(PEER), Reply(PEER, Ack(None, GOODBYE_SEQ, True))]
    assert [f.reason for f in engine.failures] == ["sender said goodbye in mid-stream"]
    assert PEER not in engine.sessions
    assert engine.owner is None


def test_goodbye_while_idle_closes_quietly() -> None:
    engine = connected()
    actions = send(engine, Goodbye(f"session-{PEER}"))
    assert actions == [ClosePlane(PEER), Reply(PEER, Ack(None, GOODBYE_SEQ, True))]
    assert engine.failures == []
    assert engine.sessions == {}


def test_goodbye_for_another_session_is_a_protocol_error() -> None:
    engine = connected()
    actions = send(engine, Goodbye("nope"))
    assert is_protocol_abort(actions, PEER, "goodbye for unknown session 'nope'")


def test_undecodable_frame_ends_the_session() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    with pytest.raises(ProtocolError) as info:
        decode(b"\xc1garbage")
    actions = engine.undecodable(PEER, info.value)
    assert is_protocol_abort(actions, PEER, "undecodable message")
    assert Discard(1) in actions
    assert engine.protocol_errors == 1
    assert [f.version for f in engine.failures] == [1]
    assert PEER not in engine.sessions


def test_undecodable_frame_from_a_stranger_is_answered() -> None:
    engine = machine()
    actions = engine.undecodable(PEER, ProtocolError("undecodable message (3 bytes)"))
    assert actions == [Reply(PEER, Abort(f"undecodable message (3 bytes) [peer {PEER}]"))]


def test_close_ends_every_session() -> None:
    engine = connected(peers=(PEER, RIVAL))
    stream(engine, 1, names=("a",))
    actions = engine.close()
    assert actions == [Discard(1), ClosePlane(PEER), ClosePlane(RIVAL)]
    assert engine.sessions == {}
    assert [f.reason for f in engine.failures] == ["engine closing"]


# --------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------


def test_silent_stream_expires_after_the_stream_timeout() -> None:
    engine = connected()
    send(engine, Begin(1), now=1.0)
    send(engine, by_specs(1, 1, [whole("a")]), now=3.0)  # applied at 3: progress
    assert engine.next_deadline() == 3.0 + STREAM_TIMEOUT
    send(engine, Ping(f"session-{PEER}"), now=12.0)  # a ping is not progress
    assert engine.expire(12.9) == []
    actions = engine.expire(13.0)
    assert actions == [Discard(1), ClosePlane(PEER)]
    (failure,) = engine.failures
    assert failure.version == 1
    assert "no progress for 10.0s in mid-stream" in failure.reason
    assert engine.sessions == {}
    assert engine.owner is None


def test_prepared_stream_waiting_for_commit_expires_too() -> None:
    engine = connected(staged=True)
    stream(engine, 1, names=("a",), now=0.0)
    send(engine, Complete(1, 2, 1, 1), now=2.0)
    assert engine.expire(2.0 + STREAM_TIMEOUT) == [Discard(1), ClosePlane(PEER)]


def test_idle_session_expires_after_the_session_timeout_and_pings_keep_it() -> None:
    engine = connected()
    assert engine.next_deadline() == SESSION_TIMEOUT
    send(engine, Ping(f"session-{PEER}"), now=50.0)
    assert engine.expire(SESSION_TIMEOUT + 1) == []
    assert engine.next_deadline() == 50.0 + SESSION_TIMEOUT
    assert engine.expire(50.0 + SESSION_TIMEOUT) == [ClosePlane(PEER)]
    assert engine.failures == []
    assert engine.next_deadline() is None


def test_committing_session_never_expires() -> None:
    engine = connected()
    stream(engine, 1, names=("a",))
    send(engine, Complete(1, 2, 1, 1))
    engine.receive(PEER, Commit(1, 3), 0.0)
    assert engine.next_deadline() is None
    assert engine.expire(1e9) == []
    assert engine.commit_done(PEER, 1, 1e9)[-1] == Committed(1)


def test_expire_ends_only_the_silent_session() -> None:
    engine = connected(peers=(PEER, RIVAL))
    stream(engine, 1, names=("a",), now=0.0)
    send(engine, Ping(f"session-{RIVAL}"), RIVAL, now=5.0)
    actions = engine.expire(STREAM_TIMEOUT)
    assert actions == [Discard(1), ClosePlane(PEER)]
    assert list(engine.sessions) == [RIVAL]
    assert reply(send(engine, Begin(2), RIVAL, now=6.0), RIVAL) == Ack(2, 0, True)


def test_expired_stream_then_late_bucket_is_answered_with_an_abort() -> None:
    engine = connected()
    send(engine, Begin(1))
    engine.expire(STREAM_TIMEOUT)
    actions = send(engine, by_specs(1, 1, [whole("a")]), now=STREAM_TIMEOUT)
    assert applies(actions) == []
    abort = reply(actions)
    assert isinstance(abort, Abort)
    assert "bucket before hello" in abort.reason


# --------------------------------------------------------------------------------------
# the last whole stream, replayed
# --------------------------------------------------------------------------------------


def test_a_whole_stream_is_remembered_and_an_equal_one_replays_it() -> None:
    engine = connected(model(), current=0)
    first = stream(engine, 1, manifest=list(MANIFEST))
    finish(engine, 1, 2, 2)
    memory = engine.memory
    assert memory is not None
    assert memory.manifest == MANIFEST
    second = stream(engine, 2, manifest=list(MANIFEST))
    replayed = engine.sessions[PEER].stream
    assert replayed is not None
    assert replayed.manifest is memory.manifest  # not checked again
    assert [a.specs for a in applies(second)] == [a.specs for a in applies(first)]
    assert all(a.specs is r.specs for a, r in zip(applies(second), memory.records, strict=True))
    finish(engine, 2, 2, 2)
    assert engine.memory is memory
    assert engine.current_version == 2


def test_a_stream_that_fails_is_not_remembered() -> None:
    engine = connected(model(), current=0)
    stream(engine, 1, manifest=list(MANIFEST))
    finish(engine, 1, 2, 2)
    memory = engine.memory
    stream(engine, 2, manifest=list(MANIFEST), names=("b", "a"))  # other buckets
    ack = reply(send(engine, Complete(2, 3, 2, 1)))  # miscounted
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert engine.memory is memory
    stream(engine, 3, manifest=list(MANIFEST), names=("b", "a"))
    finish(engine, 3, 2, 2)
    assert engine.memory is not memory  # the new order is the one to replay now


def test_a_remembered_manifest_still_meets_the_version_checks() -> None:
    engine = connected(model(), current=0)
    stream(engine, 1, manifest=list(MANIFEST))
    finish(engine, 1, 2, 2)
    ack = reply(send(engine, Begin(1, list(MANIFEST))))  # not newer
    assert isinstance(ack, Ack)
    assert not ack.ok
    assert "not newer" in (ack.error or "")
    bigger = [*MANIFEST, TensorMeta("c", "float32", (4,))]
    ack = reply(send(engine, Begin(2, bigger)))
    assert isinstance(ack, Ack)
    assert ack.tensor == "c"


def test_a_begin_carrying_bucket_1_is_taken_as_the_two_messages_in_a_row() -> None:
    """Protocol 3's ``Begin.first``: the same actions as the begin, then the bucket."""
    apart, together = connected(model()), connected(model())
    bucket = by_slots(0, 1, [Slot(0, 0, 16)])
    two = send(apart, Begin(0, MANIFEST)) + send(apart, bucket)
    one = send(together, Begin(0, MANIFEST, first=bucket))
    assert one == two
    assert replies(one) == [Ack(0, 0, True), Ack(0, 1, True)]
    assert len(applies(one)) == 1


def test_a_refused_begin_refuses_the_bucket_it_carries_and_applies_nothing() -> None:
    engine = connected(model(), current=5)
    first = by_slots(3, 1, [Slot(0, 0, 16)])
    actions = send(engine, Begin(3, MANIFEST, first=first))  # behind the engine: refused
    acks = [m for m in replies(actions) if isinstance(m, Ack)]
    assert [(a.seq, a.ok) for a in acks] == [(0, False), (1, False)]
    assert not applies(actions)


def test_a_begin_carrying_a_bucket_before_hello_is_one_protocol_error() -> None:
    engine = machine(model())
    actions = send(engine, Begin(0, MANIFEST, first=by_slots(0, 1, [Slot(0, 0, 16)])))
    assert not applies(actions)
    assert [type(m) for m in replies(actions)] == [Abort]  # the bucket inside is not taken
    assert "begin before hello" in replies(actions)[0].reason
    assert engine.protocol_errors == 1
    assert PEER not in engine.sessions


def test_a_begin_carrying_a_bucket_while_a_version_is_open_is_one_protocol_error() -> None:
    engine = connected(model())
    stream(engine, 0, manifest=MANIFEST)  # version 0 open
    actions = send(engine, Begin(1, MANIFEST, first=by_slots(1, 1, [Slot(0, 0, 16)])))
    aborts = [m for m in replies(actions) if isinstance(m, Abort)]
    assert len(aborts) == 1  # the bucket inside is not taken as a second message
    assert "while version 0 is open" in aborts[0].reason
    assert engine.protocol_errors == 1
    assert not applies(actions)


def test_a_bucket_sent_ahead_of_its_packing_is_applied_with_its_value() -> None:
    engine = connected(model())
    send(engine, Begin(0, MANIFEST))
    ahead = msgspec.structs.replace(by_slots(0, 1, [Slot(0, 0, 16)]), after=3)
    (apply,) = applies(engine.receive(PEER, ahead, 0.0))
    assert apply.after == 3
    (plain,) = applies(engine.receive(PEER, by_slots(0, 2, [Slot(1, 0, 16)], buffer=1), 0.0))
    assert plain.after is None
