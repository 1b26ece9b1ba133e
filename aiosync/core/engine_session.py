"""The engine's protocol state as a pure machine: messages in, actions out.

:class:`EngineSession` holds everything an engine knows about its senders: their sessions,
the one stream that may touch the sink at a time, the committed version, whether the weights
are servable, and every stream that failed. It never touches a socket, a buffer or a thread:
:meth:`EngineSession.receive` returns actions (reply, open a plane, apply a bucket, commit,
discard) that the IO layer carries out, reporting back through ``applied``, ``commit_done``
and friends. The same machine therefore runs under tests with no process at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiosync.core.engine_actions import (
    Action,
    Apply,
    ClosePlane,
    CommitSink,
    Committed,
    Discard,
    Note,
    OpenPlane,
    Peer,
    Reply,
    SyncFailure,
)
from aiosync.core.engine_peers import Phase as Phase
from aiosync.core.engine_peers import SenderSession as _Session
from aiosync.core.engine_timers import expired
from aiosync.core.engine_timers import next_deadline as first_deadline
from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.hello import plane_problem, session_slot, stated_timeout
from aiosync.core.limits import Limits, shorten
from aiosync.core.manifest import Expectations, TensorMeta
from aiosync.core.ready_terms import ReadyTerms
from aiosync.core.shares import holder
from aiosync.core.stream_state import StreamMemory, light, open_stream
from aiosync.core.versions import check_version, past_deadline
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
    Ping,
    split_begin,
    spoken,
)


class EngineSession:
    """All of an engine's protocol state; every method returns the actions to carry out.

    ``expectations`` (None: accept any tensor, require none) is what the sink takes;
    ``staged`` says whether a broken stream leaves the visible weights untouched; ``limits``
    bound what any one peer may make the engine hold, check or remember. ``terms``
    are stated to senders in the ``ready`` (None: none); ``clock`` is the wall clock
    commits' deadlines are read on (``time.time``); ``key_of`` names the CURVE key a peer
    came with (None: no CURVE), whose share of the sessions it takes.
    """

    def __init__(
        self,
        *,
        expectations: Expectations | None,
        staged: bool,
        stream_timeout: float,
        session_timeout: float,
        limits: Limits | None = None,
        terms: ReadyTerms | None = None,
        clock: Callable[[], float] = time.time,
        key_of: Callable[[Peer], bytes | None] | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.key_of = key_of or (lambda peer: None)
        self.terms = terms or ReadyTerms()
        self.clock = clock
        self.expectations = expectations
        self.staged = staged
        self.stream_timeout = stream_timeout
        self.session_timeout = session_timeout
        self.current_version: int | None = None
        self.version_set_by: str | None = None  # the session that committed it
        self.servable = True
        self.failures: list[SyncFailure] = []  # the last ``max_failures``
        self.protocol_errors = 0
        self.withdrawn = 0  # begins taken back before any bucket (not failures)
        self.sessions: dict[Peer, _Session] = {}
        self.owner: Peer | None = None  # the peer whose stream may touch the sink
        self.memory: StreamMemory | None = None  # the last whole stream, to replay

    # --- messages ---------------------------------------------------------------------

    def receive(self, peer: Peer, message: Message, now: float) -> list[Action]:
        """Take one decoded message from ``peer``."""
        if isinstance(message, Hello):
            return self._on_hello(peer, message, now)
        session = self.sessions.get(peer)
        if session is None:
            if isinstance(message, Abort | Ping):
                return []  # nothing to abort or keep alive
            return self._protocol_error(peer, f"{type(message).__name__.lower()} before hello")
        session.seen = now
        if session.phase is Phase.OPENING:
            return self._protocol_error(peer, "message before the session was ready")
        if isinstance(message, Ping):
            return []
        if isinstance(message, Begin):
            head, first = split_begin(message)
            actions = self._on_begin(peer, session, head, now)
            if first is None or peer not in self.sessions:  # not after a protocol error
                return actions
            return actions + self.receive(peer, first, now)
        if isinstance(message, Bucket):
            return self._on_bucket(peer, session, message)
        if isinstance(message, Complete):
            return self._on_complete(peer, session, message, now)
        if isinstance(message, Commit):
            return self._on_commit(peer, session, message)
        if isinstance(message, Abort):
            stream = session.stream
            if stream is None or message.version not in (None, stream.version):
                return []
            reason = shorten(message.reason, self.limits.max_name_length)
            quiet = message.withdrawn and stream.next_seq == 1  # nothing after its begin
            self.withdrawn += quiet
            return self._fail_stream(peer, session, f"sender aborted: {reason}", record=not quiet)
        if isinstance(message, Goodbye):
            if message.session != session.session:
                return self._protocol_error(
                    peer, f"goodbye for unknown session {message.session!r}"
                )
            reply = Reply(peer, Ack(None, GOODBYE_SEQ, True))  # after the plane is released
            return [*self._drop(peer, "sender said goodbye in mid-stream"), reply]
        return self._protocol_error(peer, f"unexpected {type(message).__name__}")

    def undecodable(self, peer: Peer, error: ProtocolError) -> list[Action]:
        """A frame from ``peer`` that is not a message: end its session and say why."""
        return self._protocol_error(peer, error.reason)

    @property
    def manifests(self) -> list[list[TensorMeta]]:
        """The manifests held now: each open stream's and the last whole stream's."""
        held = [s.stream.manifest for s in self.sessions.values() if s.stream is not None]
        memory = [self.memory.manifest] if self.memory is not None else []
        return [manifest for manifest in held if manifest is not None] + memory

    def light(self, peer: Peer, message: Message) -> bool:
        """Whether ``message``'s checks are bounded work now (:func:`.stream_state.light`)."""
        session = self.sessions.get(peer)
        return light(message, session.stream if session else None, self.memory)

    def _on_hello(self, peer: Peer, hello: Hello, now: float) -> list[Action]:
        known = peer in self.sessions
        actions = self._drop(peer, "sender reconnected") if known else []
        sizes = hello.plane.sizes
        who = holder(peer, self.key_of(peer))
        problem = plane_problem(sizes, self.limits)
        if not hello.protocol_min <= PROTOCOL <= hello.protocol_max:
            theirs = spoken(hello.protocol_min, hello.protocol_max)
            problem = (
                f"session refused: the sender speaks {theirs}, this engine "
                f"{spoken(PROTOCOL, PROTOCOL)} (run the same aiosync release on both ends)"
            )
        if problem is None and not known:
            idle = self.session_timeout
            problem, closing = session_slot(self.sessions, who, self.limits, now, idle)
            if closing is not None:  # every slot taken: the longest idle session goes
                victim, why = closing
                actions += [Reply(victim, Abort(why)), *self._drop(victim, why)]
        if problem is not None:
            self.protocol_errors += 1
            return [*actions, Reply(peer, Abort(problem))]
        name = f"{shorten(hello.sender, 64)}@{peer}"
        session = shorten(hello.session, self.limits.max_name_length)
        timeout = stated_timeout(hello.timeout)
        self.sessions[peer] = _Session(name, session, sizes, now, now, timeout=timeout, holder=who)
        return [*actions, OpenPlane(peer, hello.plane)]

    def plane_opened(self, peer: Peer) -> list[Action]:
        """The IO layer opened ``peer``'s plane: the session is ready."""
        session = self.sessions[peer]
        session.phase = Phase.IDLE
        ready = self.terms.ready(
            session.session, self.current_version, self.limits, staged=self.staged
        )
        return [Reply(peer, ready)]

    def plane_failed(self, peer: Peer, reason: str) -> list[Action]:
        """The plane could not be opened: the session is refused."""
        self.sessions.pop(peer, None)
        self.protocol_errors += 1
        return [Reply(peer, Abort(f"session refused: {reason}")), ClosePlane(peer)]

    def _on_begin(self, peer: Peer, session: _Session, begin: Begin, now: float) -> list[Action]:
        version = begin.version
        if session.phase is not Phase.IDLE:
            open_version = session.stream.version if session.stream else None
            return self._protocol_error(
                peer, f"begin of version {version} while version {open_version} is open"
            )
        if self.owner is not None and self.owner != peer:
            other = self.sessions[self.owner].name
            error = f"{other} is streaming; try again later"
            return [Reply(peer, Ack(version, 0, False, error=error, busy=True))]
        try:
            check_version(
                version,
                self.current_version,
                rebase=begin.rebase,
                limits=self.limits,
                set_by=self.version_set_by,
            )
            stream = open_stream(begin, self.expectations, self.limits, self.memory)
        except AiosyncError as exc:
            self._record(session, version, exc.reason)
            session.failed_version = version
            return [Reply(peer, Ack(version, 0, False, error=exc.reason, tensor=exc.tensor))]
        session.stream = stream
        session.phase = Phase.STREAMING
        session.progress = now
        self.owner = peer
        note = [Note(f"{session.name} restarts the numbering at {version}")] if begin.rebase else []
        return [*note, Reply(peer, Ack(version, 0, True))]

    def _on_bucket(self, peer: Peer, session: _Session, bucket: Bucket) -> list[Action]:
        stream = session.stream
        if stream is None or stream.version != bucket.version:
            return [Reply(peer, self._no_stream(session, bucket.version, bucket.seq))]
        count = len(bucket.slots) + len(bucket.specs)
        if not 0 < count <= self.limits.max_bucket_tensors:
            limit = self.limits.max_bucket_tensors
            return self._protocol_error(peer, f"bucket of {count} tensors (1-{limit})")
        if session.phase is not Phase.STREAMING or bucket.seq != stream.next_seq:
            return self._protocol_error(
                peer, f"bucket seq {bucket.seq} out of order (expected {stream.next_seq})"
            )
        stream.next_seq += 1
        try:
            specs = stream.resolve(bucket, session.sizes)
        except AiosyncError as exc:
            return self._refuse(peer, session, bucket.seq, exc)
        if not self.staged:
            self.servable = False
        where = (bucket.buffer, bucket.used, specs, bucket.regions, bucket.digest, bucket.held)
        return [Apply(peer, bucket.version, bucket.seq, *where, bucket.after)]

    def applied(self, peer: Peer, seq: int, now: float) -> list[Action]:
        """The sink took bucket ``seq``: acknowledge it."""
        session = self.sessions.get(peer)
        if session is None or session.stream is None:
            return []  # the session ended while the bucket was applied
        session.stream.buckets += 1
        session.progress = now
        return [Reply(peer, Ack(session.stream.version, seq, True))]

    def apply_failed(self, peer: Peer, seq: int, error: AiosyncError) -> list[Action]:
        """The sink failed on bucket ``seq``: the stream fails and the sender hears why."""
        session = self.sessions.get(peer)
        if session is None or session.stream is None:
            return []
        return self._refuse(peer, session, seq, error)

    def _on_complete(
        self, peer: Peer, session: _Session, complete: Complete, now: float
    ) -> list[Action]:
        stream = session.stream
        if stream is None or stream.version != complete.version:
            return [Reply(peer, self._no_stream(session, complete.version, complete.seq))]
        if session.phase is not Phase.STREAMING or complete.seq != stream.next_seq:
            return self._protocol_error(peer, f"complete seq {complete.seq} out of order")
        stream.next_seq += 1
        try:
            stream.check_whole(complete)
        except AiosyncError as exc:
            return self._refuse(peer, session, complete.seq, exc)
        session.phase = Phase.PREPARED
        session.progress = now
        self.memory = stream.memory() or self.memory
        return [Reply(peer, Ack(stream.version, complete.seq, True))]

    def _on_commit(self, peer: Peer, session: _Session, commit: Commit) -> list[Action]:
        stream = session.stream
        if stream is None or stream.version != commit.version:
            return [Reply(peer, self._no_stream(session, commit.version, commit.seq))]
        if session.phase is not Phase.PREPARED or commit.seq != stream.next_seq:
            return self._protocol_error(peer, f"commit of version {commit.version} not prepared")
        stream.next_seq += 1
        late = past_deadline(commit.deadline, self.clock())
        if late is not None:
            return self._refuse(peer, session, commit.seq, AiosyncError(late))
        session.phase = Phase.COMMITTING
        return [CommitSink(peer, commit.version, commit.deadline)]

    def commit_done(self, peer: Peer, version: int, now: float) -> list[Action]:
        """The sink made ``version`` visible: it is current."""
        self.current_version = version
        self.servable = True
        self.owner = None
        session = self.sessions.get(peer)
        if session is not None:
            self.version_set_by = f"{session.name}, session {session.session}"
        actions: list[Action] = [Committed(version)]
        if session is not None and session.stream is not None:
            seq = session.stream.next_seq - 1
            session.stream = None
            session.phase = Phase.IDLE
            session.progress = now
            actions.insert(0, Reply(peer, Ack(version, seq, True)))
        return actions

    def commit_failed(
        self, peer: Peer, version: int, error: AiosyncError, *, touched: bool = True
    ) -> list[Action]:
        """The version could not be made live; weights it ``touched`` may be mixed."""
        if touched:
            self.servable = False
        session = self.sessions.get(peer)
        if session is None or session.stream is None:
            self.owner = None
            return [Discard(version)]
        return self._refuse(peer, session, session.stream.next_seq - 1, error)

    # --- time -------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has work, or None with no sessions."""
        return first_deadline(self.sessions, self.stream_timeout, self.session_timeout)

    def expire(self, now: float) -> list[Action]:
        """End sessions silent past their timeout (a stream: ``stream_timeout``)."""
        actions: list[Action] = []
        for peer, why in expired(self.sessions, now, self.stream_timeout, self.session_timeout):
            actions += self._drop(peer, why)
        return actions

    def close(self) -> list[Action]:
        """The engine is shutting down: end every session."""
        actions: list[Action] = []
        for peer in list(self.sessions):
            actions += self._drop(peer, "engine closing")
        return actions

    # --- shared steps -----------------------------------------------------------------

    def _no_stream(self, session: _Session, version: int, seq: int) -> Ack:
        """The answer to a message of a stream that failed or never opened (nothing applied)."""
        if session.failed_version == version:
            return Ack(version, seq, False, error="stream already failed")
        return Ack(version, seq, False, error=f"no open stream for version {version}")

    def _record(self, session: _Session, version: int | None, reason: str) -> None:
        self.failures.append(SyncFailure(session.name, version, reason))
        if len(self.failures) > self.limits.max_failures:
            del self.failures[: -self.limits.max_failures]

    def _fail_stream(
        self, peer: Peer, session: _Session, reason: str, *, record: bool = True
    ) -> list[Action]:
        stream = session.stream
        if stream is None:
            return []
        if record:
            self._record(session, stream.version, reason)
        session.failed_version = stream.version
        session.stream = None
        session.phase = Phase.IDLE
        if self.owner == peer:
            self.owner = None
            return [Discard(stream.version)]
        return []

    def _refuse(self, peer: Peer, session: _Session, seq: int, exc: AiosyncError) -> list[Action]:
        version = session.stream.version if session.stream else None
        if isinstance(exc, ProtocolError):
            self.protocol_errors += 1
        ack = Ack(version, seq, False, error=exc.reason, tensor=exc.tensor)
        return [*self._fail_stream(peer, session, exc.reason), Reply(peer, ack)]

    def _drop(self, peer: Peer, reason: str) -> list[Action]:
        session = self.sessions.pop(peer, None)
        if session is None:
            return []
        return [*self._fail_stream(peer, session, reason), ClosePlane(peer)]

    def _protocol_error(self, peer: Peer, reason: str) -> list[Action]:
        """The two sides disagree: count it, end the session and tell the peer why."""
        self.protocol_errors += 1
        name = self.sessions[peer].name if peer in self.sessions else str(peer)
        message = str(ProtocolError(reason, peer=name))
        return [Reply(peer, Abort(message)), *self._drop(peer, message)]
