"""SGLang's per-bucket calls on the engine's side, fed to the engine's one session machine.

An SGLang engine learns a version one bucket at a time (``update_weights_from_distributed``,
then rank 0's broadcasts) and makes it live by itself once it holds all of it. A
:class:`BroadcastFeed` turns each call into the messages an
:class:`~aiosync.core.engine_session.EngineSession` takes (a group's first bucket says its
hello, a version's first bucket its begin; once the buckets cover what every sink requires,
its complete and commit follow) and carries out the actions the machine answers. Every
decision (what may follow what, what a bucket may hold, what a failure leaves servable, the
failures kept) is the machine's. SGLang's callers number versions as they like, so a version
the machine's rules would refuse restarts the numbering (``Begin.rebase``).

Every rank joins every broadcast of its group: a bucket the machine refuses is still
received and dropped, so the trainer and the other engines go on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    Peer,
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
)
from aiosync.engine.sinks import WeightSink
from aiosync.handles.colocated import error_text
from aiosync.handles.metadata import MAX_TENSORS
from aiosync.handles.scratch import Scratch

log = logging.getLogger(__name__)


@dataclass
class GroupMembership:
    """An engine's membership of one side group: one executor (thread) and buffer per rank.

    ``plane``: the group as its session's hello names it. ``stores`` are kept alive with
    the group: NCCL reads the store again at its first collective, and a Python store whose
    object is gone answers torch with "Not implemented".
    """

    name: str
    ranks: list[int]
    executors: list[GroupExecutor]
    plane: CollectivePlaneSpec
    stores: list[AliasStore]
    scratch: list[Scratch]


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
    """The engine's session machine (``session``), fed by SGLang's bucket calls.

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
        staged = all(sink.staged for sink in self.sinks)
        self.session = EngineSession(
            expectations=None,
            staged=staged,
            stream_timeout=timeout,
            session_timeout=timeout,
            limits=limits,
        )
        self._expected: list[Expectations] | None = None  # asked at the first bucket
        self._needed: list[set[str]] = []  # per sink, what the version in progress lacks

    def take(self, group: GroupMembership, call: BucketCall) -> int | None:
        """Receive and apply one bucket; the version it made live, or None.

        Raises :class:`RejectedError` with the machine's reason when the bucket or its
        version is refused, or its receive or apply failed (the version is then dropped).
        """
        if self._expected is None:  # a sink says once what it takes
            expected = [sink.expectations() for sink in self.sinks]
            self.session.expectations = expected[0]
            self._expected = [e for e in expected if e is not None]
        peer, session = group.name, self.session
        if peer not in session.sessions:
            self._say(group, Hello(PROTOCOL, PROTOCOL, peer, "trainer", group.plane))
        stream = session.sessions[peer].stream if peer in session.sessions else None
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
            self._needed = [{e.aliases.get(r, r) for r in e.required} for e in self._expected]
        bucket = Bucket(call.version, stream.next_seq, 0, call.used, specs=call.specs)
        reply, applied = self._say(group, bucket, call)
        if not applied:
            self._skip(group, call)
        if not (isinstance(reply, Ack) and reply.ok):
            raise _refusal(reply)
        for needed, takes in zip(self._needed, self._expected, strict=True):
            needed.difference_update(takes.canonical(spec.name) for spec in call.specs)
        if any(self._needed):  # the session checks it again when the version completes
            return None
        seq, counts = stream.next_seq, (stream.buckets, stream.tensors)
        for message in (Complete(call.version, seq, *counts), Commit(call.version, seq + 1)):
            reply, _ = self._say(group, message)
            if not (isinstance(reply, Ack) and reply.ok):
                raise _refusal(reply)
        return call.version

    def abandon(self, reason: str) -> None:
        """Drop any version in progress (another update path takes the sinks)."""
        for peer, sender in list(self.session.sessions.items()):
            if sender.stream is not None:
                self._carry_out(peer, Abort(reason, sender.stream.version), None)

    def leave(self, group_name: str) -> None:
        """End the group's session (a version in progress is dropped)."""
        sender = self.session.sessions.get(group_name)
        if sender is not None:
            self._carry_out(group_name, Goodbye(sender.session), None)

    # --- carrying out the machine's actions ------------------------------------------

    def _say(
        self, group: GroupMembership, message: Message, call: BucketCall | None = None
    ) -> tuple[Message | None, bool]:
        return self._carry_out(group.name, message, group, call)

    def _carry_out(
        self,
        peer: Peer,
        message: Message,
        group: GroupMembership | None,
        call: BucketCall | None = None,
    ) -> tuple[Message | None, bool]:
        """Give ``message`` to the machine, carry out what follows; its reply, and if applied."""
        reply: Message | None = None
        applied = False
        pending: deque[Action] = deque(self.session.receive(peer, message, time.monotonic()))
        while pending:
            action = pending.popleft()
            if isinstance(action, Reply):
                reply = action.message
            elif isinstance(action, OpenPlane):  # the plane is the group already joined
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

    def _received(self, group: GroupMembership, i: int, call: BucketCall) -> torch.Tensor:
        return receive(group.executors[i].group, group.scratch[i], self.sinks[i].device, call)

    def _apply(self, apply: Apply, group: GroupMembership, call: BucketCall) -> list[Action]:
        def job(i: int) -> None:
            self.sinks[i].apply_bucket(self._received(group, i, call), apply.specs)

        try:
            self._on_ranks(group, job, call.deadline, "receiving a bucket")
        except Exception as exc:
            return self.session.apply_failed(apply.peer, apply.seq, AiosyncError(error_text(exc)))
        return self.session.applied(apply.peer, apply.seq, time.monotonic())

    def _skip(self, group: GroupMembership, call: BucketCall) -> None:
        """Join a refused bucket's broadcasts on every rank and drop the bytes."""
        try:
            self._on_ranks(group, functools.partial(self._received, group, call=call),
                           call.deadline, "receiving a refused bucket")  # fmt: skip
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


def _refusal(reply: Message | None) -> RejectedError:
    """The error for a refusal: the machine's reason (an ack's, or a session's end)."""
    if isinstance(reply, Ack):
        return RejectedError(reply.error or "refused", tensor=reply.tensor)
    return RejectedError(reply.reason if isinstance(reply, Abort) else "no answer")
