"""The CUDA IPC data plane: device buffers one process exports and another opens.

Also the plain-data form of torch's CUDA IPC handle tuples, for the NeMo-RL names and the
teacher buffers that pass handles around themselves.
"""

from __future__ import annotations

from typing import Any

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import CudaIpcHandle, CudaIpcPlaneSpec


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


class CudaBuffer:
    """A CUDA allocation shared with other processes through CUDA IPC."""

    def __init__(self, tensor: torch.Tensor, handle: CudaIpcHandle) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._handle = handle

    @classmethod
    def create(cls, size: int, device: torch.device | int | str) -> CudaBuffer:
        """Allocate ``size`` bytes on ``device`` and export them."""
        tensor = torch.empty(size, dtype=torch.uint8, device=device)
        storage = tensor.untyped_storage()
        (
            dev,
            handle,
            storage_size,
            storage_offset,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()  # type: ignore[no-untyped-call]
        wire = CudaIpcHandle(
            device=int(dev),
            handle=bytes(handle),
            storage_size=int(storage_size),
            storage_offset=int(storage_offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=None if event_handle is None else bytes(event_handle),
            event_sync_required=bool(event_sync),
            size=size,
        )
        return cls(tensor, wire)

    @classmethod
    def attach(cls, handle: CudaIpcHandle, device: int | None = None) -> CudaBuffer:
        """Open a peer's buffer on ``device`` (default: the device index in the handle)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            (handle.size,),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            handle.device if device is None else device,
            handle.handle,
            handle.storage_size,
            handle.storage_offset,
            False,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
        return cls(tensor, handle)

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer's bytes on the GPU; raises once closed."""
        if self._tensor is None:
            raise AiosyncError("CUDA buffer is closed")
        return self._tensor

    @property
    def handle(self) -> CudaIpcHandle:
        """The plain-data IPC handle."""
        return self._handle

    def close(self) -> None:
        """Drop this process's reference; the allocator frees it once no peer holds it."""
        self._tensor = None


class CudaIpcSenderPlane:
    """A ring of CUDA buffers exported once; packing runs on a side stream.

    The side stream first waits for the device's current stream (where the trainer wrote
    its weights); :meth:`pack` returns once the copies are done.
    """

    def __init__(self, device: torch.device, count: int, capacity: int) -> None:
        self._device = device
        self._buffers = [CudaBuffer.create(capacity, device) for _ in range(count)]
        self._capacity = capacity
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @property
    def spec(self) -> CudaIpcPlaneSpec:
        """The buffers' IPC handles."""
        return CudaIpcPlaneSpec([buffer.handle for buffer in self._buffers])

    @property
    def capacity(self) -> int:
        """Bytes of each buffer."""
        return self._capacity

    @property
    def count(self) -> int:
        """Number of buffers."""
        return len(self._buffers)

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Copy the bucket on the side stream and wait for it."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            pack_bucket(self._buffers[index].tensor, plan)
        stream.synchronize()

    async def publish(self, index: int, used: int) -> None:
        """Nothing to do: engines read the same device memory."""

    def close(self) -> None:
        """Drop the buffers (freed once no engine holds them)."""
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()


class CudaIpcReceiverPlane:
    """An engine's views of a sender's CUDA buffers, opened on the engine's device."""

    def __init__(self, spec: CudaIpcPlaneSpec, device: torch.device) -> None:
        index = device.index if device.type == "cuda" else None
        self._buffers = [CudaBuffer.attach(handle, index) for handle in spec.buffers]

    def view(self, index: int, used: int) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index``."""
        return self._buffers[index].tensor[:used]

    def close(self) -> None:
        """Drop this engine's views."""
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()
