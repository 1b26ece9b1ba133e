"""torch's CUDA IPC handle tuples and their plain-data form (the seed's names, teacher buffers).

:func:`get_handle_from_tensor` exports a CUDA tensor as the argument tuple of torch's own
rebuild, :func:`rebuild_cuda_tensor_from_ipc` opens it in another process; the NeMo-RL names
(:mod:`aiosync.compat.nemo_rl`) and the teacher buffers (:mod:`aiosync.compat.teacher`) pass
these handles around themselves. :func:`ipc_handle_to_plain` and :func:`ipc_handle_from_plain`
turn a tuple into str/int/bool/bytes and back, for JSON or msgpack. aiosync's own streams do
not use them: their CUDA plane is :mod:`aiosync.planes.cuda`.
"""

from __future__ import annotations

from typing import Any

import torch


def get_handle_from_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Export a CUDA tensor for IPC: the argument tuple of torch's CUDA tensor rebuild."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"IPC handles are for CUDA tensors; this one is on {tensor.device}")
    return tuple(reduce_tensor(tensor)[1])  # type: ignore[no-untyped-call]


_DEVICE_SLOT = 6  # index of the storage device within torch's rebuild arguments


def ipc_handle_to_plain(handle: tuple[Any, ...]) -> dict[str, Any]:
    """The plain-data form (str, int, bool, bytes) of a :func:`get_handle_from_tensor` tuple.

    It travels over JSON (hex bytes) or msgpack; :func:`ipc_handle_from_plain` inverts it.
    """
    from aiosync.core.layout import dtype_name

    (_, size, stride, offset, _, dtype, device, ipc, storage_size, storage_offset,
     requires_grad, ref_handle, ref_offset, event, event_sync) = handle  # fmt: skip
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": bytes(ipc).hex(),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "requires_grad": bool(requires_grad),
        "ref_counter_handle": bytes(ref_handle).hex(),
        "ref_counter_offset": int(ref_offset),
        "event_handle": None if event is None else bytes(event).hex(),
        "event_sync_required": bool(event_sync),
    }


def ipc_handle_from_plain(plain: dict[str, Any]) -> tuple[Any, ...]:
    """Rebuild the handle tuple that :func:`rebuild_cuda_tensor_from_ipc` takes."""
    from aiosync.core.layout import dtype_from_name

    event = plain["event_handle"]
    return (
        torch.Tensor,
        torch.Size(plain["size"]),
        tuple(plain["stride"]),
        plain["offset"],
        torch.storage.TypedStorage,
        dtype_from_name(plain["dtype"]),
        plain["device"],
        bytes.fromhex(plain["handle"]),
        plain["storage_size"],
        plain["storage_offset"],
        plain["requires_grad"],
        bytes.fromhex(plain["ref_counter_handle"]),
        plain["ref_counter_offset"],
        None if event is None else bytes.fromhex(event),
        plain["event_sync_required"],
    )


def rebuild_cuda_tensor_from_ipc(cuda_ipc_handle: tuple[Any, ...], device_id: int) -> torch.Tensor:
    """Open a tensor exported by :func:`get_handle_from_tensor` on local device ``device_id``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(cuda_ipc_handle)
    args[_DEVICE_SLOT] = device_id
    tensor: torch.Tensor = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return tensor


__all__ = [
    "get_handle_from_tensor",
    "ipc_handle_from_plain",
    "ipc_handle_to_plain",
    "rebuild_cuda_tensor_from_ipc",
]
