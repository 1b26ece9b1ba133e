"""An engine-side weight-update endpoint built on aiosync, shaped like SGLang's engine.

:class:`AiosyncEngine` answers the calls an :class:`~aiosync.handles.EngineHandle` makes,
with SGLang's method names and its ``(success, message)`` answers, so the whole broadcast
path runs with no third-party engine: as an object in the trainer's process, as a Ray
actor, or in an engine process behind :func:`aiosync.handles.channel.serve_engine`.

It holds one :class:`~aiosync.engine.sinks.WeightSink` per engine rank (a tensor-parallel
engine of two GPUs: two sinks, ranks ``rank_offset`` and ``rank_offset + 1``). Each rank
joins the side group and runs its collectives and sink calls on its own
:class:`~aiosync.collectives.GroupExecutor` thread. Every call is bounded by ``timeout``
(Gloo groups are created with it, so a blocked collective ends by then).

Versions: a version is committed to the sinks once the buckets received for it cover what
the sinks require (every bucket, for sinks that require nothing). A failed bucket aborts
the version in progress: sinks keep (staged sinks) or are reported off (in-place sinks)
the previous version, and :meth:`AiosyncEngine.check_health` says which one is served.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiosync.collectives import (
    Deadline,
    GroupExecutor,
    connect_store,
    init_process_group,
    token_store,
)
from aiosync.collectives.alias_store import AliasStore, rank_alias
from aiosync.collectives.rendezvous import is_token, valid_host
from aiosync.core.errors import AiosyncError
from aiosync.core.manifest import Expectations
from aiosync.engine.sinks import WeightSink
from aiosync.handles.colocated import ColocatedUpdates, error_text, version_number
from aiosync.handles.metadata import FLATTENED, PER_TENSOR_FORMATS, bucket_layout
from aiosync.handles.release import release
from aiosync.handles.scratch import Scratch
from aiosync.handles.transfer import receive_bucket

log = logging.getLogger(__name__)

Answer = tuple[bool, str]
"""SGLang's answer shape: ``(success, message)``."""


@dataclass
class _Group:
    """An engine's membership of one side group: one executor (thread) per rank."""

    name: str
    ranks: list[int]
    executors: list[GroupExecutor]
    stores: list[AliasStore]
    scratch: list[Scratch] = field(default_factory=list)
    """Kept alive with the group: NCCL reads the store again at its first collective, and
    a Python store whose object is gone answers torch with "Not implemented"."""


@dataclass
class _Pending:
    """The version being received: its number and the names received so far."""

    version: int
    covered: set[str] = field(default_factory=set)


class AiosyncEngine:
    """The receiving side of broadcast weight updates, one :class:`WeightSink` per rank.

    Methods are synchronous and thread-safe (one update at a time; ``check_health``
    answers meanwhile), as a Ray actor's or an engine's methods are. ``timeout`` (seconds)
    bounds each call and is the Gloo group's timeout; ``max_bucket_bytes`` bounds the
    buffer one bucket may ask for.
    """

    def __init__(
        self,
        sinks: WeightSink | Sequence[WeightSink],
        *,
        name: str = "aiosync-engine",
        timeout: float = 120.0,
        max_bucket_bytes: int = 1 << 34,
    ) -> None:
        self._sinks: list[WeightSink] = list(sinks) if isinstance(sinks, Sequence) else [sinks]
        if not self._sinks:
            raise ValueError("an engine needs at least one sink (one per rank)")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.name = name
        self.timeout = timeout
        self.max_bucket_bytes = max_bucket_bytes
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._committed: int | None = None
        self._pending: _Pending | None = None
        self._last_error = ""
        self._mixed = False
        self._expected: list[Expectations | None] | None = None
        self._colocated: ColocatedUpdates | None = None

    # --- what the engine serves ---------------------------------------------------------

    @property
    def ranks(self) -> int:
        """How many group ranks (GPUs) this engine takes: one per sink."""
        return len(self._sinks)

    @property
    def weight_version(self) -> int | None:
        """The last committed version (None before the first)."""
        return self._committed

    def check_health(self) -> dict[str, Any]:
        """``{"healthy", "servable", "message", "weight_version", "groups"}``; never blocks.

        ``servable`` is False while an in-place sink holds part of a version that failed
        (until the next version completes); ``healthy`` is False then too, or while a group
        is broken (reconnect).
        """
        problems = [
            f"{group.name}: {ex.broken.reason}"
            for group in list(self._groups.values())
            for ex in group.executors
            if ex.broken is not None
        ]
        if self._mixed:
            problems.append("weights mixed by a failed version (in-place sink)")
        return {
            "healthy": not problems,
            "servable": not self._mixed,
            "message": "; ".join(problems) or self._last_error,
            "weight_version": None if self._committed is None else str(self._committed),
            "groups": sorted(self._groups),
        }

    # --- joining and leaving ------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        token: str | None = None,
    ) -> Answer:
        """Join ``group_name`` with ranks ``rank_offset ..`` of ``world_size``; ``(ok, text)``.

        ``token``, when given, is the random part of the group's key prefix in the store
        (see :mod:`aiosync.collectives.rendezvous`).
        """
        with self._lock:
            try:
                self._join(
                    master_address, master_port, rank_offset, world_size, group_name, backend, token
                )
            except Exception as exc:
                return self._failed(f"joining group {group_name!r}", exc)
        last = rank_offset + self.ranks - 1
        return True, f"{self.name} joined {group_name!r} as ranks {rank_offset}..{last}"

    def _join(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        token: str | None,
    ) -> None:
        if group_name in self._groups:
            raise AiosyncError(f"already a member of group {group_name!r}", peer=self.name)
        if not (isinstance(rank_offset, int) and isinstance(world_size, int)):
            raise AiosyncError("rank_offset and world_size must be integers")
        if rank_offset < 1 or rank_offset + self.ranks > world_size:
            raise AiosyncError(
                f"ranks {rank_offset}..{rank_offset + self.ranks - 1} do not fit a group of "
                f"{world_size} whose rank 0 is the trainer"
            )
        if backend not in ("gloo", "nccl"):
            raise AiosyncError(f"unsupported backend {backend!r}")
        if token is not None and not is_token(token):
            raise AiosyncError("malformed rendezvous token")
        valid_host(host)
        limit = timedelta(seconds=self.timeout)
        deadline = Deadline.after(self.timeout)
        ranks = [rank_offset + i for i in range(self.ranks)]
        executors = [
            GroupExecutor(f"{group_name}/rank{rank}", join_timeout=self.timeout) for rank in ranks
        ]

        stores: list[AliasStore] = []

        def join(rank: int, device: torch.device) -> dist.ProcessGroup:
            if device.type == "cuda":  # NCCL binds the communicator to this thread's device
                torch.cuda.set_device(device)
            client = connect_store(host, port, timeout=limit)
            store = client if token is None else token_store(client, token)
            alias = rank_alias(group_name, rank)  # ranks of one process need names of their own
            aliased = AliasStore(store, alias, group_name)
            stores.append(aliased)
            return init_process_group(
                backend=backend,
                store=aliased,
                world_size=world_size,
                rank=rank,
                group_name=alias,
                timeout=limit,
            )

        try:
            for ex in executors:
                ex.start()
            futures = [
                ex.submit(functools.partial(join, rank, sink.device))
                for ex, rank, sink in zip(executors, ranks, self._sinks, strict=True)
            ]
            for ex, future in zip(executors, futures, strict=True):
                ex.group = ex.result(
                    future, deadline=deadline, what="joining the group", peers=["trainer"]
                )
        except BaseException:
            for ex in executors:
                ex.close()
            raise
        scratch = [Scratch() for _ in ranks]
        self._groups[group_name] = _Group(group_name, ranks, executors, stores, scratch)
        log.info("%s joined %s as ranks %s of %d", self.name, group_name, ranks, world_size)

    def destroy_weights_update_group(self, group_name: str) -> Answer:
        """Leave ``group_name`` (idempotent: not being a member is a success).

        Does not wait for an update in progress to finish first: the group is broken (an
        NCCL group aborted) so that update fails, keeping the previous version.
        """
        group = self._groups.pop(group_name, None)
        if group is None:
            return True, f"{self.name} is not a member of {group_name!r}"
        if not self._lock.acquire(blocking=False):  # an update is in flight: break it first
            for ex in group.executors:  # (an NCCL group is aborted, its receive fails now)
                ex.fail(AiosyncError(f"group {group_name!r} destroyed", peer=self.name))
            self._lock.acquire()
        try:
            self._abort_pending()
            release(group.executors)
        finally:
            self._lock.release()
        return True, f"{self.name} left {group_name!r}"

    def close(self) -> None:
        """Leave every group; close buffers a colocated update left open."""
        for name in list(self._groups):
            self.destroy_weights_update_group(name)
        if self._colocated is not None:
            self._colocated.close()

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Answer:
        """One colocated call, one part per rank, read by :mod:`aiosync.handles.colocated`."""
        del flush_cache
        with self._lock:
            self._abort_pending()  # a broadcast version left unfinished
            if self._colocated is None:
                self._colocated = ColocatedUpdates(self._sinks, self.name)
            outcome = self._colocated.update(
                serialized_named_tensors, load_format, weight_version, self._committed
            )
            if outcome.success and outcome.committed != self._committed:
                self._committed, self._last_error, self._mixed = outcome.committed, "", False
            elif not outcome.success:
                self._last_error, self._mixed = outcome.message, not outcome.servable
        return outcome.success, outcome.message

    # --- receiving ----------------------------------------------------------------------

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> Answer:
        """Receive one bucket from group rank 0 and apply it to every rank's sink.

        One broadcast per tensor in order, or one of the whole laid-out bucket when
        ``load_format`` is ``"flattened_bucket"``. ``(True, text)`` once every rank applied
        it (and committed, when it completed the version); ``(False, why)`` otherwise, with
        the version in progress aborted and the previous one kept.
        """
        del flush_cache  # no cache to flush: the sink owns what readers see
        with self._lock:
            try:
                committed = self._receive(
                    names, dtypes, shapes, group_name, load_format, weight_version
                )
            except Exception as exc:
                self._abort_pending()
                return self._failed(f"receiving a bucket of {len(names)} tensors", exc)
        done = f", committed version {committed}" if committed is not None else ""
        return True, f"{self.name} applied {len(names)} tensors{done}"

    def _receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
    ) -> int | None:
        group = self._groups.get(group_name)
        if group is None:
            raise AiosyncError(f"not a member of group {group_name!r}", peer=self.name)
        if load_format != FLATTENED and load_format not in PER_TENSOR_FORMATS:
            raise AiosyncError(f"unsupported load_format {load_format!r}")
        specs, used = bucket_layout(names, dtypes, shapes, max_bytes=self.max_bucket_bytes)
        version = version_number(weight_version, self._committed)
        if self._pending is not None and self._pending.version != version:
            log.warning(
                "%s: version %d left unfinished for %d", self.name, self._pending.version, version
            )
            self._abort_pending()
        if self._pending is None:
            self._pending = _Pending(version)
        deadline = Deadline.after(self.timeout)
        flattened = load_format == FLATTENED
        futures: list[Future[None]] = [
            ex.submit(
                functools.partial(receive_bucket, sink, ex.group, scratch, specs, used, flattened)
            )
            for ex, sink, scratch in zip(group.executors, self._sinks, group.scratch, strict=True)
        ]
        for ex, future in zip(group.executors, futures, strict=True):
            ex.result(future, deadline=deadline, what="receiving a bucket", peers=["trainer"])
        self._pending.covered.update(spec.name for spec in specs)
        if not self._complete(self._pending.covered):
            return None
        commits = [
            ex.submit(functools.partial(sink.commit, version))
            for ex, sink in zip(group.executors, self._sinks, strict=True)
        ]
        for ex, future in zip(group.executors, commits, strict=True):
            ex.result(future, deadline=deadline, what="committing", peers=[self.name])
        self._committed, self._pending = version, None
        self._last_error, self._mixed = "", False
        return version

    def _complete(self, covered: set[str]) -> bool:
        """True when ``covered`` holds everything every sink requires."""
        if self._expected is None:  # a sink says once what it takes
            self._expected = [sink.expectations() for sink in self._sinks]
        return not any(e is not None and e.missing(covered) for e in self._expected)

    def _abort_pending(self) -> None:
        if self._pending is None:
            return
        if self._pending.covered and not all(sink.staged for sink in self._sinks):
            self._mixed = True
        self._pending = None
        for sink in self._sinks:
            try:
                sink.abort()
            except Exception:
                log.exception("%s: abort of a sink failed", self.name)

    def _failed(self, what: str, exc: BaseException) -> Answer:
        text = f"{self.name}: {what} failed: {error_text(exc)}"
        log.warning("%s", text)
        self._last_error = text
        return False, text
