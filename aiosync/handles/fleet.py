"""The trainer side of broadcast weight updates, driving engines through their handles.

:func:`connect` makes a side group of the trainer (rank 0) and every engine's ranks (rank
offsets from 1, by GPU count), with a store on loopback (or a chosen address) and a random
token in its key prefix that only the engines are told. :func:`broadcast_bucket` sends one
bucket: metadata to every engine, the broadcast(s) on the group's executor thread, every
engine's answer checked. :func:`disconnect` tears both sides down and never fails for an
engine that is already gone.

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
import torch
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
from aiosync.handles import transfer
from aiosync.handles.base import EngineHandle, WeightSyncResult
from aiosync.handles.metadata import FLATTENED, bucket_layout, describe
from aiosync.handles.release import release
from aiosync.handles.scratch import Scratch

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

    @property
    def engine_names(self) -> list[str]:
        """The engines' names, in rank order."""
        return [handle.name for handle in self.handles]


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


async def broadcast_bucket(
    trainer: TrainerGroup,
    bucket: Sequence[tuple[str, torch.Tensor]],
    *,
    deadline: Deadline,
    weight_version: str | None = None,
    flattened: bool = False,
) -> None:
    """Send one bucket to every engine of ``trainer`` and check every engine's answer.

    Metadata goes to every engine first (their receives start), then rank 0 broadcasts
    each tensor in order (or the whole packed bucket when ``flattened``), then every
    answer is awaited. A refusal, a lost engine or the deadline breaks the group and
    raises an :class:`AiosyncError` naming the engines concerned.
    """
    if trainer.closed:
        raise UsageError(f"group {trainer.name!r} is disconnected")
    if trainer.executor.broken is not None:
        raise trainer.executor.broken
    if not bucket:
        return
    names, dtypes, shapes = describe(bucket)
    specs, used = bucket_layout(names, dtypes, shapes, max_bytes=1 << 62)
    tensors = [tensor.detach() for _, tensor in bucket]
    if trainer.backend == "gloo":
        tensors = [tensor.cpu() for tensor in tensors]
    pending = set(trainer.engine_names)
    load_format = FLATTENED if flattened else None
    send = functools.partial(
        transfer.send_bucket, trainer.group, trainer.scratch, tensors, specs, used, flattened
    )

    def ask(handle: EngineHandle) -> Awaitable[WeightSyncResult]:
        return handle.update_weights_from_distributed(
            names,
            dtypes,
            shapes,
            group_name=trainer.name,
            load_format=load_format,
            weight_version=weight_version,
        )

    try:
        with anyio.fail_after(deadline.remaining()):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_ask_all, trainer.handles, ask, pending, "receiving a bucket")
                await trainer.executor.run(
                    send, deadline=deadline, what="broadcasting a bucket", peers=sorted(pending)
                )
    except BaseException as exc:
        error = _first_error(exc)
        if isinstance(error, TimeoutError) and not isinstance(error, AiosyncError):
            error = _timeout("a bucket's broadcast", trainer.name, deadline, pending)
        if isinstance(error, AiosyncError):
            trainer.executor.fail(error)
        if error is not exc:
            raise error from exc
        raise


async def disconnect(trainer: TrainerGroup, *, deadline: Deadline) -> list[str]:
    """Tear down both sides of ``trainer``'s group; idempotent. Returns what went wrong.

    Every engine is asked to leave at once; one that is gone, refuses or does not answer
    by the deadline is listed in the result and does not stop the rest.
    """
    if trainer.closed:
        return []
    trainer.closed = True
    problems: list[str] = []

    async def leave(handle: EngineHandle) -> None:
        try:
            with anyio.fail_after(max(0.0, deadline.remaining())):
                result = await handle.destroy_weights_update_group(trainer.name)
            if not result.success:
                problems.append(f"{handle.name}: {result.message}")
        except TimeoutError:
            problems.append(f"{handle.name}: did not answer within the deadline")
        except Exception as exc:
            problems.append(f"{handle.name}: {type(exc).__name__}: {exc}")

    async def leave_own() -> None:  # at the same time as the engines: nobody waits alone
        trainer.executor.join_timeout = max(CLEANUP_WAIT, deadline.remaining())
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(release, [trainer.executor])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(leave_own)
            for handle in trainer.handles:
                tg.start_soon(leave, handle)
    finally:
        _close_store(trainer.store)
        trainer.scratch.clear()
    for problem in problems:
        log.warning("group %s: disconnect: %s", trainer.name, problem)
    return problems
