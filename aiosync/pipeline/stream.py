"""One version's trip to a fleet of engines: begin, stream buckets, prepare, commit.

The buckets go out through a :class:`~aiosync.pipeline.fanout.BucketFanout` (each packed
once, read by every engine). Commit is two-phase
(:class:`~aiosync.core.trainer_session.FleetVote`): engines first report the version
complete and checked, then all are told to commit; what a failure does depends on the
:class:`~aiosync.core.trainer_session.Policy`. Each engine's ``complete`` follows its last
bucket without waiting for acks; where its commit can depend on nothing but its own
completion check (one engine, or policy ``available``), the ``commit`` follows too (see
:meth:`StreamRun._tail_ends` and docs/protocol.md, "Messages that go without waiting").
An engine that holds the version already (a retry) is sent nothing and reported
``current``; one that goes silent with its commit sent is reported ``in doubt``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace

import anyio

from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    RejectedError,
    SyncTimeoutError,
    breaks_session,
)
from aiosync.core.layout import BucketPlan
from aiosync.core.trainer_session import EngineOutcome, FleetVote, Policy, Verdict
from aiosync.core.wire import Abort, Commit, Complete, encode
from aiosync.pipeline.begin import begin_is_cheap, encode_begin
from aiosync.pipeline.fanout import BucketFanout
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import SyncProgress, SyncReport, link_failure
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.planes.base import SenderPlane
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

ABORT_TIMEOUT = 1.0


def streams_before_accepted(engines: int, policy: Policy) -> bool:
    """Whether a version to ``engines`` under ``policy`` streams before its begin is accepted.

    See :meth:`StreamRun._may_stream_before_accepted`.
    """
    return engines == 1 or policy is Policy.AVAILABLE


def may_begin_early(engines: int, policy: Policy, plane: SenderPlane) -> bool:
    """Whether a ``begin`` sent before the read may open a run (its ``begun=``).

    Where buckets may follow the ``begin`` before it is accepted, and only there; not for
    a collective plane (:attr:`~aiosync.planes.base.SenderPlane.joins_all`: each engine
    joins every broadcast of the group, and the ``begin`` is part of that choreography).
    """
    return streams_before_accepted(engines, policy) and not plane.joins_all


class StreamRun:
    """Streams one version (``spec``) to ``links`` through ``plane``; :meth:`run` reports or raises.

    The engines' vote on it follows ``policy``.
    """

    def __init__(
        self, *, links: list[EngineLink], plane: SenderPlane, policy: Policy, spec: VersionSpec
    ) -> None:
        self.links = {link.name: link for link in links}
        self.plane = plane
        self.spec = spec
        self.version = spec.version
        self.manifest = spec.manifest
        self.flags = {"empty": spec.empty, "rebase": spec.rebase}
        self._first = spec.first  # bucket 1, packed while the version was read
        self._begun = spec.begun  # the begin sent before the read (pipeline.early_begin)
        self.vote = FleetVote(list(self.links), policy)
        self.progress = spec.progress
        self._fanout: BucketFanout | None = None
        self._outcomes: dict[str, EngineOutcome] = {}
        self._at_once = False  # each engine's commit follows its complete (see below)
        self._ends_sent: dict[str, int] = {}  # per engine: complete (1) and commit (2) sent
        # the send's start (before the sender read its tensors), for the report's seconds
        self._started = time.perf_counter() if spec.started is None else spec.started

    # --- the whole version ------------------------------------------------------------

    async def run(self, plans: Iterator[BucketPlan]) -> SyncReport:
        """Stream every planned bucket to every engine, then commit under the policy.

        An engine known to hold the version already (a retry) is sent nothing.
        """
        for link in self.links.values():
            if not self.flags["rebase"] and link.session.remote_version == self.version:
                self.vote.hold(link.name)
                self._outcomes[link.name] = EngineOutcome(link.name, "current", self.version)
        try:
            if self.vote.live:
                await self._send_version(plans)
        except BaseException:
            await self._abort("the sender abandoned the version mid-stream")
            raise
        if self.vote.verdict() is not Verdict.COMMIT:
            await self._abort("another engine failed")
            raise self.vote.failure(self.version)
        due = [name for name in self.vote.prepared if name not in self._outcomes]
        await self._each(self._commit, only=due)
        return self._report()

    async def _send_version(self, plans: Iterator[BucketPlan]) -> None:
        """Begin, stream and complete the version (and commit it, where that goes at once)."""
        if self._begun is not None:  # every link's stream is open, its begin sent
            payload: bytes | None = self._begun
        elif begin_is_cheap(self.manifest):
            payload = self._begin_message()  # no thread hop
        else:
            payload = await anyio.to_thread.run_sync(self._begin_message)
        opening = None
        if self._begun is None and not self._may_stream_before_accepted():
            opening = functools.partial(self._each, self._begin, payload)
            payload = None  # (bucket 1 is packed meanwhile)
        self._at_once = self._may_commit_at_once()
        if self.vote.verdict() is not Verdict.ABORT:
            await self._stream(plans, payload, opening)
        if self.spec.check_snapshot is not None:  # before any engine may commit
            await anyio.to_thread.run_sync(self.spec.check_snapshot)
        if self.vote.verdict() is not Verdict.ABORT:
            await self._each(self._complete_and_commit if self._at_once else self._complete)

    def _begin_message(self) -> bytes:
        """The encoded ``begin``; without the manifest when an engine could not take it.

        A version past an engine's limits on manifest size still streams: each bucket then
        names its tensors, and the engine checks coverage when the version completes.
        """
        limits = [link.session.limits for link in self.links.values()]
        payload, self.manifest = encode_begin(self.version, self.manifest, self.flags, limits)
        return payload

    def _may_stream_before_accepted(self) -> bool:
        """Whether buckets may follow ``begin`` before the engines accepted it.

        An engine never applies a bucket of a version it has not accepted, so streaming
        at once costs nothing to an engine that refuses; it saves the round trip and the
        engine's check of the manifest. But under policy ``all`` with several engines, the
        others would apply (in place) part of a version that one refusal dooms, so there
        every engine accepts first (while bucket 1 is packed, not yet published); and so
        for a version sent step by step (:attr:`VersionSpec.stepwise`).
        """
        if self.spec.stepwise:
            return False
        return streams_before_accepted(len(self.vote.live), self.vote.policy)

    def _may_commit_at_once(self) -> bool:
        """Whether each engine's ``commit`` may follow its ``complete`` before the ack.

        Two phases exist so that no engine commits before every required engine
        prepared. With one engine, or under policy ``available``, the vote's decision for
        an engine is its own completion check and nothing else: it commits if and only if
        it prepared. The engine answers its messages in order, and refuses a ``commit``
        of a stream whose completion check failed ("stream already failed", nothing made
        live), so sending both at once decides exactly as two phases would, one round
        trip sooner. Not where :meth:`_ends_may_go_early` says no, nor for a version sent
        step by step (:attr:`VersionSpec.stepwise`).
        """
        if self.spec.stepwise or not self._ends_may_go_early():
            return False
        return len(self.vote.live) == 1 or self.vote.policy is Policy.AVAILABLE

    def _ends_may_go_early(self) -> bool:
        """Whether closing messages may go before acks (no REQ socket, no topology vote)."""
        if type(self)._complete is not StreamRun._complete:
            return False
        return all(self.links[name].window is None for name in self.vote.live)

    async def _each(
        self, step: Callable[..., object], *args: object, only: list[str] | None = None
    ) -> None:
        """Run ``step(link, *args)`` for every live engine at once; failures go to the vote.

        Every engine's answer is awaited (each wait is bounded), so an error names every
        engine that refused, not just the first.
        """
        async with anyio.create_task_group() as tg:
            for name in only if only is not None else self.vote.live:
                tg.start_soon(self._guard, None, self.links[name], step, *args)

    async def _guard(
        self,
        tg: anyio.abc.TaskGroup | None,
        link: EngineLink,
        step: Callable[..., object],
        *args: object,
    ) -> None:
        """Run one engine's step; a failure goes to the vote.

        Once the version is hopeless, ``tg`` (the other engines' streaming) is cancelled.
        """
        try:
            await step(link, *args)  # type: ignore[misc]
        except BaseException as raised:
            exc = unwrap_group(raised)  # a link's own stages fail as a group
            if not isinstance(exc, AiosyncError):
                raise
            self._link_failed(link, exc)
            if tg is not None and self.vote.hopeless:
                tg.cancel_scope.cancel()

    def _link_failed(self, link: EngineLink, exc: AiosyncError) -> None:
        log.warning("engine %s failed version %d: %s", link.name, self.version, exc)
        doubt = isinstance(exc, SyncTimeoutError) and link.session.commit_pending
        link.session.failed()
        held = link.session.remote_version == self.version and not self.flags["rebase"]
        if held and isinstance(exc, RejectedError):
            self.vote.hold(link.name)  # its refusal was of a version it turned out to hold
            self._outcomes[link.name] = EngineOutcome(link.name, "current", self.version)
            return
        broken = breaks_session(exc) or link.window is not None
        exc = link_failure(link.name, self.version, exc, doubt=doubt, leaves=broken)
        if link.name in self.vote.prepared:  # the decision was commit: it is just late
            self.vote.lose(link.name, exc)
            status = "in doubt" if doubt else "lost after prepare"
            self._outcomes[link.name] = self._outcome(link, status, exc)
        else:
            self.vote.fail(link.name, exc)
        if broken:
            link.broken = exc

    # --- phases -----------------------------------------------------------------------

    async def _begin(self, link: EngineLink, payload: bytes) -> None:
        link.session.begin(self.version, rebase=self.flags["rebase"])
        await link.request(payload, 0, "the version's manifest", self.version)

    async def _complete(self, link: EngineLink) -> None:
        if self._ends_sent.get(link.name):  # sent after the last bucket: the ack is due
            ack = await link.recv_ack("ack for completion check", self.version)
            if not ack.ok:
                raise link.refusal(ack, "completion check")
        else:
            sent = self._sent()
            seq = sent.buckets + 1
            message = Complete(self.version, seq, sent.buckets, sent.tensors)
            await link.request(encode(message), seq, "completion check", self.version)
        self.vote.prepare(link.name)

    def _tail_ends(self) -> int:
        """What each engine is sent right after its last bucket, without waiting for acks.

        2: ``complete`` and ``commit`` (:meth:`_may_commit_at_once`, and no snapshot check
        stands between the packing and a commit); 1: ``complete`` only (a prepare commits
        nothing: the vote, or the snapshot check, still comes before any commit); 0: none
        (:meth:`_ends_may_go_early`). A collective plane (``joins_all``) sends its
        ``commit`` only after the plane's ``drain``: NCCL pairs broadcasts by their order,
        so an engine whose receives all ended may still hold another version's bytes (a
        broadcast a failed version left queued pairs with the next version's first
        receive, and every later one shifts); the trainer's own broadcasts all ending is
        what shows they were paired with this version's receives.
        """
        if not self._ends_may_go_early():
            return 0
        if self.plane.joins_all:
            return 1  # the commit waits for the drain (see above)
        return 2 if self._at_once and self.spec.check_snapshot is None else 1

    async def _send_ends(self, link: EngineLink, upto: int) -> None:
        """Send ``link`` its ``complete`` (1) and then ``commit`` (2), up to ``upto``.

        No ack is awaited, and what went already is not sent again. The fanout calls this
        right after the link's last bucket: the engine takes its messages in order, so it
        checks the version whole only after applying every bucket, and its completion
        check counts what it applied, so nothing short is ever prepared.
        """
        if link.name not in self.vote.live:
            return
        done = self._ends_sent.get(link.name, 0)
        sent = self._sent()
        seq = sent.buckets + 1
        if done < 1 <= upto:
            self._ends_sent[link.name] = 1
            complete = encode(Complete(self.version, seq, sent.buckets, sent.tensors))
            await link.send(complete, "completion check", self.version)
            link.session.sent(seq)
        if done < 2 <= upto:
            self._ends_sent[link.name] = 2
            commit = Commit(self.version, seq + 1, link.commit_deadline())
            await link.send(encode(commit), "commit", self.version)
            link.session.sent_commit(seq + 1)

    async def _complete_and_commit(self, link: EngineLink) -> None:
        """``complete`` and ``commit`` sent together; prepared, then committed, by their acks.

        A refused completion raises (the commit's ack is then a leftover the link skips);
        a refused commit after a good completion is an engine lost after prepare.
        """
        await self._send_ends(link, 2)  # what the fanout did not send after the last bucket
        ack = await link.recv_ack("ack for completion check", self.version)
        if not ack.ok:
            raise link.refusal(ack, "completion check")
        self.vote.prepare(link.name)
        ack = await link.recv_ack("ack for commit", self.version)
        if not ack.ok:
            raise link.refusal(ack, "commit")
        link.session.committed()
        self._outcomes[link.name] = self._outcome(link, "committed")

    async def _commit(self, link: EngineLink) -> None:
        seq = self._sent().buckets + 2
        commit = encode(Commit(self.version, seq, link.commit_deadline()))
        await link.request(commit, seq, "commit", self.version, commit=True)
        link.session.committed()
        self._outcomes[link.name] = self._outcome(link, "committed")

    async def _abort(self, reason: str) -> None:
        """Tell every engine that may hold part of this version to drop it (best effort)."""
        message = encode(Abort(reason, self.version))
        for link in self.links.values():
            if link.broken is not None or link.name in self._outcomes:
                continue
            link.session.failed()
            if link.window is not None:  # a REQ socket cannot send unasked
                link.broken = PeerGoneError("stream abandoned on a REQ socket", peer=link.name)
                continue
            with anyio.move_on_after(ABORT_TIMEOUT, shield=True):
                try:
                    await link.channel.send(message)
                except AiosyncError as exc:
                    log.warning("could not tell %s to abort: %s", link.name, exc)

    async def _stream(
        self,
        plans: Iterator[BucketPlan],
        begin: bytes | None,
        opening: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        ends = self._tail_ends()
        fanout = BucketFanout(
            links=self.links,
            plane=self.plane,
            vote=self.vote,
            guard=self._guard,
            tail=functools.partial(self._send_ends, upto=ends) if ends else None,
            spec=replace(self.spec, manifest=self.manifest, first=None),
        )
        self._fanout = fanout
        first, self._first = self._first, None
        await fanout.run(plans, begin, opening, first)

    # --- outcome ----------------------------------------------------------------------

    def _sent(self) -> SyncProgress:
        """What went out (buckets and tensors the engines should have)."""
        fanout = self._fanout
        if fanout is None:
            return SyncProgress(self.version, 0, 0, 0)
        return SyncProgress(self.version, fanout.sent_buckets, fanout.sent_tensors, 0)

    def _outcome(
        self, link: EngineLink, status: str, error: AiosyncError | None = None
    ) -> EngineOutcome:
        committed = status == "committed"
        seconds = time.perf_counter() - self._started if committed else None
        version = self.version if committed else link.session.remote_version
        return EngineOutcome(
            link.name, status, version, seconds, None if error is None else str(error)
        )

    def _report(self) -> SyncReport:
        for name, error in self.vote.failed.items():
            self._outcomes[name] = self._outcome(self.links[name], "failed", error)
        if not any(o.status in ("committed", "current") for o in self._outcomes.values()):
            raise self.vote.failure(self.version)
        done = self._fanout.acked if self._fanout else SyncProgress(self.version, 0, 0, 0)
        order = list(self.links)
        engines = tuple(sorted(self._outcomes.values(), key=lambda o: order.index(o.engine)))
        seconds = time.perf_counter() - self._started
        direct = self._fanout.direct_bytes if self._fanout else 0
        return SyncReport(
            self.version, done.buckets, done.tensors, done.bytes, seconds, engines, direct
        )
