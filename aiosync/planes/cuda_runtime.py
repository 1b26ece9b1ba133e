"""Device memory with legacy CUDA IPC handles, through the CUDA runtime library (ctypes).

torch's caching allocator exports its blocks for IPC in a form that depends on its settings:
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` a block is exported as file
descriptors that the peer fetches with ``pidfd_getfd`` (which needs ``CAP_SYS_PTRACE`` or a
permissive ptrace scope, and which many containers forbid). Memory from ``cudaMalloc`` always
exports a plain ``cudaIpcMemHandle_t`` (64 bytes) that any process of the same user opens with
``cudaIpcOpenMemHandle``, whatever either side's allocator does. :class:`DeviceMemory` is such
an allocation, or such a mapping of a peer's, seen by torch as a flat ``uint8`` tensor.

The runtime library is the one torch loaded (found in ``/proc/self/maps``), so both share the
device's primary context.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from typing import Any

import torch

from aiosync.core.errors import AiosyncError

IPC_HANDLE_BYTES = 64
"""Bytes of a ``cudaIpcMemHandle_t`` and of a ``cudaIpcEventHandle_t``."""

_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: a copy's direction follows from its (unified) addresses."""


class IpcHandle(ctypes.Structure):
    """A ``cudaIpcMemHandle_t`` (or event handle) as ctypes passes it: 64 opaque bytes."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None


def _library_path() -> str:
    """Where torch's CUDA runtime library is (loaded), or the best candidate on disk."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    here = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in ("nvidia/*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
        found = sorted(glob.glob(os.path.join(here, pattern)))
        if found:
            return found[-1]
    return ctypes.util.find_library("cudart") or "libcudart.so"


def runtime() -> ctypes.CDLL:
    """The CUDA runtime library (loaded once; CUDA is initialised through torch first)."""
    global _runtime
    with _lock:
        if _runtime is None:
            torch.cuda.init()  # type: ignore[no-untyped-call]
            lib = ctypes.CDLL(_library_path())
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaIpcOpenMemHandle.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                IpcHandle,
                ctypes.c_uint,
            ]
            lib.cudaMemcpyAsync.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            lib.cudaMemcpyAsync.restype = ctypes.c_int
            _runtime = lib
        return _runtime


_driver: ctypes.CDLL | None = None
_driver_lock = threading.Lock()


def driver() -> ctypes.CDLL:
    """The CUDA driver library (the one torch loaded), with the signatures aiosync calls."""
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuPointerGetAttributes.argtypes = [
                ctypes.c_uint,
                ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_uint64,
            ]
            lib.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
            for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
                if hasattr(lib, name):  # stream memory operations (CUDA 11.7 on)
                    call = getattr(lib, name)
                    call.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_uint64,
                        ctypes.c_uint32,
                        ctypes.c_uint,
                    ]
                    call.restype = ctypes.c_int
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = lib
        return _driver


def check_cuda(code: int, what: str) -> None:
    """Raise :class:`AiosyncError` naming ``what`` and CUDA's text unless ``code`` is 0."""
    if code != 0:
        text = runtime().cudaGetErrorString(code)
        raise AiosyncError(f"{what} failed: {text.decode() if text else code} (CUDA error {code})")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` on ``stream`` (a handle).

    What ``torch``'s ``copy_`` of two contiguous tensors on one device queues, for a few
    microseconds of host time instead of tens: a bucket of many tensors is queued in a
    fraction of the time. The caller checks both ranges; the current device must be the
    stream's.
    """
    code = runtime().cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream or None)
    if code != 0:
        check_cuda(code, "cudaMemcpyAsync")


def _use_device(index: int) -> None:
    check_cuda(runtime().cudaSetDevice(ctypes.c_int(index)), f"cudaSetDevice({index})")


class _Interface:
    """A ``__cuda_array_interface__`` over raw device memory (what torch.as_tensor reads)."""

    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 2,
            "strides": None,
        }


def device_tensor(pointer: int, size: int, device: int) -> torch.Tensor:
    """``size`` bytes of device memory at ``pointer`` as a flat ``uint8`` tensor on ``device``.

    The tensor does not own the memory: it is valid while whoever mapped it keeps it.
    """
    return torch.as_tensor(_Interface(pointer, size), device=torch.device("cuda", device))


class DeviceMemory:
    """``size`` bytes of device memory: this process's own (exportable) or a peer's, opened.

    :attr:`tensor` is valid until :meth:`close`; closing frees an own allocation or unmaps a
    peer's, after waiting for the device, so no queued copy reads freed memory.
    """

    def __init__(self, pointer: int, size: int, device: int, handle: bytes, owned: bool) -> None:
        self._pointer: int | None = pointer
        self.size = size
        self.device = device
        self.handle = handle
        self._owned = owned
        self._tensor: torch.Tensor | None = device_tensor(pointer, size, device)

    @classmethod
    def allocate(cls, size: int, device: int) -> DeviceMemory:
        """``cudaMalloc`` ``size`` bytes on ``device`` and export a legacy IPC handle."""
        lib = runtime()
        with torch.cuda.device(device):
            _use_device(device)
            pointer = ctypes.c_void_p()
            check_cuda(lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)), "cudaMalloc")
            assert pointer.value is not None
            handle = IpcHandle()
            code = lib.cudaIpcGetMemHandle(ctypes.byref(handle), pointer)
            if code != 0:
                lib.cudaFree(pointer)
                check_cuda(code, "cudaIpcGetMemHandle")
            raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
            return cls(pointer.value, size, device, raw, owned=True)

    @classmethod
    def open(cls, handle: bytes, size: int, device: int) -> DeviceMemory:
        """Map a peer's allocation (its legacy IPC handle) on local ``device``."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise AiosyncError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        lib = runtime()
        with torch.cuda.device(device):
            _use_device(device)
            pointer = ctypes.c_void_p()
            raw = IpcHandle()
            ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
            code = lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _LAZY_ENABLE_PEER_ACCESS)
            check_cuda(code, "cudaIpcOpenMemHandle")
            assert pointer.value is not None
            return cls(pointer.value, size, device, handle, owned=False)

    @property
    def tensor(self) -> torch.Tensor:
        """The memory as flat ``uint8`` on its device; raises once closed."""
        if self._tensor is None:
            raise AiosyncError("CUDA memory is closed")
        return self._tensor

    def close(self) -> None:
        """Free (own) or unmap (a peer's) once the device is idle (idempotent)."""
        pointer, self._pointer, self._tensor = self._pointer, None, None
        if pointer is None:
            return
        lib = runtime()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            _use_device(self.device)
            if self._owned:
                check_cuda(lib.cudaFree(ctypes.c_void_p(pointer)), "cudaFree")
            else:
                check_cuda(
                    lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)), "cudaIpcCloseMemHandle"
                )
