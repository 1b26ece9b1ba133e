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

Versions are the engine's one session machine's
(:class:`~aiosync.core.engine_session.EngineSession`, fed by
:mod:`aiosync.handles.broadcast_feed`): a version is committed to the sinks once the
buckets received for it cover what the sinks require (every bucket, for sinks that require
nothing). A refused or failed bucket drops the version in progress: sinks keep (staged
sinks) or are reported off (in-place sinks) the previous version, and
:meth:`AiosyncEngine.check_health` says which one is served.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
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
from aiosync.core.engine_actions import SyncFailure
from aiosync.core.errors import AiosyncError
from aiosync.core.wire import CollectivePlaneSpec
from aiosync.engine.sinks import WeightSink
from aiosync.handles.broadcast_feed import BroadcastFeed, BucketCall, GroupMembership
from aiosync.handles.colocated import ColocatedUpdates, error_text, version_number
from aiosync.handles.metadata import FLATTENED, PER_TENSOR_FORMATS, bucket_layout
from aiosync.handles.release import release
from aiosync.handles.scratch import Scratch

log = logging.getLogger(__name__)

Answer = tuple[bool, str]
"""SGLang's answer shape: ``(success, message)``."""


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
        self._groups: dict[str, GroupMembership] = {}
        self._lock = threading.Lock()
        self._feed = BroadcastFeed(
            self._sinks, name, timeout=timeout, max_bucket_bytes=max_bucket_bytes
        )
        self._last_error = ""  # the last failed answer's text, until a version commits
        self._colocated: ColocatedUpdates | None = None

    # --- what the engine serves ---------------------------------------------------------

    @property
    def ranks(self) -> int:
        """How many group ranks (GPUs) this engine takes: one per sink."""
        return len(self._sinks)

    @property
    def weight_version(self) -> int | None:
        """The last committed version (None before the first)."""
        return self._feed.session.current_version

    @property
    def failures(self) -> list[SyncFailure]:
        """The broadcast versions that did not commit, oldest first (the session's records)."""
        return list(self._feed.session.failures)

    def check_health(self) -> dict[str, Any]:
        """``{"healthy", "servable", "message", "weight_version", "groups"}``; never blocks.

        ``servable`` is False while an in-place sink holds part of a version not committed
        (one in progress, or one that failed, until the next version completes);
        ``healthy`` is False after such a failure, or while a group is broken (reconnect).
        """
        problems = [
            f"{group.name}: {ex.broken.reason}"
            for group in list(self._groups.values())
            for ex in group.executors
            if ex.broken is not None
        ]
        session = self._feed.session
        streaming = any(peer.stream is not None for peer in list(session.sessions.values()))
        if not session.servable and not streaming:
            problems.append("weights mixed by a failed version (in-place sink)")
        version = session.current_version
        return {
            "healthy": not problems,
            "servable": session.servable,
            "message": "; ".join(problems) or self._last_error,
            "weight_version": None if version is None else str(version),
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
        # the group as the session's hello names it: one buffer of the largest bucket
        plane = CollectivePlaneSpec(
            backend, host, port, token or "", group_name, world_size, 1, self.max_bucket_bytes
        )
        scratch = [Scratch() for _ in ranks]
        self._groups[group_name] = GroupMembership(
            group_name, ranks, executors, plane, stores, scratch
        )
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
            self._feed.leave(group_name)
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
            self._feed.abandon("a colocated update took the sinks")
            if self._colocated is None:
                self._colocated = ColocatedUpdates(self._sinks, self.name)
            session = self._feed.session  # the versions count on across both paths
            outcome = self._colocated.update(
                serialized_named_tensors, load_format, weight_version, session.current_version
            )
            if outcome.success and outcome.committed != session.current_version:
                session.current_version, session.servable = outcome.committed, True
                self._last_error = ""
            elif not outcome.success:
                self._last_error, session.servable = outcome.message, outcome.servable
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
                return self._failed(f"receiving a bucket of {len(names)} tensors", exc)
        if committed is not None:
            self._last_error = ""
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
        version = version_number(weight_version, self._feed.session.current_version)
        deadline = Deadline.after(self.timeout)
        call = BucketCall(version, specs, used, load_format == FLATTENED, deadline)
        return self._feed.take(group, call)

    def _failed(self, what: str, exc: BaseException) -> Answer:
        text = f"{self.name}: {what} failed: {error_text(exc)}"
        log.warning("%s", text)
        self._last_error = text
        return False, text
