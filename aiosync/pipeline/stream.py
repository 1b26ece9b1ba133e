"""One version's trip to a fleet of engines: begin, stream buckets, prepare, commit.

The buckets go out through a :class:`~aiosync.pipeline.fanout.BucketFanout` (each packed
once, read by every engine). Commit is two-phase
(:class:`~aiosync.core.trainer_session.FleetVote`): engines first report the version
complete and checked, then all are told to commit; what a failure does depends on the
:class:`~aiosync.core.trainer_session.Policy`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import anyio

from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    breaks_session,
)
from aiosync.core.layout import BucketPlan
from aiosync.core.manifest import TensorMeta
from aiosync.core.trainer_session import EngineOutcome, FleetVote, Policy, Verdict
from aiosync.core.wire import Abort, Begin, Commit, Complete, encode
from aiosync.pipeline.fanout import BucketFanout
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import ProgressCallback, SyncProgress, SyncReport
from aiosync.planes.base import SenderPlane
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

ABORT_TIMEOUT = 1.0


class StreamRun:
    """Streams one version to ``links`` through ``plane``; :meth:`run` reports or raises."""

    def __init__(
        self,
        *,
        links: list[EngineLink],
        plane: SenderPlane,
        version: int,
        manifest: list[TensorMeta] | None,
        policy: Policy,
        progress: ProgressCallback | None = None,
        empty: bool = False,
        rebase: bool = False,
        packed: anyio.Event | None = None,
        check_snapshot: Callable[[], None] | None = None,
        started: float | None = None,
    ) -> None:
        self.links = {link.name: link for link in links}
        self.plane = plane
        self.version = version
        self.manifest = manifest
        self.flags = {"empty": empty, "rebase": rebase}
        self._packed = packed
        self._check_snapshot = check_snapshot
        self.vote = FleetVote(list(self.links), policy)
        self.progress = progress
        self._fanout: BucketFanout | None = None
        self._outcomes: dict[str, EngineOutcome] = {}
        # the send's start (before the sender read its tensors), for the report's seconds
        self._started = time.perf_counter() if started is None else started

    # --- the whole version ------------------------------------------------------------

    async def run(self, plans: Iterator[BucketPlan]) -> SyncReport:
        """Stream every planned bucket to every engine, then commit under the policy."""
        try:
            payload: bytes | None = await anyio.to_thread.run_sync(self._begin_message)
            if not self._may_stream_before_accepted():
                await self._each(self._begin, payload)
                payload = None
            if self.vote.verdict() is not Verdict.ABORT:
                await self._stream(plans, payload)
            if self._check_snapshot is not None:  # before any engine may commit
                await anyio.to_thread.run_sync(self._check_snapshot)
            if self.vote.verdict() is not Verdict.ABORT:
                await self._each(self._complete)
        except BaseException:
            await self._abort("the trainer failed mid-stream")
            raise
        if self.vote.verdict() is not Verdict.COMMIT:
            await self._abort("another engine failed")
            raise self.vote.failure(self.version)
        await self._each(self._commit, only=list(self.vote.prepared))
        return self._report()

    def _begin_message(self) -> bytes:
        """The encoded ``begin``; without the manifest when an engine could not take it.

        A version past an engine's limits on manifest size still streams: each bucket then
        names its tensors, and the engine checks coverage when the version completes.
        """
        payload = encode(Begin(self.version, self.manifest, **self.flags))
        limits = [link.session.limits for link in self.links.values()]
        too_many = len(self.manifest or ()) > min(x.max_manifest_tensors for x in limits)
        if self.manifest is not None and (
            too_many or len(payload) > min(x.max_message_bytes for x in limits)
        ):
            log.info("version %d goes without a manifest (past an engine's limits)", self.version)
            self.manifest = None
            payload = encode(Begin(self.version, None, **self.flags))
        return payload

    def _may_stream_before_accepted(self) -> bool:
        """Whether buckets may follow ``begin`` before the engines accepted it.

        An engine never applies a bucket of a version it has not accepted, so streaming
        at once costs nothing to an engine that refuses; it saves the round trip and the
        engine's check of the manifest. But under policy ``all`` with several engines, the
        others would apply (in place) part of a version that one refusal dooms, so there
        every engine accepts first.
        """
        return len(self.links) == 1 or self.vote.policy is Policy.AVAILABLE

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
        link.session.failed()
        if exc.peer is None or exc.version is None:  # say which engine and which version
            exc = type(exc)(
                exc.reason, peer=exc.peer or link.name, version=self.version, tensor=exc.tensor
            )
        if link.name in self.vote.prepared:  # the decision was commit: it is just late
            self.vote.lose(link.name, exc)
            self._outcomes[link.name] = self._outcome(link, "lost after prepare", exc)
        else:
            self.vote.fail(link.name, exc)
        if breaks_session(exc) or link.window is not None:
            link.broken = exc

    # --- phases -----------------------------------------------------------------------

    async def _begin(self, link: EngineLink, payload: bytes) -> None:
        link.session.begin(self.version)
        await link.request(payload, 0, "the version's manifest", self.version)

    async def _complete(self, link: EngineLink) -> None:
        sent = self._sent()
        seq = sent.buckets + 1
        message = Complete(self.version, seq, sent.buckets, sent.tensors)
        await link.request(encode(message), seq, "completion check", self.version)
        self.vote.prepare(link.name)

    async def _commit(self, link: EngineLink) -> None:
        seq = self._sent().buckets + 2
        await link.request(encode(Commit(self.version, seq)), seq, "commit", self.version)
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

    async def _stream(self, plans: Iterator[BucketPlan], begin: bytes | None) -> None:
        fanout = BucketFanout(
            links=self.links,
            plane=self.plane,
            version=self.version,
            manifest=self.manifest,
            vote=self.vote,
            guard=self._guard,
            progress=self.progress,
            packed=self._packed,
        )
        self._fanout = fanout
        await fanout.run(plans, begin)

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
        if not any(o.status == "committed" for o in self._outcomes.values()):
            raise self.vote.failure(self.version)
        done = self._fanout.acked if self._fanout else SyncProgress(self.version, 0, 0, 0)
        order = list(self.links)
        engines = tuple(sorted(self._outcomes.values(), key=lambda o: order.index(o.engine)))
        seconds = time.perf_counter() - self._started
        direct = self._fanout.direct_bytes if self._fanout else 0
        return SyncReport(
            self.version, done.buckets, done.tensors, done.bytes, seconds, engines, direct
        )
