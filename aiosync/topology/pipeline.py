"""A colocated topology on the native pipeline: each engine's source rank runs a stream.

Every covered rank owns a ring of buffers (its own plane); once per session their specs
are gathered to the engine's source rank, which opens an ordinary session with the engine
(a :class:`~aiosync.WeightReceiver` over a :class:`~aiosync.topology.sink.RankedSink`)
whose plane is all of them (:class:`~aiosync.core.wire.GatheredPlaneSpec`). Per version:

1. each rank plans its tensors (manifest and buckets, no copy) and the plans are gathered
   to the source (msgpack in ``uint8`` tensors, never pickled);
2. the source runs a :class:`~aiosync.pipeline.stream.StreamRun` with one link: the
   manifest (the union of the ranks', names ``"<i>/<name>"``) goes first and the engine
   checks it whole; each pipeline bucket is one rank's share of a bucket, and packing it
   (:meth:`ColocatedSession._pack_part`) broadcasts to the engine's ranks which rank packs
   which bucket into which of its buffers, then gathers that rank's result;
3. once its engine prepared the version, the source tells its ranks the buckets are over,
   and all covered ranks meet in one all-reduce of per-engine failure flags (the fleet's
   vote across engines): under policy ``all`` an engine commits only if every engine
   prepared, under ``available`` each prepared engine commits;
4. a last all-reduce tells every covered rank which engines committed.

A source failing before its vote still joins it (marked failed): no rank is left in a
collective. Collectives have the groups' timeout, the engine link :data:`LINK_SHARE` of it.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import msgspec
import torch
import torch.distributed as dist

from aiosync.channels.base import Channel
from aiosync.core.colocated_parts import MAX_ERROR_CHARS, MAX_PART_BYTES
from aiosync.core.errors import AiosyncError, MismatchError, ProtocolError, RejectedError
from aiosync.core.layout import BucketPlan, calculate_aligned_size
from aiosync.core.trainer_session import LinkSession, Policy
from aiosync.core.wire import (
    GOODBYE_SEQ,
    Ack,
    Complete,
    CudaPlaneSpec,
    GatheredPlaneSpec,
    Goodbye,
    ShmPlaneSpec,
    decode,
    encode,
)
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import SyncReport
from aiosync.pipeline.stream import StreamRun
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.planes import SenderPlane, create_sender_plane
from aiosync.planes.gathered import GatheredSenderPlane
from aiosync.runtime import unwrap_group
from aiosync.topology.gather import agree_on_failures, broadcast_ints, gather_bytes
from aiosync.topology.plans import plan_rank, union_plans

log = logging.getLogger(__name__)

LINK_SHARE = 0.4
"""Share of the groups' timeout a wait on the engine takes (a rank's wait spans two at most)."""

PACK, END = 1, 2
PartSpec = ShmPlaneSpec | CudaPlaneSpec


@dataclass(frozen=True)
class TopologyReport:
    """One covered rank's view of a version: which engines committed and which failed.

    ``sync`` is the pipeline's report on a source rank whose engine committed.
    """

    rank: int
    engine: int | None
    version: int | None
    committed: tuple[int, ...]
    failed: tuple[int, ...]
    sync: SyncReport | None = None


class _Run(StreamRun):
    """A stream whose prepare phase ends with the vote across the topology's engines."""

    def __init__(self, session: ColocatedSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._session = session

    async def _complete(self, link: EngineLink) -> None:
        """The engine prepares; then the vote across engines, before it counts as prepared."""
        sent = self._sent()
        seq = sent.buckets + 1
        message = Complete(self.version, seq, sent.buckets, sent.tensors)
        await link.request(encode(message), seq, "completion check", self.version)
        failed = await self._session._vote(prepared=True)
        if failed and self.vote.policy is Policy.ALL:
            raise RejectedError(
                f"engines {failed} did not prepare: none commits under policy 'all'",
                peer=link.name,
                version=self.version,
            )
        self.vote.prepare(link.name)


class ColocatedSession:
    """Every covered rank's session with its engine through the native pipeline.

    ``worker_state`` is what :func:`~aiosync.topology.connect_topology` filled;
    ``engines[i]`` is engine ``i``'s endpoint or channel (read on its source rank only).
    Each rank keeps ``num_buffers`` buffers of ``buffer_bytes`` on ``device``. Each wait on
    the engine gets ``link_timeout`` seconds, at most (and by default) :data:`LINK_SHARE` of
    the groups' timeout. Use as ``async with`` on every rank; placeholder ranks do nothing.
    """

    def __init__(
        self,
        worker_state: dict[str, Any],
        engines: Sequence[str | Channel | None],
        *,
        device: torch.device | str = "cpu",
        buffer_bytes: int = 64 << 20,
        num_buffers: int = 2,
        policy: Policy | str = Policy.ALL,
        link_timeout: float | None = None,
    ) -> None:
        self.layout = worker_state["_ipc_layout"]
        self.index: int | None = worker_state["_ipc_engine_index"]
        self.group = worker_state["_ipc_gather_group"]
        self.sync = worker_state["_ipc_sync_group"]
        src = worker_state["_ipc_gather_src"]
        self.src: int = -1 if src is None else src  # -1: a placeholder rank
        most = LINK_SHARE * worker_state["_ipc_timeout"]
        self.link_timeout: float = most if link_timeout is None else min(link_timeout, most)
        self.rank = dist.get_rank()
        self.engines = list(engines)
        self.device = torch.device(device)
        self.capacity = calculate_aligned_size(buffer_bytes)
        self.count = num_buffers
        self.policy = Policy(policy)
        self.pos = self.rank - self.src  # my place in the engine's range
        self._plane: SenderPlane | None = None
        self._gathered: GatheredSenderPlane | None = None
        self.link: EngineLink | None = None
        self._owned: Channel | None = None
        self._local: list[BucketPlan | None] = []  # my buckets, until packed
        self._where: dict[int, tuple[int, int]] = {}  # a pipeline bucket's (rank, bucket)
        self._ended = self._voted = False
        self._unprepared: list[int] = []  # engines that did not prepare the last version

    @property
    def source(self) -> bool:
        """Whether this rank runs its engine's stream."""
        return self.src == self.rank

    async def _call(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """A blocking call (a collective, packing) in a worker thread, never abandoned."""
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))

    async def _agree(self, flags: list[bool]) -> list[bool]:
        return list(await self._call(agree_on_failures, flags, group=self.sync))

    # --- the session ------------------------------------------------------------------

    async def __aenter__(self) -> ColocatedSession:
        if self.index is None:
            return self
        failure: str | None = None
        try:
            self._plane = await self._call(
                create_sender_plane, self.device, self.count, self.capacity
            )
            mine = msgspec.msgpack.encode(self._plane.spec)
        except (AiosyncError, OSError, RuntimeError, ValueError) as exc:
            failure, mine = f"rank {self.rank} cannot make its buffers: {exc}", b""
        try:
            specs = await self._call(
                gather_bytes, mine, group=self.group, dst=self.src, max_bytes=MAX_PART_BYTES
            )
            if specs is not None and failure is None:
                await self._open(specs)
        except AiosyncError as exc:
            failure = failure or str(exc)
        flags = [False] * len(self.layout.engines)
        flags[self.index] = failure is not None
        agreed = await self._agree(flags)
        if any(agreed):
            await self._close()
            bad = [i for i, f in enumerate(agreed) if f]
            raise RejectedError(f"engines {bad} could not open their sessions: {failure or ''}")
        return self

    async def _open(self, specs: list[bytes]) -> None:
        """The source: every rank's plane in one gathered spec, and the engine's session."""
        if any(not data for data in specs):
            raise RejectedError("a rank of this engine could not make its buffers")
        parts = [msgspec.msgpack.decode(data, type=PartSpec) for data in specs]
        if any(len(part.sizes) != self.count for part in parts):
            raise ProtocolError("a rank's plane has another number of buffers")
        spec = GatheredPlaneSpec(parts)
        self._gathered = GatheredSenderPlane(spec, self.count, self.capacity, self._pack_part)
        at = self.index or 0
        target = self.engines[at] if at < len(self.engines) else None
        if isinstance(target, str):
            from aiosync.channels.zmq import ZmqChannel

            channel: Channel = ZmqChannel.connect(target)
            self._owned = channel
        elif target is None:
            raise RejectedError(f"no endpoint given for engine {self.index}")
        else:
            channel = target
        session = LinkSession(channel.peer, uuid.uuid4().hex)
        link = EngineLink(channel, session, self.link_timeout)
        await link.handshake(session.hello(f"colocated-rank-{self.rank}", spec))
        self.link = link

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.index is None:
            return
        with anyio.CancelScope(shield=True):
            if self.link is not None and self.link.broken is None:
                with anyio.move_on_after(self.link.timeout):
                    try:
                        await self.link.channel.send(encode(Goodbye(self.link.session.session)))
                        while not _is_goodbye_ack(await self.link.channel.recv()):
                            pass
                    except AiosyncError as exc_:
                        log.info("goodbye to engine %d failed: %s", self.index, exc_)
            try:  # the ranks keep their buffers until the engine let go of them
                await self._agree([False] * len(self.layout.engines))
            except AiosyncError as exc_:
                log.warning("rank %d: closing the session: %s", self.rank, exc_)
            await self._close()

    async def _close(self) -> None:
        if self._owned is not None:
            await self._owned.aclose()
            self._owned = None
        if self._plane is not None:
            self._plane.close()
            self._plane = None

    # --- one version ------------------------------------------------------------------

    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: int | None = None,
    ) -> TopologyReport:
        """Send this rank's tensors as part of one version; every covered rank calls it.

        ``weight_version`` is the version the engines get; None: each engine moves to
        the version after its own. Raises :class:`RejectedError` naming the failed
        engines where the policy says the version failed (on every covered rank alike).
        """
        if self.index is None:
            return TopologyReport(self.rank, None, weight_version, (), ())
        self._ended = self._voted = False
        self._unprepared = []
        payload, self._local = await self._call(
            plan_rank, list(named_tensors), self.capacity, self.rank
        )
        plans = await self._call(
            gather_bytes, payload, group=self.group, dst=self.src, max_bytes=MAX_PART_BYTES
        )
        sync: SyncReport | None = None
        error: AiosyncError | None = None
        version = weight_version
        try:
            if plans is not None:
                version, sync, error = await self._lead(plans, weight_version)
            else:
                await self._follow()
        finally:
            self._local, self._where = [], {}
            if self.source and not self._ended:  # it failed before telling its ranks
                await self._call(self._command, END, 0, 0, 0)
            if not self._voted:
                await self._vote(prepared=False)
        flags = [False] * len(self.layout.engines)
        flags[self.index] = self.source and sync is None
        failed = [i for i, f in enumerate(await self._agree(flags)) if f]
        committed = tuple(i for i in range(len(flags)) if i not in failed)
        if failed and (self.policy is Policy.ALL or not committed):
            held = [i for i in failed if i not in self._unprepared]
            own = f" ({error})" if error is not None else ""
            raise RejectedError(
                f"engines {self._unprepared or failed} failed the version"
                + (f", so engines {held} did not commit it" if held else "")
                + own,
                version=version,
            )
        return TopologyReport(self.rank, self.index, version, committed, tuple(failed), sync)

    async def _lead(
        self, gathered: list[bytes], weight_version: int | None
    ) -> tuple[int | None, SyncReport | None, AiosyncError | None]:
        """The source: stream the union of the ranks' plans to the engine, one link."""
        assert self.link is not None
        assert self._gathered is not None
        remote = self.link.session.remote_version
        version = weight_version
        if version is None:  # the engine's numbering: the version after its own
            version = 0 if remote is None else remote + 1
        try:
            manifest, plans, places = union_plans(gathered, self.rank, self.capacity)
            self._where = {id(p): place for p, place in zip(plans, places, strict=True)}
            run = _Run(
                self,
                links=[self.link],
                plane=self._gathered,
                policy=self.policy,
                spec=VersionSpec(version, manifest),
            )
            return version, await run.run(iter(plans)), None
        except BaseException as raised:
            exc = unwrap_group(raised)
            if not isinstance(exc, AiosyncError):
                raise
            log.warning("engine %d: version %d failed: %s", self.index, version, exc)
            return version, None, exc

    def _command(self, code: int, part: int, bucket: int, slot: int) -> None:
        """The source: tell the engine's ranks what comes next (a worker thread)."""
        broadcast_ints([code, part, bucket, slot], group=self.group, src=self.src)
        self._ended = self._ended or code == END

    def _pack_part(self, index: int, plan: BucketPlan) -> None:
        """The source, from the pipeline's packing thread: rank ``i`` packs its bucket."""
        part, bucket = self._where.pop(id(plan))
        self._command(PACK, part, bucket, index)
        error = self._pack_mine(part, bucket, index)
        texts = gather_bytes(error, group=self.group, dst=self.src, max_bytes=MAX_ERROR_CHARS)
        if texts is not None and texts[part]:
            text = texts[part].decode(errors="replace")
            raise MismatchError(text, tensor=plan.first_name)

    def _pack_mine(self, part: int, bucket: int, index: int) -> bytes:
        """Pack my bucket ``bucket`` into buffer ``index`` if ``part`` is mine; the error."""
        if part != self.pos:
            return b""
        try:
            plan = self._local[bucket] if 0 <= bucket < len(self._local) else None
            if plan is None or self._plane is None or not 0 <= index < self.count:
                raise ProtocolError(f"no bucket {bucket} or buffer {index} here")
            self._plane.pack(index, plan)
            self._local[bucket] = None  # its tensors may be freed now
            return b""
        except (AiosyncError, RuntimeError, ValueError, TypeError) as exc:
            text = f"trainer rank {self.rank} cannot pack bucket {bucket}: {exc}"
            return text.encode()[:MAX_ERROR_CHARS]

    async def _follow(self) -> None:
        """A rank of the range but not its source: pack what the source says, until the end."""
        while True:
            code, part, bucket, slot = await self._call(
                broadcast_ints, [0, 0, 0, 0], group=self.group, src=self.src
            )
            if code == END:
                self._ended = True
                return
            if code != PACK:
                raise ProtocolError(f"unknown command {code} from rank {self.src}")
            error = await self._call(self._pack_mine, part, bucket, slot)
            await self._call(
                gather_bytes, error, group=self.group, dst=self.src, max_bytes=MAX_ERROR_CHARS
            )

    async def _vote(self, *, prepared: bool) -> list[int]:
        """Meet every covered rank: the engines that did not prepare (all ranks join once)."""
        if self.source and not self._ended:
            await self._call(self._command, END, 0, 0, 0)
        self._voted = True
        flags = [False] * len(self.layout.engines)
        flags[self.index or 0] = self.source and not prepared
        agreed = await self._agree(flags)
        self._unprepared = [i for i, f in enumerate(agreed) if f]
        return [i for i in self._unprepared if i != self.index]


def _is_goodbye_ack(data: bytes) -> bool:
    reply = decode(data)
    return isinstance(reply, Ack) and reply.seq == GOODBYE_SEQ
