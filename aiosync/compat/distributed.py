"""NeMo-RL's broadcast path to rollout engines, by its names and signatures, on aiosync.

:func:`connect_rollout_engines_from_distributed`,
:func:`broadcast_hf_buckets_via_distributed_impl`,
:func:`disconnect_rollout_engines_from_distributed` and
:func:`check_weight_sync_results` keep the reference's blocking signatures; underneath,
each engine is an :class:`~aiosync.handles.EngineHandle` (raw Ray actor handles, engine
objects and aiosync handles are all accepted) driven from one background event loop, and
the collectives run on the group's :class:`~aiosync.collectives.GroupExecutor` thread.

One deadline bounds each call (``AIOSYNC_TIMEOUT`` seconds, default 120); nothing here
waits past it. Settings read from the environment at each call:
``AIOSYNC_COLLECTIVE_BACKEND`` (``gloo`` / ``nccl``; default NCCL when CUDA is available),
``AIOSYNC_STORE_HOST`` (the address the rendezvous store listens on, default loopback) or
``AIOSYNC_STORE_INTERFACE`` (a network interface whose address to use), and
``AIOSYNC_BROADCAST_FORMAT`` (``per_tensor``, the default and the reference's, or
``flattened``: one broadcast per bucket), ``AIOSYNC_RENDEZVOUS_TOKEN=0`` (leave the random
token out, for engines whose ``init_weights_update_group`` cannot take it; anyone who
reaches the store can then join the group).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from anyio.from_thread import BlockingPortal, start_blocking_portal

from aiosync.collectives import Deadline, destroy_side_group
from aiosync.collectives.rendezvous import LOOPBACK, interface_address, valid_host
from aiosync.compat.errors import (
    CompatRuntimeError,
    CompatTypeError,
    CompatValueError,
    translate,
)
from aiosync.core.errors import SyncTimeoutError
from aiosync.handles import as_engine_handles, fleet
from aiosync.handles.caller_buckets import CallerBuckets
from aiosync.handles.ray_actor import is_ray_actor
from aiosync.handles.results import failures
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

T = TypeVar("T")

TIMEOUT_ENV = "AIOSYNC_TIMEOUT"
BACKEND_ENV = "AIOSYNC_COLLECTIVE_BACKEND"
STORE_HOST_ENV = "AIOSYNC_STORE_HOST"
STORE_INTERFACE_ENV = "AIOSYNC_STORE_INTERFACE"
FORMAT_ENV = "AIOSYNC_BROADCAST_FORMAT"
TOKEN_ENV = "AIOSYNC_RENDEZVOUS_TOKEN"
LOCK_POLL = 0.05
"""Seconds between tries of a Ray actor lock whose ``acquire`` answered False."""

_groups: dict[str, fleet.TrainerGroup] = {}
_groups_lock = threading.Lock()
_portal: BlockingPortal | None = None
_portal_lock = threading.Lock()


def _deadline() -> Deadline:
    seconds = float(os.environ.get(TIMEOUT_ENV, "120"))
    if seconds <= 0:
        raise CompatValueError(f"{TIMEOUT_ENV} must be positive, got {seconds}")
    return Deadline.after(seconds)


def _backend() -> str:
    chosen = os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen not in ("gloo", "nccl"):
        raise CompatValueError(f"{BACKEND_ENV} must be gloo or nccl, got {chosen!r}")
    return chosen


def _store_host() -> str:
    host = os.environ.get(STORE_HOST_ENV)
    if host:
        return valid_host(host)
    interface = os.environ.get(STORE_INTERFACE_ENV)
    return interface_address(interface) if interface else LOOPBACK


def _use_token() -> bool:
    chosen = os.environ.get(TOKEN_ENV, "1")
    if chosen not in ("0", "1"):
        raise CompatValueError(f"{TOKEN_ENV} must be 0 or 1, got {chosen!r}")
    return chosen == "1"


def _flattened() -> bool:
    chosen = os.environ.get(FORMAT_ENV, "per_tensor")
    if chosen not in ("per_tensor", "flattened"):
        raise CompatValueError(f"{FORMAT_ENV} must be per_tensor or flattened, got {chosen!r}")
    return chosen == "flattened"


def _loop() -> BlockingPortal:
    """The background event loop every compat call runs on (started once, stopped at exit)."""
    global _portal
    with _portal_lock:
        if _portal is None:
            manager = start_blocking_portal("asyncio")
            _portal = manager.__enter__()
            atexit.register(manager.__exit__, None, None, None)
        return _portal


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` on the background loop and return its result, errors translated."""
    return _translated(lambda: _loop().call(main))


def _translated(result: Callable[[], T]) -> T:
    """``result()``, its errors raised as NeMo-RL's types (see :mod:`aiosync.compat.errors`)."""
    try:
        return result()
    except Exception as exc:
        cause = unwrap_group(exc)
        compat = translate(cause) if isinstance(cause, Exception) else cause
        if compat is exc:
            raise
        raise compat from exc


def check_weight_sync_results(results: list) -> None:  # type: ignore[type-arg]
    """Raise ``RuntimeError`` when any engine's result says it failed.

    A result is a ``(success, message)`` tuple (SGLang's), a dict or an object with
    ``success`` and a text in ``message``, ``error_message`` or ``error``, or a list of
    those (one per engine rank); ``None`` and ``True`` are successes. The error names each
    failed engine (by position) with its own text.
    """
    failed = failures(list(results))
    if failed:
        raise CompatRuntimeError("weight sync failed on the engines: " + "; ".join(failed))


def connect_rollout_engines_from_distributed(
    *,
    group_name: str,
    rollout_engines: list,  # type: ignore[type-arg]
    engine_gpu_counts: list[int],
) -> dist.ProcessGroup:
    """Make the weight-update group of trainer rank 0 (rank 0) and every engine's ranks.

    Engines take rank offsets from 1 by their GPU counts; the world size is 1 plus their
    sum. Call on trainer rank 0 only. The rendezvous store listens on loopback (or
    ``AIOSYNC_STORE_HOST`` / ``AIOSYNC_STORE_INTERFACE``) and the group's keys carry a
    random token handed to each engine with its ``init_weights_update_group`` call, so
    the engines must accept aiosync's ``token`` argument (as
    :class:`aiosync.handles.engine.AiosyncEngine` does) unless ``AIOSYNC_RENDEZVOUS_TOKEN``
    is ``0``. Raises ``TimeoutError`` naming
    engines that did not join, ``RuntimeError`` naming one that refused, ``ValueError``
    for a group name already connected.
    """
    handles = as_engine_handles(rollout_engines)
    if len(handles) != len(engine_gpu_counts):
        raise CompatValueError(
            f"{len(handles)} rollout engines but {len(engine_gpu_counts)} GPU counts"
        )
    with _groups_lock:
        if group_name in _groups:
            raise CompatValueError(
                f"group {group_name!r} is already connected: disconnect it first"
            )
    deadline = _deadline()
    backend, host, use_token = _backend(), _store_host(), _use_token()

    async def main() -> fleet.TrainerGroup:
        return await fleet.connect(
            handles,
            engine_gpu_counts,
            group_name,
            backend=backend,
            deadline=deadline,
            host=host,
            use_token=use_token,
        )

    trainer = _run(main)
    with _groups_lock:
        _groups[group_name] = trainer
    return trainer.group


def disconnect_rollout_engines_from_distributed(
    *,
    group_name: str,
    model_update_group: dist.ProcessGroup,
    rollout_engines: list,  # type: ignore[type-arg]
) -> None:
    """Tear down the trainer's and every engine's side of ``group_name``.

    Idempotent, and completes when an engine is already dead or does not answer by the
    deadline (that is logged, not raised).
    """
    with _groups_lock:
        trainer = _groups.pop(group_name, None)
    deadline = _deadline()
    if trainer is None:
        handles = as_engine_handles(rollout_engines)

        async def leave_engines() -> None:
            for problem in await fleet.leave(handles, group_name, deadline):
                log.info("group %s: disconnect: %s", group_name, problem)

        _run(leave_engines)
        with contextlib.suppress(RuntimeError, ValueError):
            destroy_side_group(model_update_group)
        return

    async def main() -> list[str]:
        return await fleet.disconnect(trainer, deadline=deadline)

    _run(main)


@contextlib.contextmanager
def _held(lock: Any, deadline: Deadline) -> Iterator[None]:
    """Hold NeMo-RL's rollout-engine lock: None, a Ray actor lock, or a threading lock."""
    if lock is None:
        yield
        return
    if is_ray_actor(lock):
        import ray

        while not ray.get(lock.acquire.remote(), timeout=max(0.01, deadline.remaining())):
            if deadline.expired:
                raise SyncTimeoutError("the rollout-engine lock was not acquired by the deadline")
            # The actor lock said no: try again shortly. A plain sleep is right here: this
            # runs in the caller's thread (the reference's functions block by contract),
            # never on an event loop; the bucket itself runs on the background loop.
            time.sleep(LOCK_POLL)
        try:
            yield
        finally:
            ray.get(lock.release.remote(), timeout=max(1.0, deadline.remaining()))
        return
    acquire = getattr(lock, "acquire", None)
    if not callable(acquire) or not callable(getattr(lock, "release", None)):
        raise CompatTypeError(f"rollout_engine_lock of type {type(lock).__name__} is not a lock")
    if not acquire(timeout=deadline.remaining()):
        raise SyncTimeoutError("the rollout-engine lock was not acquired by the deadline")
    try:
        yield
    finally:
        lock.release()


def broadcast_hf_buckets_via_distributed_impl(
    *,
    bucket_iterator: Iterable[list[tuple[str, torch.Tensor]]],
    rollout_engines: list,  # type: ignore[type-arg]
    rollout_engine_lock: Any,
    group_name: str,
    model_update_group: dist.ProcessGroup,
    weight_version: int,
) -> None:
    """Broadcast each bucket to every engine of ``group_name`` (trainer rank 0 only).

    Per bucket, with ``rollout_engine_lock`` held: the tensors' names, dtypes and shapes go
    to every engine (``update_weights_from_distributed``), rank 0 broadcasts each tensor
    (or the packed bucket, see ``AIOSYNC_BROADCAST_FORMAT``), and every engine's answer is
    checked as :func:`check_weight_sync_results` does; the next bucket is read only then.
    The buckets are read in the caller's thread; the version streams through aiosync's
    one send loop on the background event loop. One deadline covers the whole call;
    an engine that dies or stalls ends it with an error naming that engine. Any failure
    breaks the group: disconnect and connect again. Engines keep their previous version.
    """
    with _groups_lock:
        trainer = _groups.get(group_name)
    if trainer is None or trainer.group is not model_update_group:
        raise CompatValueError(
            f"group {group_name!r} is not connected here with this model_update_group "
            "(call connect_rollout_engines_from_distributed first)"
        )
    if len(rollout_engines) != len(trainer.handles):
        raise CompatValueError(
            f"{len(rollout_engines)} rollout engines given, {len(trainer.handles)} connected"
        )
    deadline = _deadline()
    buckets = CallerBuckets(deadline)
    streaming = _loop().start_task_soon(
        functools.partial(
            fleet.send_version,
            trainer,
            buckets,
            deadline=deadline,
            weight_version=weight_version,
            flattened=_flattened(),
        )
    )
    try:
        for bucket in bucket_iterator:
            with _held(rollout_engine_lock, deadline):
                if bucket and not buckets.put(bucket):
                    break  # the version failed: its error is raised below
    except BaseException:
        buckets.close(abandoned=True)
        with contextlib.suppress(BaseException):  # the stream ends before the error leaves
            streaming.result(timeout=deadline.remaining() + fleet.CLEANUP_WAIT)
        raise
    buckets.close()
    _translated(functools.partial(streaming.result, deadline.remaining() + fleet.CLEANUP_WAIT))
