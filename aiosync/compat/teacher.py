"""Teacher-logits buffers for on-policy distillation, shared with student processes.

A teacher writes its logits for ``N_mb`` microbatches into one ``[N_mb, B, T, V]`` storage
and hands students a plain-data *handle* from which they open the same memory:

* CUDA storage travels as CUDA IPC: the handle is the tuple of
  :func:`aiosync.planes.cuda_handles.get_handle_from_tensor`, opened with
  :func:`aiosync.planes.cuda_handles.rebuild_cuda_tensor_from_ipc`.
* CPU storage lives in an aiosync POSIX shared-memory segment (:class:`ShmSegment`); its
  handle is ``("aiosync-teacher-shm", name, size, dtype_name, shape)``, built only of
  ``str``/``int``/tuples, so it survives pickling and a JSON round trip (which turns the
  tuples into lists; :func:`open_teacher_ipc_buffer` accepts both).

:func:`ensure_teacher_ipc_buffer` allocates lazily, grows but never shrinks, and re-exports
the handle only when it reallocates. Segments backing CPU storages sit in a module-level
registry keyed by the storage's data pointer, so callers hold nothing but the tensor and its
handle. A CPU segment's name stays in ``/dev/shm`` until the storage is replaced (the old
name is unlinked then), :func:`release_teacher_ipc_buffer` is called, or the process exits
normally; names left by killed processes are swept by
:func:`aiosync.planes.shm_files.sweep_stale_segments`.

:func:`aggregate_per_sample_handles` flattens the per-sample handles that DP x TP x CP
teacher workers return into one list in global-batch order.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aiosync import AiosyncError
from aiosync.compat.errors import (
    CompatAssertionError,
    CompatKeyError,
    CompatTypeError,
    CompatValueError,
)
from aiosync.core import layout
from aiosync.core.layout import dtype_from_name
from aiosync.core.wire import ShmHandle
from aiosync.planes.cuda_handles import get_handle_from_tensor, rebuild_cuda_tensor_from_ipc
from aiosync.planes.shm import ShmSegment

log = logging.getLogger(__name__)

__all__ = [
    "SHM_HANDLE_TAG",
    "aggregate_per_sample_handles",
    "ensure_teacher_ipc_buffer",
    "open_teacher_ipc_buffer",
    "release_all_teacher_ipc_buffers",
    "release_teacher_ipc_buffer",
]

SHM_HANDLE_TAG = "aiosync-teacher-shm"
"""First element of a CPU (shared-memory) teacher handle; CUDA handles never start with it."""

_NDIM = 4
_CUDA_HANDLE_LEN = 15  # length of torch's CUDA tensor rebuild argument tuple
_CUDA_DEVICE_SLOT = 6  # index of the device within that tuple

# Segments backing CPU storages this process allocated, keyed by the storage's data pointer.
_segments: dict[int, ShmSegment] = {}
_lock = threading.Lock()


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _normalize_device(device: torch.device | str | int) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _shm_handle(segment: ShmSegment, dtype: torch.dtype, shape: Sequence[int]) -> tuple[Any, ...]:
    return (
        SHM_HANDLE_TAG,
        segment.name,
        int(segment.size),
        layout.dtype_name(dtype),
        tuple(int(d) for d in shape),
    )


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    if device.type == "cuda":
        storage = torch.empty(shape, dtype=dtype, device=device)
        return storage, get_handle_from_tensor(storage)
    if device.type != "cpu":
        raise CompatValueError(f"teacher IPC buffers live on cuda or cpu, not {device}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    segment = ShmSegment.create(nbytes)
    try:
        storage = segment.tensor.view(dtype).view(shape)
        with _lock:
            _segments[_storage_key(storage)] = segment
    except BaseException:
        segment.close()
        raise
    return storage, _shm_handle(segment, dtype, shape)


def release_teacher_ipc_buffer(storage: torch.Tensor | None) -> bool:
    """Unlink the shared-memory segment backing ``storage`` and forget it.

    Returns ``True`` when ``storage`` (or any view of it) was a CPU storage allocated by
    :func:`ensure_teacher_ipc_buffer` in this process and its ``/dev/shm`` name is now gone;
    ``False`` for ``None``, CUDA storages and tensors this module did not allocate (nothing is
    done to those). Processes that already opened the storage, and ``storage`` itself, keep
    a valid mapping; only new opens from the old handle fail. Idempotent.
    """
    if storage is None or storage.device.type != "cpu":
        return False
    with _lock:
        segment = _segments.pop(_storage_key(storage), None)
    if segment is None:
        return False
    segment.close()
    log.debug("released teacher buffer segment %s", segment.name)
    return True


def release_all_teacher_ipc_buffers() -> int:
    """Unlink every segment this process allocated for teacher buffers; returns how many.

    Runs at normal interpreter exit too, so a teacher that exits cleanly leaves no names in
    ``/dev/shm``. Mappings held by tensors stay valid.
    """
    with _lock:
        segments = list(_segments.values())
        _segments.clear()
    for segment in segments:
        segment.close()
    if segments:
        log.debug("released %d teacher buffer segments", len(segments))
    return len(segments)


atexit.register(release_all_teacher_ipc_buffers)


def ensure_teacher_ipc_buffer(
    storage: torch.Tensor | None,
    handle: tuple[Any, ...] | None,
    num_microbatches: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Lazily allocate or grow a ``[N_mb, B, T, V]`` teacher-logits storage shareable by handle.

    Promises:

    * ``storage is None`` allocates a new storage of exactly the requested shape.
    * When ``storage`` is 4-D, at least the requested size in every dimension, of ``dtype``
      and on ``device`` (and, on CPU, allocated by this function), the very same tensor is
      returned with ``handle`` unchanged (re-exported only if ``handle`` is ``None``).
    * Otherwise a new storage is allocated whose every dimension is the maximum of the old
      and the requested size: the storage never shrinks. Its contents are not copied. A
      replaced CPU storage's segment name is unlinked from ``/dev/shm`` (the old tensor stays
      readable, but the old handle can no longer be opened); send students the new handle.

    The returned storage may be larger than requested; slice it to the current shape. CUDA
    storages are shared through CUDA IPC, CPU storages through POSIX shared memory (see the
    module docstring for the handle format). Open the handle elsewhere with
    :func:`open_teacher_ipc_buffer`; raises ``ValueError`` for a non-positive dimension or a
    device that is neither ``cuda`` nor ``cpu`` (:class:`~aiosync.compat.errors.CompatValueError`,
    also an ``AiosyncError``). Allocation failures are torch's own (out of memory, say).
    """
    requested = (int(num_microbatches), int(batch_size), int(seq_len), int(vocab_size))
    if any(d <= 0 for d in requested):
        raise CompatValueError(f"teacher buffer dimensions must be positive, got {requested}")
    dev = _normalize_device(device)

    if storage is not None and storage.dim() == _NDIM:
        current = tuple(int(d) for d in storage.shape)
        fits = all(c >= r for c, r in zip(current, requested, strict=True))
        same_kind = storage.dtype == dtype and _normalize_device(storage.device) == dev
        if dev.type == "cpu" and same_kind:
            with _lock:
                segment = _segments.get(_storage_key(storage))
            shareable = segment is not None
        else:
            segment, shareable = None, True
        if fits and same_kind and shareable:
            if handle is None:
                if segment is not None:
                    handle = _shm_handle(segment, storage.dtype, current)
                else:
                    handle = get_handle_from_tensor(storage)
            log.debug("reusing teacher buffer %s for request %s", current, requested)
            return storage, handle
        shape = tuple(max(c, r) for c, r in zip(current, requested, strict=True))
    else:
        shape = requested

    new_storage, new_handle = _allocate(shape, dtype, dev)
    if storage is not None:
        release_teacher_ipc_buffer(storage)
    log.info(
        "allocated teacher buffer %s %s on %s (requested %s)",
        list(shape),
        layout.dtype_name(dtype),
        dev,
        list(requested),
    )
    return new_storage, new_handle


def _open_shm(handle: Sequence[Any]) -> torch.Tensor:
    if len(handle) != 5:
        raise AiosyncError(f"shared-memory teacher handle has {len(handle)} fields, not 5")
    _, name, size, dtype_name, shape = handle
    if not isinstance(name, str) or not isinstance(size, int) or not isinstance(dtype_name, str):
        raise AiosyncError(f"malformed shared-memory teacher handle {tuple(handle)!r}")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise AiosyncError(f"malformed shape {shape!r} in teacher handle")
    dims = [int(d) for d in shape]
    dtype = dtype_from_name(dtype_name)
    numel = 1
    for d in dims:
        numel *= d
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if expected != size:
        raise AiosyncError(
            f"teacher handle for {name} claims {size} bytes but {dims} {dtype_name} needs "
            f"{expected}"
        )
    segment = ShmSegment.attach(ShmHandle(name=name, size=size))
    # The view keeps the mapping alive; the segment object itself can go.
    return segment.tensor.view(dtype).view(dims)


def open_teacher_ipc_buffer(handle: Sequence[Any], device_id: int | None = None) -> torch.Tensor:
    """Open, in another process, the storage a teacher exported with its handle.

    Returns a tensor of the exported shape and dtype viewing the teacher's memory: writes on
    either side are seen by the other. A shared-memory handle (first element
    :data:`SHM_HANDLE_TAG`; tuples or JSON lists) opens on CPU and ignores ``device_id``; any
    other handle is taken as a CUDA IPC handle and opened on ``device_id`` (default: the
    device it was exported from). CUDA IPC handles cannot be opened in the exporting process.
    Raises :class:`AiosyncError` for a malformed handle or a segment that is gone.
    """
    if len(handle) > 0 and isinstance(handle[0], str):
        if handle[0] != SHM_HANDLE_TAG:
            raise AiosyncError(f"unknown teacher handle kind {handle[0]!r}")
        return _open_shm(handle)
    if len(handle) != _CUDA_HANDLE_LEN or not isinstance(handle[0], type):
        raise AiosyncError("teacher handle is neither a shared-memory nor a CUDA IPC handle")
    cuda_handle = tuple(handle)
    if device_id is None:
        device_id = int(cuda_handle[_CUDA_DEVICE_SLOT])
    return rebuild_cuda_tensor_from_ipc(cuda_handle, device_id)


def aggregate_per_sample_handles(worker_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten teacher workers' per-sample handles into one list in global-batch order.

    Each result is ``{"dp_rank": int, "per_sample_handles": list}`` with handles in local
    sample order. Results sharing a ``dp_rank`` are TP/CP replicas contributing one shard per
    sample. Promises: samples are concatenated in ``sorted(dp_rank)`` order (rank 0 holds the
    first samples of the global batch), so the result is the same for any teacher DP degree;
    element ``i`` is ``{"teacher_shards": [shard, ...]}`` with global sample ``i``'s shards in
    the order their replicas appear in ``worker_results``.

    Errors keep NeMo-RL's types, as classes of :mod:`aiosync.compat.errors` that are also
    ``AiosyncError``: ``KeyError`` when a result lacks a key, ``TypeError`` when a result is
    not a mapping or its ``dp_rank`` is not an integer, and ``AssertionError`` (raised even
    under ``python -O``) naming the rank when replicas of one rank hold different numbers of
    samples or ranks have different numbers of replicas.
    """
    by_rank: dict[int, list[list[Any]]] = {}
    for index, result in enumerate(worker_results):
        if not isinstance(result, Mapping):
            raise CompatTypeError(
                f"worker result {index} is a {type(result).__name__}, not a mapping"
            )
        for key in ("dp_rank", "per_sample_handles"):
            if key not in result:
                raise CompatKeyError(f"worker result {index} lacks {key!r}")
        rank = result["dp_rank"]
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise CompatTypeError(f"worker result {index} has non-integer dp_rank {rank!r}")
        by_rank.setdefault(rank, []).append(list(result["per_sample_handles"]))

    aggregated: list[dict[str, Any]] = []
    replicas_per_rank: int | None = None
    for rank in sorted(by_rank):
        replicas = by_rank[rank]
        lengths = [len(r) for r in replicas]
        if len(set(lengths)) != 1:
            raise CompatAssertionError(
                f"replicas of dp_rank {rank} return different numbers of samples: {lengths}"
            )
        if replicas_per_rank is None:
            replicas_per_rank = len(replicas)
        elif len(replicas) != replicas_per_rank:
            raise CompatAssertionError(
                f"dp_rank {rank} has {len(replicas)} TP/CP replicas, others have "
                f"{replicas_per_rank}"
            )
        for sample in range(lengths[0]):
            aggregated.append({"teacher_shards": [r[sample] for r in replicas]})
    return aggregated
