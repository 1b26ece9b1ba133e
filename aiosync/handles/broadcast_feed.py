"""SGLang's per-bucket calls on the engine's side, fed to the engine's one session machine.

An SGLang engine learns a version one bucket at a time (``update_weights_from_distributed``:
names, dtypes and shapes, then rank 0's broadcasts) and makes it live by itself once it
holds all of it: there is no begin, complete or commit call. :class:`BroadcastFeed` turns
each call into the messages an :class:`~aiosync.core.engine_session.EngineSession` takes
(joining a group is the session's hello; a version's first bucket comes with its begin;
once the buckets cover what every sink requires, its complete and commit follow) and
carries out the actions the machine answers: receive and apply a bucket on every rank, make
the version live, drop what a failed one left. Which version may follow which, what a
bucket may hold, what a failure leaves servable and the failures kept are the machine's, as
for a :class:`~aiosync.WeightReceiver`. SGLang's callers number versions as they like (a
``weight_version`` need not grow), so a version the machine's rules would refuse restarts
the numbering, as a trainer back from a checkpoint does.

Every rank joins every broadcast of its group, so a bucket the machine refuses is still
received into the rank's buffer and dropped: the trainer's broadcast and the other engines
go on, and the refusal is this engine's answer.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from aiosync.collectives import Deadline, GroupExecutor, ops
from aiosync.collectives.alias_store import AliasStore
from aiosync.core.engine_actions import (
    Action,
    Apply,
    CommitSink,
    Discard,
    Note,
    OpenPlane,
    Reply,
)
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError, RejectedError
from aiosync.core.layout import TensorSpec, view_spec
from aiosync.core.limits import Limits
from aiosync.core.manifest import Expectations
from aiosync.core.wire import (
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    CollectivePlaneSpec,
    Commit,
    Complete,
    Goodbye,
    Hello,
    Message,
    Ready,
)
from aiosync.engine.sinks import WeightSink
from aiosync.handles.colocated import error_text
from aiosync.handles.metadata import MAX_TENSORS
from aiosync.handles.scratch import Scratch

log = logging.getLogger(__name__)


@dataclass
class GroupMembership:
    """An engine's membership of one side group: one executor (thread) per rank.

    ``plane``: the group as the engine's session sees it (the plane its hello names).
    """

    name: str
    ranks: list[int]
    executors: list[GroupExecutor]
    plane: CollectivePlaneSpec
    stores: list[AliasStore] = field(default_factory=list)
    """Kept alive with the group: NCCL reads the store again at its first collective, and
    a Python store whose object is gone answers torch with "Not implemented"."""
    scratch: list[Scratch] = field(default_factory=list)


@dataclass(frozen=True)
class BucketCall:
    """One call's bucket, checked and laid out, for ``version``, under ``deadline``."""

    version: int
    specs: list[TensorSpec]
    used: int
    flattened: bool
    deadline: Deadline


def receive(
    group: dist.ProcessGroup | None, scratch: Scratch, device: torch.device, call: BucketCall
) -> torch.Tensor:
    """One rank's receives of a bucket from rank 0 into its buffer (on the group's thread)."""
    if group is None:
        raise AiosyncError("the group is gone")
    buffer = scratch.get(call.used, device)
    if call.flattened:
        parts = [buffer[: call.used]] if call.used else []
    else:
        parts = [view_spec(buffer, spec) for spec in call.specs if spec.nbytes]
    ops.broadcast_many(group, parts, 0, call.deadline)
    return buffer


class BroadcastFeed:
    """The engine's session machine, fed by SGLang's bucket calls (see the module).

    Not thread-safe on its own: the engine calls it under its update lock.
    """

    def __init__(
        self, sinks: Sequence[WeightSink], name: str, *, timeout: float, max_bucket_bytes: int
    ) -> None:
        self.sinks = list(sinks)
        self.name = name
        limits = Limits(
            max_bucket_tensors=MAX_TENSORS,
            max_session_bytes=max(Limits().max_session_bytes, max_bucket_bytes),
            allow_rebase=True,
        )
        self.session = EngineSession(
            expectations=None,
            staged=all(sink.staged for sink in self.sinks),
            stream_timeout=timeout,
            session_timeout=timeout,
            limits=limits,
        )
        self._expected: list[Expectations | None] | None = None

    def open(self, group: GroupMembership) -> None:
        """Say the group's hello, once per session (the join, or again after a refusal ended it)."""
        if group.name in self.session.sessions:
            return
        hello = Hello(PROTOCOL, PROTOCOL, group.name, "trainer", group.plane)
        reply, _ = self._carry_out(self.session.receive(group.name, hello, time.monotonic()), group)
        if not isinstance(reply, Ready):
            raise RejectedError(_reason(reply), peer=self.name)

    def take(self, group: GroupMembership, call: BucketCall) -> int | None:
        """Receive and apply one bucket; the version it made live, or None.

        Raises :class:`RejectedError` with the machine's reason when the bucket (or its
        version) is refused or its receive or apply failed; the version is then dropped.
        """
        if self._expected is None:  # a sink says once what it takes
            self._expected = [sink.expectations() for sink in self.sinks]
            self.session.expectations = self._expected[0]
        self.open(group)
        peer, session = group.name, self.session
        stream = session.sessions[peer].stream
        if stream is not None and stream.version != call.version:
            why = f"version {stream.version} left unfinished for {call.version}"
            log.warning("%s: %s", self.name, why)
            self._say(group, Abort(why, stream.version))
            stream = None
        if stream is None:
            current, step = session.current_version, session.limits.max_version_step
            rebase = current is not None and not current < call.version <= current + step
            reply, _ = self._say(group, Begin(call.version, rebase=rebase))
            stream = session.sessions[peer].stream if peer in session.sessions else None
            if stream is None:
                self._skip(group, call)
                raise _refusal(reply)
        bucket = Bucket(call.version, stream.next_seq, 0, call.used, specs=call.specs)
        reply, applied = self._say(group, bucket, call)
        if not applied:
            self._skip(group, call)
        if not (isinstance(reply, Ack) and reply.ok):
            raise _refusal(reply)
        if any(e is not None and e.missing(stream.done) for e in self._expected):
            return None
        seq = stream.next_seq
        for message in (
            Complete(call.version, seq, stream.buckets, stream.tensors),
            Commit(call.version, seq + 1),
        ):
            reply, _ = self._say(group, message)
            if not (isinstance(reply, Ack) and reply.ok):
                raise _refusal(reply)
        return call.version

    def abandon(self, reason: str) -> None:
        """Drop any version in progress (another update path takes the sinks)."""
        for peer, session in list(self.session.sessions.items()):
            if session.stream is not None:
                abort = Abort(reason, session.stream.version)
                self._carry_out(self.session.receive(peer, abort, time.monotonic()), None)

    def leave(self, group_name: str) -> None:
        """End the group's session (its version in progress, if any, is dropped)."""
        session = self.session.sessions.get(group_name)
        if session is not None:
            goodbye = Goodbye(session.session)
            self._carry_out(self.session.receive(group_name, goodbye, time.monotonic()), None)

    # --- carrying out the machine's actions ------------------------------------------

    def _say(
        self, group: GroupMembership, message: Message, call: BucketCall | None = None
    ) -> tuple[Message | None, bool]:
        actions = self.session.receive(group.name, message, time.monotonic())
        return self._carry_out(actions, group, call)

    def _carry_out(
        self, actions: list[Action], group: GroupMembership | None, call: BucketCall | None = None
    ) -> tuple[Message | None, bool]:
        """Carry out ``actions`` and those they lead to: the last reply, whether it applied."""
        reply: Message | None = None
        applied = False
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, Reply):
                reply = action.message
            elif isinstance(action, OpenPlane):  # the plane is the group just joined
                pending.extend(self.session.plane_opened(action.peer))
            elif isinstance(action, Apply) and group is not None and call is not None:
                applied = True
                pending.extend(self._apply(action, group, call))
            elif isinstance(action, CommitSink) and group is not None:
                pending.extend(self._commit(action, group))
            elif isinstance(action, Discard):
                self._discard()
            elif isinstance(action, Note):
                log.info("%s: %s", self.name, action.text)
            # ClosePlane: the group stays until it is left; Committed: the session says
        return reply, applied

    def _on_ranks(
        self, group: GroupMembership, job: Callable[[int], object], deadline: Deadline, what: str
    ) -> None:
        """Run ``job(i)`` for every rank ``i`` on its own thread; raise the first failure."""
        futures = [ex.submit(functools.partial(job, i)) for i, ex in enumerate(group.executors)]
        for ex, future in zip(group.executors, futures, strict=True):
            ex.result(future, deadline=deadline, what=what, peers=["trainer"])

    def _apply(self, apply: Apply, group: GroupMembership, call: BucketCall) -> list[Action]:
        def job(i: int) -> None:
            sink, ex = self.sinks[i], group.executors[i]
            sink.apply_bucket(receive(ex.group, group.scratch[i], sink.device, call), apply.specs)

        try:
            self._on_ranks(group, job, call.deadline, "receiving a bucket")
        except Exception as exc:
            return self.session.apply_failed(apply.peer, apply.seq, AiosyncError(error_text(exc)))
        return self.session.applied(apply.peer, apply.seq, time.monotonic())

    def _skip(self, group: GroupMembership, call: BucketCall) -> None:
        """Join a refused bucket's broadcasts on every rank and drop the bytes."""

        def job(i: int) -> None:
            ex = group.executors[i]
            receive(ex.group, group.scratch[i], self.sinks[i].device, call)

        try:
            self._on_ranks(group, job, call.deadline, "receiving a refused bucket")
        except Exception as exc:
            log.warning("%s: receiving a refused bucket failed: %s", self.name, error_text(exc))

    def _commit(self, commit: CommitSink, group: GroupMembership) -> list[Action]:
        def job(i: int) -> None:
            self.sinks[i].commit(commit.version)

        try:
            self._on_ranks(group, job, Deadline.after(self.session.stream_timeout), "committing")
        except Exception as exc:
            error = AiosyncError(error_text(exc))
            return self.session.commit_failed(commit.peer, commit.version, error)
        return self.session.commit_done(commit.peer, commit.version, time.monotonic())

    def _discard(self) -> None:
        for sink in self.sinks:
            try:
                sink.abort()
            except Exception:
                log.exception("%s: abort of a sink failed", self.name)


def _reason(reply: Message | None) -> str:
    if isinstance(reply, Ack | Abort):
        return (reply.error if isinstance(reply, Ack) else reply.reason) or "refused"
    return "no answer"


def _refusal(reply: Message | None) -> RejectedError:
    tensor = reply.tensor if isinstance(reply, Ack) else None
    return RejectedError(_reason(reply), tensor=tensor)
