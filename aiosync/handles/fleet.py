"""The trainer side of broadcast weight updates, driving engines through their handles.

:func:`connect` makes a side group of the trainer (rank 0) and every engine's ranks (rank
offsets from 1, by GPU count), with a store on loopback (or a chosen address) and a random
token in its key prefix that only the engines are told. :func:`send_version` streams one
version through the native send loop (``StreamRun``): per bucket, metadata to every engine,
the broadcast(s) on the group's executor thread, every engine's answer as its ack.
:func:`disconnect` tears both sides down and never fails for an engine that is already
gone.

Nothing here waits past the deadline it is given. Any failure breaks the group (its ranks
are out of step): the error names the engines that failed or did not answer, and the way
on is :func:`disconnect` then :func:`connect`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
import anyio.to_thread
import torch.distributed as dist

from aiosync.collectives import (
    Deadline,
    GroupExecutor,
    HostedStore,
    host_store,
    init_process_group,
    new_token,
    token_store,
)
from aiosync.core.errors import AiosyncError, RejectedError, SyncTimeoutError, UsageError
from aiosync.core.trainer_session import LinkSession, Policy
from aiosync.core.wire import PROTOCOL, Ready
from aiosync.handles.base import EngineHandle, WeightSyncResult
from aiosync.handles.call_channel import BucketCalls, CallChannel
from aiosync.handles.caller_buckets import CallerBuckets
from aiosync.handles.group_plane import GroupBroadcastPlane
from aiosync.handles.metadata import FLATTENED
from aiosync.handles.release import release
from aiosync.handles.scratch import Scratch
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.stream import StreamRun
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

CLEANUP_WAIT = 2.0
"""Seconds a failed group's thread is waited for before it is left to end on its own."""


def engine_rank_offsets(engine_gpu_counts: Sequence[int]) -> list[int]:
    """Each engine's first group rank: trainer rank 0 is rank 0, engines follow densely."""
    offsets, next_rank = [], 1
    for count in engine_gpu_counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise UsageError(f"engine GPU counts must be positive integers, got {count!r}")
        offsets.append(next_rank)
        next_rank += count
    return offsets


@dataclass
class TrainerGroup:
    """The trainer's side of one connected group: the group, its thread, store and engines."""

    name: str
    backend: str
    group: dist.ProcessGroup
    executor: GroupExecutor
    store: HostedStore
    handles: list[EngineHandle]
    world_size: int
    closed: bool = field(default=False)
    scratch: Scratch = field(default_factory=Scratch)


async def _ask_all(
    handles: Sequence[EngineHandle],
    ask: Callable[[EngineHandle], Awaitable[WeightSyncResult]],
    pending: set[str],
    what: str,
) -> None:
    """Ask every engine at once; raise the first failure (a refused answer or a lost engine)."""

    async def one(handle: EngineHandle) -> None:
        result = await ask(handle)
        if not result.success:
            raise RejectedError(f"{what}: {result.message or 'failed'}", peer=handle.name)
        pending.discard(handle.name)

    async with anyio.create_task_group() as tg:
        for handle in handles:
            tg.start_soon(one, handle)


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _timeout(what: str, group: str, deadline: Deadline, pending: set[str]) -> SyncTimeoutError:
    who = ", ".join(sorted(pending)) or None
    return SyncTimeoutError(
        f"{what} on group {group!r} did not finish within the {deadline.seconds:g}s deadline; "
        "engines that did not answer are named",
        peer=who,
    )


def _close_store(store: HostedStore) -> None:
    try:
        store.close()
    except OSError as exc:  # torch may have closed the listening socket itself
        log.debug("closing the store: %s", exc)


async def _close_executor(executor: GroupExecutor, wait: float) -> None:
    executor.join_timeout = max(0.1, wait)
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(executor.close)


async def connect(
    handles: Sequence[EngineHandle],
    engine_gpu_counts: Sequence[int],
    group_name: str,
    *,
    backend: str,
    deadline: Deadline,
    host: str = "127.0.0.1",
    use_token: bool = True,
) -> TrainerGroup:
    """Join the trainer (rank 0) and every engine into ``group_name``; the trainer's side.

    ``use_token=False`` leaves the random token out of the group's keys and of the engines'
    calls, for engines that cannot take it (anyone who reaches the store may then join).

    Raises :class:`SyncTimeoutError` naming the engines that had not joined by the
    deadline, or the first engine's refusal; either way nothing is left joined here.
    """
    if len(handles) != len(engine_gpu_counts):
        raise UsageError(
            f"{len(handles)} engines but {len(engine_gpu_counts)} GPU counts were given"
        )
    offsets = engine_rank_offsets(engine_gpu_counts)
    offset_of = {id(handle): offset for handle, offset in zip(handles, offsets, strict=True)}
    if len(offset_of) != len(handles):
        raise UsageError("the same engine handle appears twice")
    world_size = 1 + sum(engine_gpu_counts)
    limit = timedelta(seconds=max(1.0, deadline.remaining()))
    store = host_store(host, timeout=limit)
    token = new_token() if use_token else None
    executor = GroupExecutor(group_name, join_timeout=deadline.seconds)
    executor.start()
    pending = {handle.name for handle in handles}
    join = functools.partial(
        init_process_group,
        backend=backend,
        store=store.store if token is None else token_store(store.store, token),
        world_size=world_size,
        rank=0,
        group_name=group_name,
        timeout=limit,
    )
    try:
        future = executor.submit(join)
        with anyio.fail_after(deadline.remaining()):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _ask_all,
                    handles,
                    lambda h: h.init_weights_update_group(
                        store.host,
                        store.port,
                        offset_of[id(h)],
                        world_size,
                        group_name,
                        backend,
                        token=token,
                    ),
                    pending,
                    "joining the group",
                )
                group = await executor.wait(
                    future, deadline=deadline, what="joining the group", peers=sorted(pending)
                )
    except BaseException as exc:
        error = _first_error(exc)
        if isinstance(error, TimeoutError) and not isinstance(error, AiosyncError):
            error = _timeout("joining", group_name, deadline, pending)
        if isinstance(error, AiosyncError):
            executor.fail(error)
        await _close_executor(executor, CLEANUP_WAIT)
        _close_store(store)
        if error is not exc:
            raise error from exc
        raise
    executor.group = group
    log.info(
        "group %s: trainer and %d engines joined (%d ranks)", group_name, len(handles), world_size
    )
    return TrainerGroup(group_name, backend, group, executor, store, list(handles), world_size)


async def send_version(
    trainer: TrainerGroup,
    buckets: CallerBuckets,
    *,
    deadline: Deadline,
    weight_version: int,
    flattened: bool = False,
) -> None:
    """Stream one version's ``buckets`` to every engine of ``trainer`` through the send loop.

    The native :class:`~aiosync.pipeline.stream.StreamRun` drives it: each bucket's
    metadata goes to every engine as its ``update_weights_from_distributed`` call (a
    :class:`~aiosync.handles.call_channel.CallChannel` per engine), rank 0 broadcasts it
    (one broadcast per tensor in order, or the whole packed bucket when ``flattened``),
    and every engine's answer is its ack. Policy ``all``: a refusal, a lost engine or the
    deadline ends the version for every engine, breaks the group (unless the caller's own
    buckets failed) and raises an :class:`AiosyncError` naming the engines concerned.
    """
    plane = GroupBroadcastPlane(
        trainer.executor, trainer.scratch, trainer.backend, flattened, deadline
    )
    calls = BucketCalls(trainer.name, FLATTENED if flattened else None, str(weight_version))
    number = weight_version if type(weight_version) is int else 0  # the stream's own numbering
    channels = [CallChannel(handle, calls) for handle in trainer.handles]
    links = [_ready_link(channel, trainer.name, deadline) for channel in channels]
    version = VersionSpec(number, None, progress=buckets.answered)
    run = StreamRun(links=links, plane=plane, policy=Policy.ALL, spec=version)
    broken = trainer.executor.broken
    if trainer.closed or broken is not None:
        buckets.stop()  # the caller hands over nothing
        if trainer.closed or broken is None:
            raise UsageError(f"group {trainer.name!r} is disconnected")
        raise broken
    try:
        with anyio.fail_after(deadline.remaining()):
            await run.run(buckets.plans())
    except BaseException as exc:
        error = unwrap_group(exc)
        if isinstance(error, TimeoutError) and not isinstance(error, AiosyncError):
            pending = {channel.peer for channel in channels if channel.calling}
            error = _timeout("a version's broadcast", trainer.name, deadline, pending)
        if isinstance(error, AiosyncError) and not buckets.abandoned:
            trainer.executor.fail(error)
        if error is not exc:
            raise error from exc
        raise
    finally:
        buckets.stop()
        plane.close()


def _ready_link(channel: CallChannel, group_name: str, deadline: Deadline) -> EngineLink:
    """A link on ``channel`` whose session is ready: the engine joined the group already."""
    session = LinkSession(channel.peer, group_name)
    session.ready(Ready(group_name, PROTOCOL, None))
    return EngineLink(channel, session, timeout=max(deadline.remaining(), 0.001))


async def leave(handles: Sequence[EngineHandle], group_name: str, deadline: Deadline) -> list[str]:
    """Ask every engine at once to leave ``group_name``; what went wrong (never raises).

    An engine that is gone, refuses or does not answer by the deadline is listed and does
    not stop the rest.
    """
    problems: list[str] = []

    async def one(handle: EngineHandle) -> None:
        try:
            with anyio.fail_after(max(0.0, deadline.remaining())):
                result = await handle.destroy_weights_update_group(group_name)
            if not result.success:
                problems.append(f"{handle.name}: {result.message}")
        except TimeoutError:
            problems.append(f"{handle.name}: did not answer within the deadline")
        except Exception as exc:
            problems.append(f"{handle.name}: {type(exc).__name__}: {exc}")

    async with anyio.create_task_group() as tg:
        for handle in handles:
            tg.start_soon(one, handle)
    return problems


async def disconnect(trainer: TrainerGroup, *, deadline: Deadline) -> list[str]:
    """Tear down both sides of ``trainer``'s group; idempotent. Returns what went wrong.

    The engines are asked to leave (:func:`leave`) while the trainer leaves too.
    """
    if trainer.closed:
        return []
    trainer.closed = True
    problems: list[str] = []

    async def engines_leave() -> None:
        problems.extend(await leave(trainer.handles, trainer.name, deadline))

    async def leave_own() -> None:  # at the same time as the engines: nobody waits alone
        trainer.executor.join_timeout = max(CLEANUP_WAIT, deadline.remaining())
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(release, [trainer.executor])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(leave_own)
            tg.start_soon(engines_leave)
    finally:
        _close_store(trainer.store)
        trainer.scratch.clear()
    for problem in problems:
        log.warning("group %s: disconnect: %s", trainer.name, problem)
    return problems
