"""Building the Gloo subgroups of a colocated layout, collectively, and caching them.

Every trainer rank calls :func:`connect_topology` with the same layout (``dist.new_group``
is collective over the whole world: each rank creates every group, in the same order, even
those it is not a member of). One Gloo group per engine spans the ranks colocated with it;
one more spans every covered rank and is where they meet after each bucket. Gloo, whatever
the default group's backend, so descriptions travel as CPU tensors; each group's timeout
bounds every collective on it (a blocked Gloo call cannot be interrupted otherwise).

What a rank keeps, in the caller's ``worker_state`` (the seed's keys):

- ``_ipc_gather_group``: the group of this rank's engine, or None on a placeholder rank;
- ``_ipc_gather_groups``: every group made for this layout (this rank's handles), so a
  rebuild can destroy them all;
- ``_ipc_gather_src``: the engine's source rank (global rank of its first GPU), or None;
- ``_ipc_engine_index``: index of this rank's engine in the caller's engine list, or None;
  the caller resolves the handle at call time, so a replaced engine is picked up;
- ``_ipc_layout_key``: the layout's signature; connecting the same layout again is a no-op.

and, for :mod:`aiosync.topology.send`, ``_ipc_sync_group`` (the covered ranks' group, None
on a placeholder), ``_ipc_layout`` (the checked :class:`~aiosync.topology.layout.Layout`)
and ``_ipc_timeout`` (the groups' timeout, seconds).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from aiosync.core.errors import UsageError
from aiosync.topology.layout import Layout, LayoutError, plan_layout

log = logging.getLogger(__name__)

TIMEOUT_ENV = "AIOSYNC_TIMEOUT"
"""Seconds every collective of the colocated groups may wait (default 120)."""

KEYS = (
    "_ipc_gather_group",
    "_ipc_gather_groups",
    "_ipc_gather_src",
    "_ipc_engine_index",
    "_ipc_layout_key",
    "_ipc_sync_group",
    "_ipc_layout",
    "_ipc_timeout",
)
"""Every ``worker_state`` key :func:`connect_topology` writes."""


def default_timeout() -> float:
    """The deadline of a colocated collective: ``AIOSYNC_TIMEOUT`` seconds, or 120."""
    raw = os.environ.get(TIMEOUT_ENV, "120")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise UsageError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def _is_member(group: Any) -> bool:
    return isinstance(group, dist.ProcessGroup)


def disconnect_topology(worker_state: dict[str, Any]) -> None:
    """Destroy every group a previous connect made and clear its keys (idempotent).

    Local: destroying a group is not a collective, but ranks should do it together, since
    a peer still inside a collective on a destroyed group waits until the group's timeout.
    """
    for group in worker_state.get("_ipc_gather_groups") or []:
        if _is_member(group):
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:  # already gone
                log.debug("destroying a colocated group: %s", exc)
    for key in KEYS:
        worker_state.pop(key, None)


def connect_topology(
    *,
    engine_gpu_counts: list[int],
    engine_gpu_offsets: list[int] | None = None,
    worker_state: dict[str, Any],
    timeout: float | None = None,
) -> Layout:
    """Make (or keep) the Gloo groups of a colocated layout; every trainer rank calls it.

    ``engine_gpu_counts[i]`` GPUs for engine ``i`` starting at ``engine_gpu_offsets[i]``
    (default: packed densely from rank 0). Raises :class:`LayoutError` (a ``ValueError``)
    for an empty or malformed
    layout (see :func:`~aiosync.topology.layout.plan_layout`) before touching any group, and
    :class:`UsageError` when torch.distributed is not initialised. The same layout as the
    cached one returns at once (no collective); a different one destroys every old group and
    builds the new ones. ``timeout`` (seconds, default ``AIOSYNC_TIMEOUT`` or 120) bounds
    each collective on the new groups. Returns the checked layout.
    """
    if not engine_gpu_counts:
        raise LayoutError("engine_gpu_counts is empty: a colocated topology needs an engine")
    if engine_gpu_offsets is not None and len(engine_gpu_offsets) != len(engine_gpu_counts):
        raise LayoutError(
            f"engine_gpu_offsets has {len(engine_gpu_offsets)} entries but "
            f"engine_gpu_counts has {len(engine_gpu_counts)}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("connect_colocate_topology needs torch.distributed initialised")
    layout = plan_layout(engine_gpu_counts, engine_gpu_offsets, dist.get_world_size())
    if worker_state.get("_ipc_layout_key") == layout.key:
        return layout
    seconds = default_timeout() if timeout is None else timeout
    if "_ipc_layout_key" in worker_state or "_ipc_gather_groups" in worker_state:
        log.info("colocated layout changed to %s: rebuilding its groups", layout.key)
        disconnect_topology(worker_state)
    rank = dist.get_rank()
    deadline = timedelta(seconds=seconds)
    groups: list[Any] = []
    try:
        for engine in layout.engines:  # every rank, every group, the same order
            groups.append(dist.new_group(engine.ranks, timeout=deadline, backend="gloo"))
        sync = dist.new_group(layout.covered_ranks, timeout=deadline, backend="gloo")
        groups.append(sync)
    except BaseException:
        worker_state["_ipc_gather_groups"] = groups
        disconnect_topology(worker_state)
        raise
    mine = layout.engine_of(rank)
    worker_state["_ipc_gather_groups"] = groups
    worker_state["_ipc_gather_group"] = None if mine is None else groups[mine.index]
    worker_state["_ipc_gather_src"] = None if mine is None else mine.source
    worker_state["_ipc_engine_index"] = None if mine is None else mine.index
    worker_state["_ipc_sync_group"] = sync if _is_member(sync) else None
    worker_state["_ipc_layout"] = layout
    worker_state["_ipc_timeout"] = seconds
    worker_state["_ipc_layout_key"] = layout.key
    return layout
