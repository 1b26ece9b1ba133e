"""The trainer's side: an async context manager that streams versions to a fleet of engines.

Example::

    async with WeightSender(["ipc:///run/a.sock", "ipc:///run/b.sock"]) as sender:
        for step in range(steps):
            train_step()
            report = await sender.send(model, version=step)

One ring of buffers serves every engine: each bucket is packed once. Engines may be added
and removed between versions. A version is committed under a :class:`Policy`: ``all``
(default) commits only if every engine prepared it, ``available`` commits where it can.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import torch

from aiosync.channels.base import Channel
from aiosync.channels.endpoints import check_endpoint
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, PeerGoneError, UsageError
from aiosync.core.exception_groups import exit_as_one
from aiosync.core.layout import MAX_BUCKET_ITEMS, calculate_aligned_size
from aiosync.core.layout_memory import LayoutMemory
from aiosync.core.manifest import TensorMeta, visible_pairs
from aiosync.core.planning import VersionSource, read_source
from aiosync.core.trainer_session import Policy
from aiosync.pipeline.ahead import FIRST_BUFFER, read_ahead, read_here
from aiosync.pipeline.early_begin import EarlyBegin, begin_early
from aiosync.pipeline.fanout import EarlyBucketMismatch
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.report import ProgressCallback, SyncReport
from aiosync.pipeline.stream import StreamRun, may_begin_early
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.planes import SenderPlane, create_sender_plane
from aiosync.planes.direct import DirectSenderPlane
from aiosync.runtime import require_asyncio, unwrap_group
from aiosync.trainer.config import SenderConfig as SenderConfig
from aiosync.trainer.direct import DirectReader
from aiosync.trainer.fleet import EngineFleet
from aiosync.trainer.fleet import Target as Target
from aiosync.trainer.snapshot import snapshot_check

log = logging.getLogger(__name__)

Manifest = Sequence[TensorMeta] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class _Options:
    empty: bool
    rebase: bool
    packed: anyio.Event | None


class WeightSender(EngineFleet):
    """Streams named tensors to any number of engines, one version at a time.

    ``engines`` are the engines to reach at entry (more may be added with
    :meth:`add_engine`). ``device`` picks the data plane: CPU shared memory, or CUDA IPC
    memory on that GPU. Use as ``async with``, entered and left in one task; leaving it
    says goodbye to every engine and releases sockets and buffers, also when cancelled.
    """

    def __init__(
        self,
        engines: Target | Sequence[Target] = (),
        *,
        device: torch.device | str = "cpu",
        config: SenderConfig | None = None,
        auth: ChannelAuth | None = None,
    ) -> None:
        self.config = config or SenderConfig()
        self._auth = auth
        self.device = torch.device(device)
        many = isinstance(engines, Sequence) and not isinstance(engines, str)
        self._initial: list[Target] = list(engines) if many else [engines]  # type: ignore[arg-type,list-item]
        for target in self._initial:
            if isinstance(target, str):
                check_endpoint(target, binding=False)
        self._capacity = calculate_aligned_size(self.config.buffer_bytes)
        self._links: dict[str, EngineLink] = {}
        self._owned: dict[str, Channel] = {}
        self._keepalives: dict[str, anyio.CancelScope] = {}
        self.lost_engines: dict[str, AiosyncError] = {}
        self._plane: SenderPlane | None = None
        self._stack: AsyncExitStack | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._sending = False
        self._layouts = LayoutMemory()  # the last version's layout, reused if it still fits
        self._direct: DirectReader | None = None  # direct mode's reader, with its plane
        # the manifest the last committed version's begin carried: the next one's guess,
        # whose begin goes before the read (pipeline.early_begin)
        self._begun_with: list[TensorMeta] | None = None
        self._first_early = True  # a kept direct bucket 1 may go with that begin

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> WeightSender:
        require_asyncio("WeightSender")
        self._stack = AsyncExitStack()
        try:
            plane = self._create_plane(self.device, self.config.num_buffers, self._capacity)
            self._stack.callback(plane.close)
            self._plane = plane
            self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
            self._stack.push_async_callback(self._stop_tasks)
            self._stack.push_async_callback(self._say_goodbyes)
            for target in self._initial:
                await self.add_engine(target)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    def _create_plane(self, device: torch.device, count: int, capacity: int) -> SenderPlane:
        """The ring of ``count`` buffers of ``capacity`` bytes this sender packs into.

        A sender of another kind of plane (a broadcast: :class:`~aiosync.trainer.collective.
        CollectiveSender`) overrides this; the rest of the pipeline is the same.
        """
        plane = create_sender_plane(device, count, capacity, ordered=True)
        if self.config.direct is False:
            return plane
        direct = DirectSenderPlane(plane, device)
        self._direct = DirectReader(direct, self.config.direct)  # type: ignore[arg-type]
        return direct

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await exit_as_one(stack.__aexit__(exc_type, exc, tb), exc)
        self._plane = None

    async def _stop_tasks(self) -> None:
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()

    # --- sending ----------------------------------------------------------------------

    async def send(
        self,
        named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any] | torch.nn.Module,
        *,
        version: int | None = None,
        manifest: Manifest | None = None,
        policy: Policy | str | None = None,
        progress: ProgressCallback | None = None,
        empty: bool = False,
        rebase: bool = False,
        packed: anyio.Event | None = None,
    ) -> SyncReport:
        """Stream every tensor as ``version`` and return once the engines committed it.

        ``named_tensors`` is a mapping, its ``.items()``, a list of pairs, a module, or any
        iterable of pairs (a generator streams with buffers plus one tensor in memory). The
        manifest is read from the first four; pass ``manifest=`` (metadata entries or a
        name -> tensor map, meta tensors welcome) to give one for a generator. ``version``
        defaults to one past the newest an engine holds. On failure, engines keep their
        previous version as the policy says, and the error names each failed engine.
        A version with no tensors needs ``empty=True``; ``rebase=True`` restarts the
        numbering (a trainer back from a checkpoint), where the engines allow it.
        ``packed`` (an event) is set once every byte is in a buffer: from then on the
        trainer may change its tensors (an optimizer step) while the engines apply and
        commit the snapshot; changing them before is undefined.
        """
        if self._plane is None:
            raise UsageError("sender is not open; use 'async with WeightSender(...)'")
        if self._sending:
            raise UsageError("a send is already running on this sender; await it first")
        if progress is not None and inspect.iscoroutinefunction(progress):
            raise UsageError("progress must be a plain function, not a coroutine function")
        if not self._links:
            lost = "; ".join(f"{n}: {e.reason}" for n, e in self.lost_engines.items())
            raise PeerGoneError("no engines to send to" + (f" (lost {lost})" if lost else ""))
        self._sending = True
        try:
            options = _Options(empty, rebase, packed)
            return await self._send(named_tensors, version, manifest, policy, progress, options)
        finally:
            if packed is not None:
                packed.set()  # a failed send has nothing left to read either
            self._sending = False
            await self._drop_broken()

    async def _send(
        self,
        source: Any,
        version: int | None,
        manifest: Manifest | None,
        policy: Policy | str | None,
        progress: ProgressCallback | None,
        options: _Options,
    ) -> SyncReport:
        started = time.perf_counter()  # the report's seconds cover reading the tensors too
        most = min(link.session.limits.max_bucket_tensors for link in self._links.values())
        if version is None:
            known = [v for v in self.remote_versions.values() if v is not None]
            version = max(known) + 1 if known else 0
        plane, chosen = self._plane, Policy(policy or self.config.policy)
        assert plane is not None  # send() checked
        plane.begin_version()  # a CUDA plane packs on this (the caller's) stream
        reader = functools.partial(
            read_source if self._direct is None else self._direct.read,
            source,
            manifest,
            self._capacity,
            min(MAX_BUCKET_ITEMS, most),
            self._layouts.lay_out,
        )
        checks: list[Callable[[], None]] = []
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        stream = torch.cuda.current_stream() if cuda else None

        def read_and_sample() -> VersionSource:  # sampled before bucket 1 is packed
            read = reader()
            if self.config.check_snapshot and read.pairs:
                with torch.cuda.stream(stream):  # after the caller's writes, as it sees them
                    checks.append(snapshot_check(read.pairs))
            return read

        early = await self._begin_early(source, manifest, version, chosen, options)
        try:
            here = self._read_here(source, manifest, min(MAX_BUCKET_ITEMS, most))
            ahead = None if here is None else read_here(here, plane, version)
            if ahead is None:
                job = functools.partial(read_ahead, read_and_sample, plane, version)
                ahead = await anyio.to_thread.run_sync(job)
        except BaseException:
            if early is not None:
                await early.withdraw("the trainer could not read the version")
            raise
        read, first = ahead
        if early is not None and not early.holds(read.manifest, first.plan):
            log.info("version %d changed: what went before the read is withdrawn", version)
            await early.withdraw("the version's tensors changed; it begins again")
            early = None
        spec = VersionSpec(
            version=version,
            manifest=read.manifest if early is None else early.manifest,
            empty=options.empty,
            rebase=options.rebase,
            progress=progress,
            packed=options.packed,
            check_snapshot=checks[0] if checks else None,
            started=started,
            first=first,
            begun=None if early is None else early.payload,
            sent_first=None if early is None else early.first_payload,
        )
        run = StreamRun(
            links=list(self._links.values()),
            plane=plane,  # type: ignore[arg-type]
            policy=chosen,
            spec=spec,
        )
        try:
            report = await run.run(read.plans)
        except BaseException as group:
            exc = unwrap_group(group)
            if isinstance(exc, EarlyBucketMismatch):  # never again: bucket 1 after the read
                log.warning("version %d: %s; bucket 1 goes after the read now", version, exc)
                self._first_early = False
            if exc is group:
                raise
            raise exc from exc.__cause__  # the group goes; a cause (the user's error) stays
        self._begun_with = run.manifest  # the next version's guess (None: none)
        if self._direct is not None:
            report = replace(report, direct_note=self._direct.note)
        log.info(
            "version %d: %d tensors, %.1f MB in %.3fs (%.2f GB/s) to %s",
            report.version,
            report.tensors,
            report.bytes / 1e6,
            report.seconds,
            report.gbps,
            ", ".join(report.committed),
        )
        return report

    async def _begin_early(
        self,
        source: Any,
        manifest: Manifest | None,
        version: int,
        policy: Policy,
        options: _Options,
    ) -> EarlyBegin | None:
        """The begin sent before the read, on the last version's manifest, where it may go.

        Only for a source whose read builds a manifest (a module, a mapping, a list: not a
        generator without ``manifest=``), so that a guess is withdrawn only when the names,
        dtypes or shapes really changed. Bucket 1 goes with it where the last read can be
        kept: a direct split's, or (a CUDA plane with a counter) the layout's first ring
        bucket, ahead of its packing.
        """
        guess, plane = self._begun_with, self._plane
        if guess is None or plane is None or options.empty or options.rebase:
            return None
        readable = isinstance(source, torch.nn.Module) or visible_pairs(source) is not None
        if manifest is None and not readable:
            return None
        if not may_begin_early(len(self._links), policy, plane):
            return None
        links = list(self._links.values())
        if self._direct is not None:
            first = None
            if self._first_early and self._may_read_here(manifest):
                first = self._direct.kept_first()  # a kept read hands out the same plan
            return await begin_early(links, version, guess, first)
        kept = self._layouts.kept_first() if self._first_early and manifest is None else None
        words = [link.counter_word for link in links]
        counters = [word for word in words if word is not None]
        after = None
        if kept is not None and len(counters) == len(words):  # a counter word each
            after = plane.arm(FIRST_BUFFER, counters)  # a ring bucket 1 goes ahead of its packing
        if after is None:  # the plane has no counters
            return await begin_early(links, version, guess)
        try:
            early = await begin_early(links, version, guess, kept, after, plane.disarm)
        except BaseException:
            plane.disarm()
            raise
        if early is None or early.first is None:
            plane.disarm()  # nothing waits for the counters
        return early

    def _read_here(
        self, source: Any, manifest: Manifest | None, max_items: int
    ) -> Callable[[], VersionSource | None] | None:
        """A read bounded enough for the event loop (a direct split kept), if one applies."""
        if self._direct is None or not self._may_read_here(manifest):
            return None
        return functools.partial(
            self._direct.read_kept, source, self._capacity, max_items, self._layouts.lay_out
        )

    def _may_read_here(self, manifest: Manifest | None) -> bool:
        """Whether a direct read may run on the loop: no manifest given, no snapshot check."""
        return manifest is None and not self.config.check_snapshot
