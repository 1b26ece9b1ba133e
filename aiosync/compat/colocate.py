"""NeMo-RL's colocated path by its names and signatures, on :mod:`aiosync.topology`.

:func:`compat_engine_gpu_offsets` (NeMo-RL's ``_derive_engine_gpu_offsets``),
:func:`connect_colocate_topology` and
:func:`send_hf_buckets_via_ipc_actor_impl` keep the reference's blocking signatures and its
``worker_state`` keys. The differences: each rank's bucket description is msgpack bytes in a
``uint8`` tensor, never a pickled object; the engine at the other end is an aiosync
:class:`~aiosync.topology.ColocatedReceiver` (reached through any engine handle: a Ray
actor, an aiosync handle, an object in this process), not SGLang's tensor loader; and one
more call after the last bucket makes the version current on the engines. Errors keep the
reference's builtin types and are aiosync errors too.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import torch

from aiosync.compat.errors import translate
from aiosync.runtime import run, unwrap_group
from aiosync.topology import connect_topology, derive_engine_gpu_offsets, send_colocated

T = TypeVar("T")

OVERLAP_ENV = "AIOSYNC_COLOCATE_OVERLAP"
"""``1``: read and pack bucket k+1 while bucket k is handed over (default ``0``)."""


def _blocking(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion from sync code, in a thread when a loop already runs."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run(main)
    out: list[T] = []
    error: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def target() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            out.append(run(main))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="aiosync-colocate")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return out[0]


def _translated(exc: BaseException, context: str) -> BaseException:
    cause = unwrap_group(exc)
    return translate(cause, context) if isinstance(cause, Exception) else cause


def compat_engine_gpu_offsets(engine_gpu_counts: list[int]) -> list[int]:
    """Cumulative-sum offsets for a dense engine layout (``[2, 2] -> [0, 2]``).

    Raises ``ValueError`` (also an ``AiosyncError``) for a count that is not a positive
    integer.
    """
    try:
        return derive_engine_gpu_offsets(engine_gpu_counts)
    except ValueError as exc:
        raise _translated(exc, "") from exc


def connect_colocate_topology(
    *,
    engine_gpu_counts: list[int],
    engine_gpu_offsets: list[int] | None = None,
    worker_state: dict[str, Any],
) -> None:
    """Build one Gloo gather group per engine's rank range; every trainer rank calls it.

    Stores in ``worker_state`` the reference's keys: ``_ipc_gather_group`` (this rank's
    engine group, None on a placeholder rank no engine covers), ``_ipc_gather_groups``
    (every group of the layout, for a rebuild to destroy), ``_ipc_gather_src`` (the engine's
    first rank), ``_ipc_engine_index`` and ``_ipc_layout_key``; plus aiosync's own
    (:mod:`aiosync.topology.connect`). The same layout again is a no-op; a changed one
    destroys every old group and rebuilds. ``ValueError`` for empty counts, mismatched
    lengths, overlapping engines or one past the last rank; ``RuntimeError`` without
    torch.distributed. Collectives on the groups wait at most ``AIOSYNC_TIMEOUT`` seconds
    (default 120).
    """
    try:
        connect_topology(
            engine_gpu_counts=engine_gpu_counts,
            engine_gpu_offsets=engine_gpu_offsets,
            worker_state=worker_state,
        )
    except Exception as exc:
        raise _translated(exc, "connect_colocate_topology") from exc


def send_hf_buckets_via_ipc_actor_impl(
    *,
    bucket_iterator: Iterable[list[tuple[str, torch.Tensor]]],
    rollout_engines: list[Any],
    worker_state: dict[str, Any],
    weight_version: int | None = None,
) -> None:
    """Hand each bucket to this rank's colocated engine, all covered ranks together.

    Per bucket: this rank packs its tensors (all dtypes, one flattened buffer: CUDA IPC on
    a GPU, a sealed shared-memory segment on the CPU), its description is gathered to the
    engine's source rank as msgpack bytes, the source calls the engine's
    ``update_weights_from_tensor`` and checks the answer, every covered rank learns the
    outcome together, and this rank drops its references before the next bucket.
    Placeholder ranks return at once and join no collective; non-source ranks call no
    engine. ``weight_version`` is passed to the engine as given; None lets it move to its
    next version. Raises ``RuntimeError`` (also an ``AiosyncError``) naming the engine when
    any engine fails a bucket, on every covered rank. One bucket at a time, as the
    reference; ``AIOSYNC_COLOCATE_OVERLAP=1`` packs the next bucket into a second buffer
    while one is handed over (faster, one more bucket in memory).
    """
    overlap = os.environ.get(OVERLAP_ENV, "0") == "1"

    async def main() -> None:
        await send_colocated(
            bucket_iterator=bucket_iterator,
            rollout_engines=rollout_engines,
            worker_state=worker_state,
            weight_version=weight_version,
            overlap=overlap,
        )

    try:
        _blocking(main)
    except Exception as exc:
        raise _translated(exc, "send_hf_buckets_via_ipc_actor_impl") from exc


__all__ = [
    "compat_engine_gpu_offsets",
    "connect_colocate_topology",
    "send_hf_buckets_via_ipc_actor_impl",
]
