"""One version's trip to a fleet of engines: begin, stream buckets, prepare, commit.

Stages run concurrently in one task group: a packer fills a free buffer (in a worker thread,
with the planning and message encoding of that bucket) and publishes it; per engine, a
sender task sends each bucket message and an acker task matches the engine's acks. A buffer
is free again once every live engine acked it, so the ring of buffers is the backpressure:
with ``N`` buffers at most ``N`` buckets are in flight, to every engine at once. Each bucket
is packed once, whatever the number of engines.

Commit is two-phase (:class:`~aiosync.core.trainer_session.FleetVote`): engines first report
the version complete and checked, then all are told to commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream as Receiving
from anyio.streams.memory import MemoryObjectSendStream as Sending

from aiosync.core.errors import (
    AiosyncError,
    MismatchError,
    PeerGoneError,
    SyncTimeoutError,
    breaks_session,
)
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.manifest import TensorMeta
from aiosync.core.trainer_session import EngineOutcome, FleetVote, Policy, Verdict
from aiosync.core.wire import Abort, Begin, Bucket, Commit, Complete, Slot, encode
from aiosync.pipeline.ledger import BufferLedger
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import ProgressCallback, SyncProgress, SyncReport
from aiosync.planes.base import SenderPlane
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

ABORT_TIMEOUT = 1.0
BEGIN = -1
"""The buffer index of the ``begin`` message when it travels in a link's send queue."""


@dataclass(frozen=True)
class _Packed:
    seq: int
    index: int
    payload: bytes
    plan: BucketPlan


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
    ) -> None:
        self.links = {link.name: link for link in links}
        self.plane = plane
        self.version = version
        self.manifest = manifest
        self._entries: dict[str, int] | None = None  # built in the packing thread
        self.vote = FleetVote(list(self.links), policy)
        self.progress = progress
        self.timeout = min(link.timeout for link in links)
        self._limiter = anyio.CapacityLimiter(1)
        self.sent_buckets = self.sent_tensors = 0
        self.acked = SyncProgress(version, 0, 0, 0)
        self._outcomes: dict[str, EngineOutcome] = {}
        self._started = time.perf_counter()

    # --- the whole version ------------------------------------------------------------

    async def run(self, plans: Iterator[BucketPlan]) -> SyncReport:
        """Stream every planned bucket to every engine, then commit under the policy."""
        try:
            begin = Begin(self.version, self.manifest)
            payload: bytes | None = await anyio.to_thread.run_sync(encode, begin)
            if not self._may_stream_before_accepted():
                await self._each(self._begin, payload)
                payload = None
            if self.vote.verdict() is not Verdict.ABORT:
                await self._stream(plans, payload)
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
        seq = self.sent_buckets + 1
        message = Complete(self.version, seq, self.sent_buckets, self.sent_tensors)
        await link.request(encode(message), seq, "completion check", self.version)
        self.vote.prepare(link.name)

    async def _commit(self, link: EngineLink) -> None:
        seq = self.sent_buckets + 2
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

    # --- streaming --------------------------------------------------------------------

    async def _stream(self, plans: Iterator[BucketPlan], begin: bytes | None) -> None:
        count = self.plane.count
        free_tx, free_rx = anyio.create_memory_object_stream[int](count)
        for index in range(count):
            free_tx.send_nowait(index)
        ledger: BufferLedger[BucketPlan] = BufferLedger()
        outboxes: dict[str, Sending[_Packed]] = {}
        async with free_tx, free_rx, anyio.create_task_group() as tg:
            for name in self.vote.live:
                tx, rx = anyio.create_memory_object_stream[_Packed](count)
                outboxes[name] = tx
                link = self.links[name]
                tg.start_soon(self._guard, tg, link, self._link_stage, rx, ledger, free_tx, begin)
            await self._pack_stage(plans, (free_tx, free_rx), ledger, outboxes)

    async def _pack_stage(
        self,
        plans: Iterator[BucketPlan],
        ring: tuple[Sending[int], Receiving[int]],
        ledger: BufferLedger[BucketPlan],
        outboxes: dict[str, Sending[_Packed]],
    ) -> None:
        freed, free = ring
        try:
            while self.vote.live:
                # Each engine's acks are awaited with the timeout, and a failed engine lets go
                # of its buffers; this bound is only a backstop, so it never fires first.
                with anyio.move_on_after(2 * self.timeout) as scope:
                    index = await free.receive()
                if scope.cancelled_caught:
                    held = ", ".join(self.vote.live)
                    raise SyncTimeoutError(
                        f"no buffer freed within {2 * self.timeout:g}s by {held}",
                        version=self.version,
                    )
                packed = await anyio.to_thread.run_sync(
                    self._pack_next, plans, index, limiter=self._limiter
                )
                if packed is None:
                    return
                await self.plane.publish(index, packed.plan.used)
                live = self.vote.live
                ledger.hold(index, live, packed.plan)
                for name in live:
                    try:
                        outboxes[name].send_nowait(packed)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        # the engine's stage is failing and not yet counted out: let go
                        if ledger.release(index, name) is not None:
                            freed.send_nowait(index)
        finally:
            for outbox in outboxes.values():
                outbox.close()

    def _pack_next(self, plans: Iterator[BucketPlan], index: int) -> _Packed | None:
        """Plan, pack and encode the next bucket into buffer ``index`` (a worker thread)."""
        try:
            plan = next(plans, None)
        except AiosyncError:
            raise
        except Exception as exc:
            raise MismatchError(f"cannot read the tensors: {exc}", version=self.version) from exc
        if plan is None:
            return None
        try:
            self.plane.pack(index, plan)
        except MismatchError as exc:  # names the tensor that failed
            raise MismatchError(exc.reason, version=self.version, tensor=exc.tensor) from exc
        except Exception as exc:
            names = ", ".join(spec.name for spec in plan.specs[:3])
            raise MismatchError(
                f"cannot pack ({names}): {exc}",
                version=self.version,
                tensor=plan.first_name,
            ) from exc
        plan.tensors.clear()  # packed: a generator's tensors may be freed now
        self.sent_buckets += 1
        self.sent_tensors += plan.whole_tensors
        seq = self.sent_buckets
        if self.manifest is not None:
            slots = [self._slot(spec) for spec in plan.specs]
            bucket = Bucket(self.version, seq, index, plan.used, slots=slots)
        else:
            bucket = Bucket(self.version, seq, index, plan.used, specs=plan.specs)
        return _Packed(seq, index, encode(bucket), plan)

    def _slot(self, spec: TensorSpec) -> Slot:
        if self._entries is None:
            self._entries = {meta.name: i for i, meta in enumerate(self.manifest or ())}
        entry = self._entries.get(spec.name)
        if entry is None:
            raise MismatchError("tensor is not in the version's manifest", tensor=spec.name)
        return Slot(entry, spec.offset, spec.nbytes, spec.start)

    async def _link_stage(
        self,
        link: EngineLink,
        outbox: Receiving[_Packed],
        ledger: BufferLedger[BucketPlan],
        free: Sending[int],
        begin: bytes | None,
    ) -> None:
        """Send every bucket to one engine and match its acks; gone: release its buffers.

        With ``begin``, the stream opens here, and the ack of the begin is the first awaited.
        """
        inflight_tx, inflight_rx = anyio.create_memory_object_stream[_Packed](self.plane.count + 1)
        try:
            if begin is not None:
                link.session.begin(self.version)
                await self._send_one(link, _Packed(0, BEGIN, begin, BucketPlan()), inflight_tx)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_loop, link, outbox, inflight_tx)
                await self._ack_loop(link, inflight_rx, ledger, free)
        except BaseException:
            for index, plan in ledger.drop(link.name):
                self._bucket_done(plan)
                free.send_nowait(index)
            raise

    async def _send_loop(
        self,
        link: EngineLink,
        outbox: Receiving[_Packed],
        inflight: Sending[_Packed],
    ) -> None:
        async with outbox, inflight:
            async for packed in outbox:
                await self._send_one(link, packed, inflight)

    async def _send_one(
        self, link: EngineLink, packed: _Packed, inflight: Sending[_Packed]
    ) -> None:
        tensor = packed.plan.first_name
        if link.window is not None:
            with anyio.move_on_after(self.timeout) as scope:
                await link.window.acquire()
            if scope.cancelled_caught:
                raise link.timeout_error("ack freeing a send slot", self.version, tensor)
        await link.send(packed.payload, "a bucket", self.version, tensor)
        link.session.sent(packed.seq)
        inflight.send_nowait(packed)

    async def _ack_loop(
        self,
        link: EngineLink,
        inflight: Receiving[_Packed],
        ledger: BufferLedger[BucketPlan],
        free: Sending[int],
    ) -> None:
        async with inflight:
            async for packed in inflight:
                tensor = packed.plan.first_name
                ack = await link.recv_ack("ack for a bucket", self.version, tensor)
                if link.window is not None:
                    link.window.release()
                if not ack.ok:
                    raise link.refusal(ack, "bucket" if packed.index != BEGIN else "version")
                if packed.index == BEGIN:
                    continue
                plan = ledger.release(packed.index, link.name)
                if plan is not None:
                    self._bucket_done(plan)
                    free.send_nowait(packed.index)

    def _bucket_done(self, plan: BucketPlan) -> None:
        done = self.acked
        tensors = plan.whole_tensors
        self.acked = SyncProgress(
            self.version, done.buckets + 1, done.tensors + tensors, done.bytes + plan.payload_bytes
        )
        if self.progress is not None:
            self.progress(self.acked)

    # --- outcome ----------------------------------------------------------------------

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
        done, order = self.acked, list(self.links)
        engines = tuple(sorted(self._outcomes.values(), key=lambda o: order.index(o.engine)))
        seconds = time.perf_counter() - self._started
        return SyncReport(self.version, done.buckets, done.tensors, done.bytes, seconds, engines)
