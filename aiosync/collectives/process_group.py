"""Side process groups: torch.distributed groups that live beside the default world.

:func:`init_process_group` has the reference semantics of NeMo-RL's function of that name
(itself SGLang's ``init_custom_process_group``): it replays torch's rendezvous and group
construction but never installs the result as the default group, so a trainer that already
holds a default world (Megatron, FSDP) can add any number of weight-update groups, each
with its own backend, ranks and world size.

Keys of a group live under a prefix of its ``group_name`` in the store (torch's group
helper adds it). A store made by :mod:`aiosync.collectives.rendezvous` adds one more prefix
holding a random token, so that a peer who reaches the store but was never told the token
(over aiosync's authenticated control channel) cannot take part in the rendezvous.

Everything here touches torch's private ``distributed_c10d`` module in one place (written
against torch 2.13's source, tested with 2.13 on CPU; the helper's argument renamed in 2.6
is handled).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Store
from torch.distributed.rendezvous import rendezvous as torch_rendezvous

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""torch's default process-group timeout, used when none is given (as the reference does)."""


def init_process_group(
    backend: str | dist.Backend | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str | None = None,
    pg_options: Any = None,
) -> dist.ProcessGroup:
    """Create a process group of ``world_size`` ranks that is NOT the default group.

    Exactly one rendezvous source: ``store`` (then ``world_size`` and ``rank`` are
    required) or ``init_method`` (``env://`` when neither is given); both is a
    ``ValueError``. ``backend`` is ``"gloo"``, ``"nccl"`` or None (Gloo on CPU, NCCL on
    CUDA). Keys are written under a prefix of ``group_name``; ranks that mean the same
    group must pass the same name, and one process cannot hold two groups of one name
    (``ValueError``). ``timeout`` bounds the rendezvous and, for Gloo, every collective.
    ``pg_options`` go to the backend (NCCL's ``ProcessGroupNCCL.Options``).

    Blocks until every rank has joined (run it off the event loop). The returned group
    works with ``torch.distributed`` collectives (``group=``) and ``destroy_process_group``.
    """
    if store is not None and init_method is not None:
        raise ValueError("pass either store or init_method, not both (the rendezvous is ambiguous)")
    if store is not None:
        if world_size <= 0:
            raise ValueError(f"world_size must be positive with a store, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) with a store, got {rank}")
    chosen = dist.Backend(backend) if backend else dist.Backend("undefined")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    if group_name is None:
        group_name = c10d._process_group_name([], use_hashed_name=False)
    if store is None:
        meeting = torch_rendezvous(init_method or "env://", rank, world_size, timeout=timeout)
        store, rank, world_size = next(meeting)
        store.set_timeout(timeout)
    options = {"backend_options": pg_options} if _new_helper_api() else {"pg_options": pg_options}
    with _no_split_from_default(), _nccl_errors_not_fatal():
        group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            chosen,
            store,
            group_name=group_name,  # type: ignore[arg-type]
            timeout=timeout,
            **options,
        )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    log.debug("side group %s: rank %d of %d (%s)", group_name, rank, world_size, chosen)
    side: dist.ProcessGroup = group
    return side


def destroy_side_group(group: dist.ProcessGroup | None) -> None:
    """Release ``group`` (idempotent: an unknown, destroyed or aborted group is a no-op).

    Never touches the default group: ``None`` does nothing, where torch's own
    ``destroy_process_group(None)`` would tear down the whole world.
    """
    if group is None or group not in c10d._world.pg_map:
        return
    dist.destroy_process_group(group)


def abort_side_group(group: dist.ProcessGroup | None) -> bool:
    """Abort ``group``'s NCCL communicator so its blocked collectives return; True if done.

    This is torch's process-group abort (``ncclCommAbort``): a collective stuck waiting
    for a dead or frozen peer ends with an error on this rank, and the group is unusable
    (make a new one to reconnect). Gloo has no such abort, and destroying a Gloo group
    under a blocked collective is not safe: a blocked Gloo collective ends when the group's
    timeout passes, which is why aiosync creates Gloo groups with a timeout no longer than
    its deadline. For a group without NCCL (or already gone) this returns False.
    """
    if group is None or group not in c10d._world.pg_map:
        return False
    try:
        nccl = group_backend(group, "cuda") == "nccl"
    except RuntimeError:  # no backend for CUDA devices in this group
        nccl = False
    if not nccl:
        return False
    c10d._abort_process_group(group)
    return True


def group_backend(group: dist.ProcessGroup, device: torch.device | str = "cpu") -> str:
    """The backend carrying ``group``'s collectives on ``device``: ``"nccl"``, ``"gloo"``..."""
    backend = group._get_backend(torch.device(device))
    name = type(backend).__name__.lower()
    return name.removeprefix("processgroup")


def _new_helper_api() -> bool:
    """True where torch (2.6 on) names the helper's ``pg_options`` argument ``backend_options``."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


@contextlib.contextmanager
def _no_split_from_default() -> Iterator[None]:
    """Keep torch from splitting a side group's NCCL communicator off the default one.

    torch splits new groups from the default group when that group is bound to a device;
    a side group's ranks are not the default world's, so the split would be wrong. The
    binding is hidden for the duration of the call (group creation is not concurrent).
    """
    default = c10d.GroupMember.WORLD if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None) if default is not None else None
    if default is None or bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""torch's switch for what an NCCL group does on a communicator error or a timeout."""


@contextlib.contextmanager
def _nccl_errors_not_fatal() -> Iterator[None]:
    """Make a side group's NCCL errors abort its communicator, not end the process.

    torch's default (``3``) tears the whole process down when its watchdog sees an NCCL
    error, such as a peer that died mid-broadcast; an engine whose trainer died must
    instead fail the version and keep serving. ``2`` (clean up only) aborts the
    communicator and leaves the error to the caller. torch reads the variable when it
    builds the group, so it is set for that call only, and a value the user set wins.
    """
    if ERROR_HANDLING in os.environ:
        yield
        return
    os.environ[ERROR_HANDLING] = "2"
    try:
        yield
    finally:
        os.environ.pop(ERROR_HANDLING, None)
