"""The sender's and the engines' session machines driven against each other.

The sender side is a small pure driver, :class:`Sender`, built from the trainer's machines
(a :class:`LinkSession` per engine, a :class:`FleetVote` over them, a :class:`BufferLedger`
over the ring of buffers) and the wire messages, in the shape of the pipeline's stream:
Begin to every engine, buckets through the ring, Complete, then Commit to the engines the
vote allows, or Abort. Each engine is an :class:`EngineSession` whose IO is carried out
synchronously by :class:`Fleet` (an ``Apply`` is applied or fails, a ``CommitSink``
commits or fails). Hypothesis picks the interleaving of deliveries, drops, duplicates and
garbled frames, sink failures, engine expiry and sender timeouts; the invariants are
checked after every step and at the end, and a run without faults must commit.

The first section holds plain unit tests of the sender's machines.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from aiosync.core.engine_actions import (
    Action,
    Apply,
    ClosePlane,
    CommitSink,
    Committed,
    Discard,
    OpenPlane,
    Reply,
)
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import (
    AiosyncError,
    BusyError,
    MismatchError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.core.layout import BucketPlan, plan_buckets
from aiosync.core.manifest import Expectations, TensorMeta, build_manifest, expectations_of
from aiosync.core.trainer_session import FleetVote, LinkSession, Policy, Verdict
from aiosync.core.wire import (
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    Message,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    Slot,
    decode,
    encode,
)
from aiosync.pipeline.ledger import BufferLedger

CAPACITY = 1024
BUFFERS = 2
PLANE = ShmPlaneSpec([ShmHandle(f"aiosync-prop-{i}", CAPACITY) for i in range(BUFFERS)])
STREAM_TIMEOUT = 10.0
SESSION_TIMEOUT = 30.0
MAX_STEPS = 2_000

# --------------------------------------------------------------------------------------
# the sender's machines, one rule at a time
# --------------------------------------------------------------------------------------


def link(remote: int | None = None) -> LinkSession:
    session = LinkSession("engine-0", "session-0")
    session.ready(Ready("session-0", PROTOCOL, remote))
    return session


def test_link_hello_states_the_range_and_session() -> None:
    hello = LinkSession("engine-0", "session-0").hello("trainer", PLANE)
    assert (hello.protocol_min, hello.protocol_max) == (PROTOCOL, PROTOCOL)
    assert (hello.session, hello.sender, hello.plane) == ("session-0", "trainer", PLANE)


@pytest.mark.parametrize("remote", [None, 0, 12])
def test_link_ready_records_the_engines_version(remote: int | None) -> None:
    session = link(remote)
    assert session.remote_version == remote
    assert session.protocol == PROTOCOL


def test_link_ready_for_another_session_is_refused() -> None:
    session = LinkSession("engine-0", "session-0")
    with pytest.raises(ProtocolError, match="'other'") as info:
        session.ready(Ready("other", PROTOCOL, 3))
    assert info.value.peer == "engine-0"
    assert session.protocol is None
    assert session.remote_version is None


@pytest.mark.parametrize("protocol", [PROTOCOL - 1, PROTOCOL + 1])
def test_link_ready_with_another_protocol_names_both(protocol: int) -> None:
    session = LinkSession("engine-0", "session-0")
    with pytest.raises(ProtocolError) as info:
        session.ready(Ready("session-0", protocol, None))
    assert f"protocol {protocol}" in str(info.value)
    assert f"this sender speaks protocol {PROTOCOL} " in str(info.value)


def test_link_begin_before_ready_is_refused() -> None:
    with pytest.raises(ProtocolError, match="before the session is ready"):
        LinkSession("engine-0", "session-0").begin(1)


@pytest.mark.parametrize("version", [5, 4, -1])
def test_link_begin_of_a_version_not_newer_is_refused(version: int) -> None:
    session = link(5)
    with pytest.raises(RejectedError, match="not newer") as info:  # not a broken session
        session.begin(version)
    assert info.value.version == version
    assert session.version is None


def test_link_acks_match_in_order() -> None:
    session = link()
    session.begin(1)
    for seq in range(3):
        session.sent(seq)
    assert session.in_flight == 3
    assert session.ack(Ack(1, 0, True)) == Ack(1, 0, True)
    refusal = Ack(1, 1, False, "bad shape", "w")
    assert session.ack(refusal) == refusal  # a refusal is matched like any ack
    assert session.in_flight == 1


@pytest.mark.parametrize("seq", [1, 0, 7])
def test_link_ack_out_of_order_is_a_protocol_error(seq: int) -> None:
    session = link()
    session.begin(1)
    session.sent(0)
    session.ack(Ack(1, 0, True))
    session.sent(1)
    session.sent(2)
    if seq == 1:
        session.ack(Ack(1, 1, True))
        seq = 1  # repeated
    with pytest.raises(ProtocolError, match=f"ack {seq} out of order") as info:
        session.ack(Ack(1, seq, True))
    assert info.value.version == 1


def test_link_ack_with_nothing_outstanding_is_a_protocol_error() -> None:
    session = link()
    session.begin(1)
    with pytest.raises(ProtocolError, match=r"expected None"):
        session.ack(Ack(1, 0, True))


def test_link_leftover_acks_of_a_failed_stream_are_skipped() -> None:
    session = link(3)
    session.begin(4)
    for seq in range(3):
        session.sent(seq)
    session.ack(Ack(4, 0, True))
    session.failed()
    assert session.in_flight == 0
    assert session.remote_version == 3
    # the engine answers each of the two messages still in flight, once and in order
    assert session.ack(Ack(4, 1, True)) is None
    session.begin(5)
    session.sent(0)
    assert session.ack(Ack(4, 2, False, "stream already failed")) is None
    assert session.ack(Ack(5, 0, True)) == Ack(5, 0, True)
    # an ack that answers nothing outstanding means the two sides disagree
    with pytest.raises(ProtocolError):
        session.ack(Ack(4, 3, True))


def test_link_leftover_acks_are_skipped_when_the_same_version_is_retried() -> None:
    session = link(3)
    session.begin(4)
    for seq in range(3):
        session.sent(seq)
    session.ack(Ack(4, 0, True))
    session.ack(Ack(4, 1, False, "sink could not copy"))  # bucket 1 refused: the stream fails
    session.failed()
    session.begin(4)  # the caller retries the version
    session.sent(0)
    # the engine's answer to bucket 2 of the failed attempt arrives first
    assert session.ack(Ack(4, 2, False, "stream already failed")) is None
    assert session.ack(Ack(4, 0, True)) == Ack(4, 0, True)


def test_link_commit_moves_the_remote_version_and_failure_keeps_it() -> None:
    session = link(1)
    session.begin(2)
    session.failed()
    assert session.remote_version == 1
    session.begin(2)
    session.committed()
    assert (session.remote_version, session.version) == (2, None)
    with pytest.raises(RejectedError, match="holds this version already"):
        session.begin(2)


ENGINES = ["e0", "e1", "e2"]


def test_vote_all_commits_once_every_engine_prepared() -> None:
    vote = FleetVote(ENGINES, Policy.ALL)
    for engine in ENGINES[:-1]:
        vote.prepare(engine)
        assert vote.verdict() is Verdict.PENDING
    vote.prepare("e2")
    assert vote.verdict() is Verdict.COMMIT
    assert vote.prepared == ENGINES


def test_vote_all_aborts_on_the_first_failure() -> None:
    vote = FleetVote(ENGINES, Policy.ALL)
    vote.prepare("e0")
    vote.prepare("e1")
    vote.fail("e2", RejectedError("no"))
    assert vote.hopeless
    assert vote.verdict() is Verdict.ABORT
    assert vote.live == ["e0", "e1"]


def test_vote_available_commits_the_prepared_ones() -> None:
    vote = FleetVote(ENGINES, Policy.AVAILABLE)
    vote.fail("e1", RejectedError("no"))
    assert not vote.hopeless
    vote.prepare("e0")
    assert vote.verdict() is Verdict.PENDING  # e2 has not answered
    vote.prepare("e2")
    assert vote.verdict() is Verdict.COMMIT
    assert vote.prepared == ["e0", "e2"]


def test_vote_available_aborts_when_no_engine_is_left() -> None:
    vote = FleetVote(ENGINES, Policy.AVAILABLE)
    for engine in ENGINES:
        vote.fail(engine, RejectedError(engine))
    assert vote.live == []
    assert vote.verdict() is Verdict.ABORT
    assert FleetVote([], Policy.AVAILABLE).verdict() is Verdict.ABORT


def test_vote_keeps_the_first_error_and_ignores_late_changes() -> None:
    vote = FleetVote(ENGINES, Policy.ALL)
    first = RejectedError("first")
    vote.fail("e0", first)
    vote.fail("e0", RejectedError("second"))
    vote.prepare("e0")  # a failed engine cannot prepare
    vote.prepare("e1")
    vote.fail("e1", RejectedError("late"))  # nor can a prepared one fail the vote
    assert vote.failed == {"e0": first}
    assert vote.prepared == ["e1"]


# --------------------------------------------------------------------------------------
# the sender driver
# --------------------------------------------------------------------------------------

VERSION = 2


@dataclass
class Sender:
    """One version to a fleet of engines, as the pipeline streams it, with no IO."""

    engines: list[str]
    policy: Policy
    manifest: list[TensorMeta] | None
    plans: list[BucketPlan]
    pipelined: bool = False  # stream before the engines accepted the begin
    version: int = VERSION

    def __post_init__(self) -> None:
        self.links = {name: LinkSession(name, f"session-{name}") for name in self.engines}
        self.vote = FleetVote(list(self.engines), self.policy)
        self.entries = {m.name: i for i, m in enumerate(self.manifest or ())}
        self.tensors = sum(s.is_last_chunk for plan in self.plans for s in plan.specs)
        self.outbox: list[tuple[str, Message]] = []
        self.stage = "begin"
        self.result: str | None = None  # "committed" or "failed" once done
        self.begun: set[str] = set()
        self.broken: set[str] = set()
        self.outcomes: dict[str, str] = {}
        self.commit_sent: set[str] = set()
        self.ledger: BufferLedger[int] = BufferLedger()
        self.free: deque[int] = deque(range(BUFFERS))
        self.inflight: dict[str, deque[int]] = {name: deque() for name in self.engines}
        self.published = 0
        self.reached_commit = False

    # --- what the harness calls ---------------------------------------------------------

    def start(self) -> None:
        for name, session in self.links.items():
            try:
                session.begin(self.version)
            except RejectedError as exc:  # the engine said at hello it has this version
                self._fail(name, exc, broken=False)  # a refusal: the session stays
                continue
            self._request(name, Begin(self.version, self.manifest), 0)
        self._advance()

    def reading(self, name: str) -> bool:
        """True while this engine's replies are awaited (only then are they read)."""
        return self.links[name].in_flight > 0

    def receive(self, name: str, message: Message | None) -> None:
        """One reply from engine ``name`` (None: a frame that did not decode)."""
        session = self.links[name]
        if message is None:
            self._fail(name, ProtocolError("undecodable reply"), broken=True)
        elif isinstance(message, Abort):
            self._fail(name, PeerGoneError(message.reason), broken=True)
        elif not isinstance(message, Ack):
            self._fail(name, ProtocolError(f"unexpected {message}"), broken=True)
        else:
            try:
                ack = session.ack(message)
            except ProtocolError as exc:
                self._fail(name, exc, broken=True)
            else:
                if ack is not None:
                    self._on_ack(name, ack)
        self._advance()

    def timeout(self, name: str) -> None:
        self._fail(name, SyncTimeoutError("no ack"), broken=True)
        self._advance()

    # --- the protocol -----------------------------------------------------------------

    def _request(self, name: str, message: Message, seq: int) -> None:
        self.outbox.append((name, message))
        self.links[name].sent(seq)

    def _on_ack(self, name: str, ack: Ack) -> None:
        if not ack.ok:
            kind = BusyError if ack.busy else RejectedError
            self._fail(name, kind(ack.error or "refused", tensor=ack.tensor), broken=False)
            return
        n = len(self.plans)
        if ack.seq == 0:
            self.begun.add(name)
        elif ack.seq <= n:
            index = self.inflight[name].popleft()
            if self.ledger.release(index, name) is not None:
                self.free.append(index)
        elif ack.seq == n + 1:
            self.vote.prepare(name)
        else:
            assert ack.seq == n + 2
            self.links[name].committed()
            self.outcomes[name] = "committed"

    def _fail(self, name: str, error: AiosyncError, *, broken: bool) -> None:
        self.links[name].failed()
        if broken:
            self.broken.add(name)
        if name in self.vote.prepared:
            self.outcomes.setdefault(name, "lost after prepare")
        else:
            self.vote.fail(name, error)
        self.inflight[name].clear()
        for index, _ in self.ledger.drop(name):
            self.free.append(index)

    def _advance(self) -> None:
        ready = self.pipelined or all(name in self.begun for name in self.vote.live)
        if self.stage == "begin" and ready:
            if self.vote.verdict() is Verdict.ABORT:
                self._abort()
            else:
                self.stage = "stream"
        if self.stage == "stream":
            self._stream()
        if self.stage == "complete" and all(e in self.vote.prepared for e in self.vote.live):
            if self.vote.verdict() is Verdict.COMMIT:
                self.stage = "commit"
                self.reached_commit = True
                for name in self.vote.prepared:
                    if name in self.outcomes:
                        continue
                    self.commit_sent.add(name)
                    self._request(
                        name, Commit(self.version, len(self.plans) + 2), len(self.plans) + 2
                    )
            else:
                self._abort()
        if self.stage == "commit" and all(name in self.outcomes for name in self.vote.prepared):
            self.stage = "done"
            committed = any(o == "committed" for o in self.outcomes.values())
            self.result = "committed" if committed else "failed"

    def _stream(self) -> None:
        if self.vote.hopeless:
            self._abort()
            return
        while self.free and self.published < len(self.plans):
            index = self.free.popleft()
            plan = self.plans[self.published]
            self.published += 1
            seq = self.published
            live = self.vote.live
            self.ledger.hold(index, live, seq)
            for name in live:
                self._request(name, self._bucket(seq, index, plan), seq)
                self.inflight[name].append(index)
        if self.published == len(self.plans) and not any(self.inflight.values()):
            assert self.ledger.held == 0
            self.stage = "complete"
            n = len(self.plans)
            for name in self.vote.live:
                self._request(name, Complete(self.version, n + 1, n, self.tensors), n + 1)

    def _bucket(self, seq: int, index: int, plan: BucketPlan) -> Bucket:
        if self.manifest is None:
            return Bucket(self.version, seq, index, plan.used, specs=plan.specs)
        slots = [Slot(self.entries[s.name], s.offset, s.nbytes, s.start) for s in plan.specs]
        return Bucket(self.version, seq, index, plan.used, slots=slots)

    def _abort(self) -> None:
        for name, session in self.links.items():
            if name in self.broken or name in self.outcomes:
                continue
            session.failed()
            self.outbox.append((name, Abort("the version is abandoned", self.version)))
        self.stage = "done"
        self.result = "failed"


# --------------------------------------------------------------------------------------
# the engines and the wires between
# --------------------------------------------------------------------------------------


@dataclass
class Setup:
    """One engine of a scenario: versions, sink kind and what its sink expects."""

    old: int | None  # its version at hello
    moved: int | None  # its version once the session is open (another sender committed)
    staged: bool
    expects: str  # "anything", "exact", "tied", "extra", "shape"

    def refuses(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether this engine must refuse the version (known without the machines)."""
        versions = [v for v in (self.old, self.moved) if v is not None]
        if versions and max(versions) >= VERSION:
            return True
        if self.expects == "tied":
            return next(iter(tensors.values())).numel() == 0  # no storage: no alias
        return self.expects in ("extra", "shape")


def expectations(setup: Setup, tensors: dict[str, torch.Tensor]) -> Expectations | None:
    if setup.expects == "anything":
        return None
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    if setup.expects == "tied":
        targets["tied.alias"] = next(iter(targets.values()))
    elif setup.expects == "extra":
        targets["extra"] = torch.zeros(2)
    elif setup.expects == "shape":
        name = next(iter(targets))
        targets[name] = torch.zeros(targets[name].numel() + 1)
    return expectations_of(targets, targets)


@dataclass
class Track:
    """What the harness saw one engine do, to check it against the rules."""

    old: int | None
    staged: bool
    open: bool = False  # a stream of the version is accepted and not ended
    mixed: bool = False  # the weights hold part of an uncommitted version
    pending: bool = False  # the sink took bytes it has neither committed nor discarded
    begins: int = 0
    applies: int = 0


@dataclass
class Fleet:
    """Engines, their wires to the sender, and synchronous IO for their actions."""

    data: st.DataObject | None  # None: no faults, and the first event always comes first
    sender: Sender
    setups: dict[str, Setup]
    tensors: dict[str, torch.Tensor]
    faults: bool
    now: float = 0.0
    engines: dict[str, EngineSession] = field(default_factory=dict)
    tracks: dict[str, Track] = field(default_factory=dict)
    to_engine: dict[str, deque[Message]] = field(default_factory=dict)
    to_sender: dict[str, deque[Message]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, setup in self.setups.items():
            engine = EngineSession(
                expectations=expectations(setup, self.tensors),
                staged=setup.staged,
                stream_timeout=STREAM_TIMEOUT,
                session_timeout=SESSION_TIMEOUT,
            )
            engine.current_version = setup.old
            self.engines[name] = engine
            self.tracks[name] = Track(setup.old, setup.staged)
            self.to_engine[name] = deque()
            self.to_sender[name] = deque()

    def handshake(self) -> None:
        for name, engine in self.engines.items():
            session = self.sender.links[name]
            self.perform(name, engine.receive("trainer", session.hello("trainer", PLANE), 0.0))
            ready = self.to_sender[name].popleft()
            assert isinstance(ready, Ready)
            session.ready(ready)
            setup = self.setups[name]
            if setup.moved is not None:
                engine.current_version = setup.moved
                self.tracks[name].old = setup.moved

    def pick(self, count: int) -> int:
        """Which of ``count`` things happens (shrinks towards the first)."""
        if self.data is None or count == 1:
            return 0
        return self.data.draw(st.integers(0, count - 1))

    def chance(self, one_in: int) -> bool:
        """A fault, now and then (shrinks towards no fault)."""
        return self.faults and self.pick(one_in) == one_in - 1

    # --- the engine's IO --------------------------------------------------------------

    def perform(self, name: str, actions: list[Action]) -> None:
        engine, track = self.engines[name], self.tracks[name]
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            follow: list[Action] = []
            if isinstance(action, Reply):
                assert action.peer == "trainer"
                self._watch_reply(track, action.message)
                self.to_sender[name].append(action.message)
            elif isinstance(action, OpenPlane):
                follow = engine.plane_opened(action.peer)
            elif isinstance(action, Apply):
                assert track.open, f"{name} applied a bucket of a stream it refused or ended"
                assert action.version == VERSION
                track.applies += 1
                track.pending = True
                if not track.staged:
                    track.mixed = True
                if self.chance(16):
                    error = MismatchError("the sink could not copy")
                    follow = engine.apply_failed(action.peer, action.seq, error)
                else:
                    follow = engine.applied(action.peer, action.seq, self.now)
            elif isinstance(action, CommitSink):
                assert track.open, f"{name} committed a stream it refused or ended"
                assert name in self.sender.commit_sent, f"{name} committed unasked"
                assert not self.setups[name].refuses(self.tensors), f"{name} took a bad version"
                assert self.sender.vote.verdict() is Verdict.COMMIT
                if self.chance(8):
                    track.mixed = True
                    error = AiosyncError("engine failed to commit")
                    follow = engine.commit_failed(action.peer, action.version, error)
                else:
                    track.mixed = track.pending = False
                    follow = engine.commit_done(action.peer, action.version, self.now)
            elif isinstance(action, Discard):
                track.open = track.pending = False
            elif isinstance(action, ClosePlane):
                track.open = False
            else:
                assert isinstance(action, Committed)
                assert engine.current_version == action.version == VERSION
                track.open = False  # the stream is over: nothing more of it may apply
            queue.extendleft(reversed(follow))
        self.check(name)

    @staticmethod
    def _watch_reply(track: Track, message: Message) -> None:
        if isinstance(message, Abort):
            track.open = False
        elif isinstance(message, Ack) and message.version == VERSION:
            if message.seq == 0 and message.ok:
                assert not track.pending, "a new stream begins on bytes an old one left"
                track.open = True
            elif not message.ok:
                track.open = False

    def check(self, name: str) -> None:
        """The invariants that hold after every step."""
        engine, track = self.engines[name], self.tracks[name]
        assert engine.current_version in (track.old, VERSION)
        assert engine.servable is not track.mixed
        assert engine.owner in (None, "trainer")
        refused = [f for f in engine.failures if f.version == VERSION]
        assert len(refused) <= track.begins, engine.failures  # at most once per stream

    # --- the wires --------------------------------------------------------------------

    def flush(self) -> None:
        for name, message in self.sender.outbox:
            self.to_engine[name].append(message)
        self.sender.outbox.clear()

    def deliver(self, wire: deque[Message]) -> Message | bool | None:
        """The next message off ``wire`` as it arrives: None garbled, False lost."""
        message = wire.popleft()
        fault = self.pick(40) if self.faults else 0
        if fault == 37:
            return False
        if fault == 38:
            wire.appendleft(message)  # it will arrive twice
        if fault == 39:
            return None
        return decode(encode(message))

    def step(self) -> bool:
        """One event; False once nothing is left to happen."""
        names = list(self.engines)
        events = [("engine", n) for n in names if self.to_engine[n]]
        events += [("sender", n) for n in names if self.to_sender[n] and self.sender.reading(n)]
        self.now += 0.001
        if self.chance(25):
            name = names[self.pick(len(names))]
            if self.pick(2) == 0:
                self.now += (STREAM_TIMEOUT, SESSION_TIMEOUT)[self.pick(2)]
                self.perform(name, self.engines[name].expire(self.now))
            elif self.sender.reading(name):
                self.sender.timeout(name)
        elif events:
            kind, name = events[self.pick(len(events))]
            if kind == "engine":
                message = self.deliver(self.to_engine[name])
                if message is not False:
                    self.receive(name, message)
            else:
                message = self.deliver(self.to_sender[name])
                if message is not False:
                    self.sender.receive(name, message)
        else:  # quiet: whatever the sender still waits for timed out
            stalled = [n for n in names if self.sender.reading(n)]
            if not stalled:
                return False
            for name in stalled:
                self.sender.timeout(name)
        self.flush()
        return True

    def receive(self, name: str, message: Message | None) -> None:
        engine = self.engines[name]
        if message is None:
            self.perform(name, engine.undecodable("trainer", ProtocolError("garbled frame")))
            return
        if isinstance(message, Begin):
            self.tracks[name].begins += 1
        self.perform(name, engine.receive("trainer", message, self.now))

    def run(self) -> None:
        self.handshake()
        self.sender.start()
        self.flush()
        for _ in range(MAX_STEPS):
            if not self.step():
                break
        else:
            pytest.fail("the protocol did not settle")
        assert self.sender.stage == "done", "the sender is stuck with nothing in flight"
        for name, engine in self.engines.items():
            self.perform(name, engine.expire(self.now + 1e6))
            assert engine.owner is None
            assert engine.sessions == {}
            assert not self.tracks[name].pending, f"{name}'s sink kept bytes of a dead stream"


# --------------------------------------------------------------------------------------
# the properties
# --------------------------------------------------------------------------------------

SIZES = [0, 1, 4, 60, 300]  # float32 elements: 300 travels in two chunks of a 1 KiB buffer


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[Setup], bool, Policy]:
    sizes = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=4))
    tensors = {f"layer{i}.w": torch.full((n,), float(i)) for i, n in enumerate(sizes)}
    versions = st.sampled_from([None, 0, 1, 3])  # 3: newer than the version sent
    setups = draw(
        st.lists(
            st.builds(
                Setup,
                old=st.sampled_from([None, 0, 1, 1, 3]),
                moved=st.none() | versions,
                staged=st.booleans(),
                expects=st.sampled_from([*["anything", "exact", "tied"] * 3, "extra", "shape"]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    return tensors, setups, draw(st.booleans()), draw(st.sampled_from(Policy))


def fleet_for(
    data: st.DataObject,
    tensors: dict[str, torch.Tensor],
    setups: list[Setup],
    with_manifest: bool,
    policy: Policy,
    faults: bool,
) -> Fleet:
    manifest = build_manifest(tensors.items(), CAPACITY) if with_manifest else None
    plans = list(plan_buckets(tensors.items(), CAPACITY))
    names = [f"engine-{i}" for i in range(len(setups))]
    pipelined = data is not None and data.draw(st.booleans(), label="pipelined")
    sender = Sender(names, policy, manifest, plans, pipelined)
    return Fleet(data, sender, dict(zip(names, setups, strict=True)), tensors, faults)


def check_outcome(fleet: Fleet) -> None:
    """What the sender reports agrees with where the engines are."""
    sender, vote = fleet.sender, fleet.sender.vote
    moved = {n for n, e in fleet.engines.items() if e.current_version == VERSION}
    committed = {n for n, o in sender.outcomes.items() if o == "committed"}
    lost = {n for n, o in sender.outcomes.items() if o == "lost after prepare"}
    # an engine moves only when the vote said commit and it was told to
    assert moved <= sender.commit_sent
    assert sender.commit_sent <= set(vote.prepared)
    if not sender.reached_commit:
        assert moved == set(), "the version was abandoned, yet an engine moved"
    elif vote.policy is Policy.ALL:
        assert set(vote.prepared) == set(fleet.engines)
        assert vote.failed == {}
    else:
        assert set(vote.prepared) == set(fleet.engines) - set(vote.failed)
    # what the sender says committed did; what it says failed did not move
    assert committed <= moved
    for name in set(fleet.engines) - committed - lost:
        assert name not in moved
    # success exactly when a required engine committed; a clean success leaves them all there
    assert (sender.result == "committed") == (sender.reached_commit and bool(committed))
    if sender.result == "committed" and not lost:
        required = set(fleet.engines) if vote.policy is Policy.ALL else set(vote.prepared)
        assert required == committed == moved
    for name, track in fleet.tracks.items():  # a broken stream never reached commit
        if name not in moved:
            assert fleet.engines[name].current_version == track.old


def check_fault_free(fleet: Fleet, tensors: dict[str, torch.Tensor]) -> None:
    """Without faults the outcome is known in advance: the protocol must deliver it."""
    refusing = {n for n, s in fleet.setups.items() if s.refuses(tensors)}
    taking = set(fleet.engines) - refusing
    moved = {n for n, e in fleet.engines.items() if e.current_version == VERSION}
    failed = set(fleet.sender.vote.failed)
    if fleet.sender.policy is Policy.ALL and refusing:
        assert moved == set()
        assert fleet.sender.result == "failed"
        assert failed  # one refusal may end the stream before the others are found
        assert failed <= refusing
    else:
        assert moved == taking
        assert fleet.sender.result == ("committed" if taking else "failed")
        assert failed == refusing
    if fleet.sender.result == "committed":
        assert all(fleet.engines[name].failures == [] for name in taking)


@settings(deadline=None)
@given(scenario=scenarios(), faults=st.booleans(), data=st.data())
def test_fleet_commit_invariants_under_faults(
    scenario: tuple[dict[str, torch.Tensor], list[Setup], bool, Policy],
    faults: bool,
    data: st.DataObject,
) -> None:
    tensors, setups, with_manifest, policy = scenario
    fleet = fleet_for(data, tensors, setups, with_manifest, policy, faults)
    fleet.run()
    check_outcome(fleet)
    if not faults:
        check_fault_free(fleet, tensors)
    moved = sum(e.current_version == VERSION for e in fleet.engines.values())
    event(f"{policy.value}: sender {fleet.sender.result}, {moved}/{len(setups)} engines moved")
    event(f"lost after prepare: {sum(o != 'committed' for o in fleet.sender.outcomes.values())}")


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("with_manifest", [True, False])
def test_fleet_without_faults_commits_everywhere(
    policy: Policy, count: int, with_manifest: bool
) -> None:
    tensors = {"a": torch.ones(4), "big": torch.ones(300), "c": torch.ones(60)}
    setups = [Setup(1, None, staged=i % 2 == 0, expects="exact") for i in range(count)]
    fleet = fleet_for(None, tensors, setups, with_manifest, policy, faults=False)  # type: ignore[arg-type]
    fleet.run()
    check_outcome(fleet)
    assert fleet.sender.result == "committed"
    assert all(e.current_version == VERSION and e.servable for e in fleet.engines.values())
    assert all(t.applies == len(fleet.sender.plans) for t in fleet.tracks.values())


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("expects", ["shape", "extra"])
def test_fleet_with_one_engine_refusing_the_manifest(policy: Policy, expects: str) -> None:
    tensors = {"a": torch.ones(4), "b": torch.ones(8)}
    setups = [Setup(1, None, False, "exact"), Setup(1, None, False, expects)]
    fleet = fleet_for(None, tensors, setups, True, policy, faults=False)  # type: ignore[arg-type]
    fleet.run()
    check_outcome(fleet)
    refused = fleet.tracks["engine-1"]
    assert refused.applies == 0
    assert fleet.engines["engine-1"].servable
    assert fleet.engines["engine-1"].current_version == 1
    assert list(fleet.sender.vote.failed) == ["engine-1"]
    if policy is Policy.ALL:  # refused at begin: nothing reached any sink
        assert fleet.sender.result == "failed"
        assert fleet.tracks["engine-0"].applies == 0
        assert fleet.engines["engine-0"].current_version == 1
    else:
        assert fleet.sender.result == "committed"
        assert fleet.engines["engine-0"].current_version == VERSION


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("expects", ["shape", "extra"])
def test_fleet_without_a_manifest_never_commits_a_bad_version(policy: Policy, expects: str) -> None:
    """No manifest (a generator): a bad tensor is refused at its bucket, a missing one at end."""
    tensors = {"a": torch.ones(4), "b": torch.ones(8)}
    setups = [Setup(1, None, True, "exact"), Setup(1, None, False, expects)]
    fleet = fleet_for(None, tensors, setups, False, policy, faults=False)  # type: ignore[arg-type]
    fleet.run()
    check_outcome(fleet)
    assert fleet.engines["engine-1"].current_version == 1
    assert list(fleet.sender.vote.failed) == ["engine-1"]
    reason = fleet.engines["engine-1"].failures[0].reason
    assert ("float32[5]" if expects == "shape" else "misses 1 required tensors: extra") in reason
    moved = fleet.engines["engine-0"].current_version == VERSION
    assert moved is (policy is Policy.AVAILABLE)


# --------------------------------------------------------------------------------------
# two senders, one engine: the sink is never shared
# --------------------------------------------------------------------------------------


def blind_script(
    version: int, tensors: dict[str, torch.Tensor], with_manifest: bool
) -> list[Message]:
    """A sender that never waits for acks: every message of one version, in order."""
    manifest = build_manifest(tensors.items(), CAPACITY) if with_manifest else None
    entries = {m.name: i for i, m in enumerate(manifest or ())}
    plans = list(plan_buckets(tensors.items(), CAPACITY))
    script: list[Message] = [Begin(version, manifest)]
    for seq, plan in enumerate(plans, start=1):
        if manifest is None:
            script.append(Bucket(version, seq, seq % BUFFERS, plan.used, specs=plan.specs))
        else:
            slots = [Slot(entries[s.name], s.offset, s.nbytes, s.start) for s in plan.specs]
            script.append(Bucket(version, seq, seq % BUFFERS, plan.used, slots=slots))
    count = sum(s.is_last_chunk for plan in plans for s in plan.specs)
    n = len(plans)
    return [*script, Complete(version, n + 1, n, count), Commit(version, n + 2)]


@settings(deadline=None)
@given(
    versions=st.lists(st.integers(0, 4), min_size=2, max_size=2),
    current=st.sampled_from([None, 0, 2]),
    staged=st.booleans(),
    manifests=st.lists(st.booleans(), min_size=2, max_size=2),
    order=st.lists(st.booleans(), min_size=40, max_size=40),
    failing=st.sets(st.integers(0, 12), max_size=2),
)
def test_two_senders_never_share_the_sink(
    versions: list[int],
    current: int | None,
    staged: bool,
    manifests: list[bool],
    order: list[bool],
    failing: set[int],
) -> None:
    tensors = {"a": torch.ones(4), "big": torch.ones(300)}
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    engine = EngineSession(
        expectations=expectations_of(targets, targets),
        staged=staged,
        stream_timeout=STREAM_TIMEOUT,
        session_timeout=SESSION_TIMEOUT,
    )
    engine.current_version = current
    peers = ["p", "q"]
    scripts = {
        peer: deque(blind_script(v, tensors, m))
        for peer, v, m in zip(peers, versions, manifests, strict=True)
    }
    version_of = dict(zip(peers, versions, strict=True))
    accepted: dict[str, bool] = dict.fromkeys(peers, False)
    ever_accepted: set[str] = set()
    mixed = pending = False
    applies = 0

    def perform(actions: list[Action]) -> None:
        nonlocal mixed, pending, applies
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            follow: list[Action] = []
            if isinstance(action, Reply):
                message = action.message
                if isinstance(message, Ack) and message.version == version_of[action.peer]:
                    if message.seq == 0 and message.ok:
                        assert not pending, "a stream begins on bytes another one left"
                        accepted[action.peer] = True
                        ever_accepted.add(action.peer)
                    elif not message.ok:
                        accepted[action.peer] = False
                if isinstance(message, Abort):
                    accepted[action.peer] = False
            elif isinstance(action, OpenPlane):
                follow = engine.plane_opened(action.peer)
            elif isinstance(action, Apply):
                assert accepted[action.peer], f"{action.peer}'s refused stream reached the sink"
                others = [p for p in peers if p != action.peer]
                assert not any(accepted[p] for p in others), "two streams at once"
                assert action.version == version_of[action.peer]
                mixed = mixed or not staged
                pending = True
                applies += 1
                if applies in failing:
                    follow = engine.apply_failed(action.peer, action.seq, MismatchError("no"))
                else:
                    follow = engine.applied(action.peer, action.seq, 0.0)
            elif isinstance(action, CommitSink):
                assert accepted[action.peer]
                assert action.version == version_of[action.peer]
                follow = engine.commit_done(action.peer, action.version, 0.0)
                mixed = pending = False
            elif isinstance(action, Discard):
                assert engine.owner is None
                pending = False
            elif isinstance(action, Committed):
                assert engine.current_version == action.version
                for peer in peers:
                    if version_of[peer] == action.version and accepted[peer]:
                        accepted[peer] = False  # done
            queue.extendleft(reversed(follow))
        assert engine.servable is not mixed

    for peer in peers:
        perform(engine.receive(peer, LinkSession(peer, f"s-{peer}").hello(peer, PLANE), 0.0))
    for turn in order + [True] * 40 + [False] * 40:
        peer = peers[turn]
        if scripts[peer]:
            perform(engine.receive(peer, scripts[peer].popleft(), 0.0))
    assert not any(scripts.values())
    assert engine.current_version in (current, *versions)
    if engine.current_version != current:
        assert any(version_of[p] == engine.current_version for p in ever_accepted)
    assert engine.owner is None
    assert not pending
