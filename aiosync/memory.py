"""Shareable byte buffers: POSIX shared memory for CPU, CUDA IPC for GPU.

A buffer is a flat ``uint8`` tensor plus a plain-data handle (:mod:`aiosync.wire`) that
another process on this machine turns back into a view of the same memory. No sockets here.

Shared-memory segments live under ``/dev/shm`` as ``aiosync-<pidns>-<pid>-<token>``, where
``pidns`` identifies the creator's PID namespace. Both ends unlink a segment as soon as the
receiver has mapped it, so a killed process leaks nothing; :func:`sweep_stale_segments`
removes the few left by processes of this PID namespace killed before that point (a pid
from another namespace, say another container sharing ``/dev/shm``, says nothing here).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any, Protocol

import torch

from aiosync.errors import AiosyncError
from aiosync.wire import BufferHandle, CudaIpcHandle, ShmHandle

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aiosync-"
_SHM_NAME = re.compile(r"^aiosync-(\d+)-(\d+)-[0-9a-f]{16}$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class SharedBuffer(Protocol):
    """What the pipeline needs of a buffer: its bytes, its handle, and a way to let go."""

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a flat ``uint8`` tensor."""

    @property
    def handle(self) -> BufferHandle:
        """Plain data another process opens the buffer from."""

    def close(self) -> None:
        """Release this process's hold on the buffer (idempotent)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose creating process no longer exists; returns their names."""
    removed = []
    namespace = _pid_namespace()
    for path in shm_dir.glob(SHM_PREFIX + "*"):
        match = _SHM_NAME.match(path.name)
        if match and int(match.group(1)) == namespace and not _pid_alive(int(match.group(2))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.warning("removed %d shared-memory segments left by dead processes", len(removed))
    return removed


class ShmSegment:
    """A POSIX shared-memory segment mapped as a flat ``uint8`` tensor.

    The creator owns the name and unlinks it on :meth:`close`; the mapping itself lives as
    long as any tensor viewing it, in every process that mapped it.
    """

    def __init__(self, name: str, size: int, *, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._path = SHM_DIR / name
        self._tensor: torch.Tensor | None = torch.from_file(
            str(self._path), shared=True, size=size, dtype=torch.uint8
        )

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Create a new segment of ``size`` bytes, readable and writable by this user only."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        sweep_stale_segments()
        name = f"{SHM_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            return cls(name, size, owner=True)
        except BaseException:
            (SHM_DIR / name).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, handle: ShmHandle) -> ShmSegment:
        """Map a segment another process created; checks the name and size it claims."""
        if not _SHM_NAME.match(handle.name):
            raise AiosyncError(f"refusing shared-memory name {handle.name!r}")
        path = SHM_DIR / handle.name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise AiosyncError(f"shared-memory segment {handle.name} does not exist") from None
        if actual != handle.size:
            raise AiosyncError(
                f"shared-memory segment {handle.name} holds {actual} bytes, not {handle.size}"
            )
        return cls(handle.name, handle.size, owner=False)

    @property
    def tensor(self) -> torch.Tensor:
        """The mapped bytes; raises once the segment is closed."""
        if self._tensor is None:
            raise AiosyncError(f"shared-memory segment {self.name} is closed")
        return self._tensor

    @property
    def handle(self) -> ShmHandle:
        """The segment's name and size."""
        return ShmHandle(name=self.name, size=self.size)

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm``; existing mappings stay valid (idempotent)."""
        self._path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop this process's view, and the name too when this process created it."""
        if self.owner:
            self.unlink()
        self._tensor = None


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
    from aiosync.layout import dtype_name

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
    from aiosync.layout import dtype_from_name

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


def create_buffer(size: int, device: torch.device) -> SharedBuffer:
    """A new shareable buffer of ``size`` bytes: shared memory on CPU, CUDA IPC on GPU."""
    if device.type == "cuda":
        return CudaBuffer.create(size, device)
    if device.type == "cpu":
        return ShmSegment.create(size)
    raise ValueError(f"no shareable buffer kind for device {device}")


def open_buffer(handle: BufferHandle, cuda_device: int | None = None) -> SharedBuffer:
    """Map a buffer a peer exported; CUDA buffers open on ``cuda_device`` when given."""
    if isinstance(handle, ShmHandle):
        return ShmSegment.attach(handle)
    return CudaBuffer.attach(handle, cuda_device)
