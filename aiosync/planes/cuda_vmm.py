"""CUDA's virtual memory API through ctypes on libcuda: physical allocations, shared as fds.

Under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` torch's caching allocator
reserves address space and maps physical allocations into it (``cuMemCreate`` pages of
20 MiB for large blocks and 2 MiB for small ones, one ``cuMemMap`` each): such memory has
no legacy IPC handle, but each allocation can be exported as a POSIX file descriptor when
it was created with that handle type (torch asks for it, or for a fabric handle where the
system allows one). Here:

- :class:`MappingQuery`: the physical allocation mapped at a device address, as a
  :class:`Mapping` (its mapping's base and size, the driver's process-wide id of the
  allocation, and the handle types it may be exported as);
- :func:`export_fd`: a new file descriptor for the allocation mapped at an address
  (``cuMemRetainAllocationHandle``, ``cuMemExportToShareableHandle``, ``cuMemRelease``);
  the descriptor keeps the allocation alive until it is closed;
- :class:`Imports` and :class:`ImportedMemory`: an engine's import of such descriptors as
  they arrive (``cuMemImportFromShareableHandle``; each may be closed right after) and its
  mapping of them one after the other in address space of its own
  (``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``), read-only where the driver
  allows it, seen by torch as one flat ``uint8`` tensor; closing unmaps and releases it.

The driver library is torch's (:func:`~aiosync.planes.cuda_runtime.driver`), set up on
first use: importing this module touches no CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiosync.core.errors import AiosyncError
from aiosync.planes.cuda_runtime import device_tensor, driver, runtime

log = logging.getLogger(__name__)

# CUpointer_attribute values (cuda.h)
ATTR_ALLOWED_HANDLE_TYPES = 14
ATTR_MAPPING_SIZE = 18
ATTR_MAPPING_BASE_ADDR = 19
ATTR_MEMORY_BLOCK_ID = 20

POSIX_FD = 0x1
"""``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` (a bit of the allowed handle types)."""
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_PROT_READ = 0x1  # CU_MEM_ACCESS_FLAGS_PROT_READ
_PROT_READWRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    """``CUmemLocation``: a location type and an id (the device ordinal)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: a location and the access it gets (``CUmemAccess_flags``)."""

    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@dataclass(frozen=True)
class Mapping:
    """One physical allocation as mapped here.

    ``base`` and ``size`` of its mapping, ``block`` (the driver's id of the allocation,
    unique in the process for its life) and ``handle_types`` (the
    ``CUmemAllocationHandleType`` bits it may be exported as).
    """

    base: int
    size: int
    block: int
    handle_types: int


_lock = threading.Lock()
_ready = False


def _vmm() -> ctypes.CDLL:
    """The driver with the signatures of the calls below (set once)."""
    global _ready
    lib = driver()
    with _lock:
        if not _ready:
            u64, size = ctypes.c_uint64, ctypes.c_size_t
            flags = ctypes.c_ulonglong
            signatures: dict[str, list[object]] = {
                "cuMemRetainAllocationHandle": [ctypes.POINTER(u64), ctypes.c_void_p],
                "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, flags],
                "cuMemImportFromShareableHandle": [
                    ctypes.POINTER(u64),
                    ctypes.c_void_p,
                    ctypes.c_int,
                ],
                "cuMemRelease": [u64],
                "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, flags],
                "cuMemAddressFree": [u64, size],
                "cuMemMap": [u64, size, size, u64, flags],
                "cuMemUnmap": [u64, size],
                "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
            }
            for name, argtypes in signatures.items():
                call = getattr(lib, name)
                call.argtypes = argtypes
                call.restype = ctypes.c_int
            _ready = True
    return lib


def check_driver(code: int, what: str) -> None:
    """Raise :class:`AiosyncError` naming ``what`` and the driver's text unless ``code`` is 0."""
    if code != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(code, ctypes.byref(text))
        said = text.value.decode() if text.value else "unknown error"
        raise AiosyncError(f"{what} failed: {said} (CUDA error {code})")


class MappingQuery:
    """:func:`mapping_at` with its ctypes arguments made once: one thread's at a time."""

    def __init__(self) -> None:
        self.values = [ctypes.c_uint64(0) for _ in range(4)]
        kinds = (ATTR_MAPPING_BASE_ADDR, ATTR_MAPPING_SIZE, ATTR_MEMORY_BLOCK_ID)
        self.kinds = (ctypes.c_int * 4)(*kinds, ATTR_ALLOWED_HANDLE_TYPES)
        self.data = (ctypes.c_void_p * 4)(*(ctypes.addressof(v) for v in self.values))

    def __call__(self, pointer: int) -> Mapping | None:
        """The physical allocation mapped at device address ``pointer``, or None.

        None where nothing is mapped there or the driver cannot say (the mapping
        attributes are those of recent drivers).
        """
        for value in self.values:
            value.value = 0
        if driver().cuPointerGetAttributes(4, self.kinds, self.data, pointer) != 0:
            return None
        base, size, block, types = (v.value for v in self.values)
        if size == 0 or not base <= pointer < base + size:
            return None
        return Mapping(base, size, block, types & 0xFFFFFFFF)


def export_fd(pointer: int, device: int) -> int:
    """A new POSIX file descriptor of the allocation mapped at ``pointer`` on ``device``.

    The caller closes it. The calling thread's current device is left as it was.
    """
    lib = _vmm()
    handle = ctypes.c_uint64()
    with torch.cuda.device(device):
        _use_device(device)
        check_driver(
            lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)),
            "cuMemRetainAllocationHandle",
        )
        try:
            fd = ctypes.c_int(-1)
            code = lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle.value, POSIX_FD, 0)
            check_driver(code, "cuMemExportToShareableHandle")
            return fd.value
        finally:
            lib.cuMemRelease(handle.value)  # the mapping (and now the fd) hold the allocation


def _use_device(device: int) -> None:
    """Make ``device``'s primary context current on this thread (the driver calls need one)."""
    code = runtime().cudaSetDevice(ctypes.c_int(device))
    if code != 0:
        raise AiosyncError(f"cudaSetDevice({device}) failed (CUDA error {code})")


def serve_device(device: int) -> None:
    """Prepare a thread that exports ``device``'s memory (a descriptor server's thread)."""
    torch.cuda.init()  # type: ignore[no-untyped-call]
    _use_device(device)


class Imports:
    """Allocations imported from a peer's file descriptors on ``device``, until mapped.

    :meth:`add` imports descriptors as they come (the driver keeps its own reference: the
    caller may close them right after); :meth:`map` hands the handles to the
    :class:`ImportedMemory` it makes; :meth:`release` gives back whatever is still here.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.handles: list[int] = []

    def add(self, fds: Sequence[int]) -> None:
        """Import each of ``fds`` (raises :class:`AiosyncError` at the first that fails)."""
        lib = _vmm()
        with torch.cuda.device(self.device):
            _use_device(self.device)
            for fd in fds:
                handle = ctypes.c_uint64()
                code = lib.cuMemImportFromShareableHandle(
                    ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD
                )
                check_driver(code, "cuMemImportFromShareableHandle")
                self.handles.append(handle.value)

    def map(self, sizes: Sequence[int]) -> ImportedMemory:
        """The imports, of ``sizes[i]`` bytes each, mapped back to back in a range of their own.

        On failure everything is given back (these handles too).
        """
        handles, self.handles = self.handles, []
        if len(handles) != len(sizes) or not handles:
            for handle in handles:
                _vmm().cuMemRelease(handle)
            raise AiosyncError(f"{len(handles)} allocations imported for {len(sizes)}")
        lib = _vmm()
        with torch.cuda.device(self.device):
            _use_device(self.device)
            base = ctypes.c_uint64()
            code = lib.cuMemAddressReserve(ctypes.byref(base), sum(sizes), 0, 0, 0)
            if code != 0:
                for handle in handles:
                    lib.cuMemRelease(handle)
                check_driver(code, "cuMemAddressReserve")
            memory = ImportedMemory(base.value, sizes, handles, self.device)
            try:
                memory._map_all()
            except BaseException:
                memory._release(synchronize=False)
                raise
        return memory

    def release(self) -> None:
        """Give back the allocations imported and not mapped (idempotent)."""
        handles, self.handles = self.handles, []
        if handles:
            lib = _vmm()
            for handle in handles:
                lib.cuMemRelease(handle)


class ImportedMemory:
    """Physical allocations of a peer, from their file descriptors, mapped back to back.

    Made by :meth:`Imports.map`. :attr:`tensor` (flat ``uint8`` on ``device``) is valid
    until :meth:`close`, which waits for the device first, so that no queued copy reads
    unmapped memory. :attr:`read_only`: whether the driver took a read-only mapping (else
    read-write).
    """

    def __init__(self, base: int, sizes: Sequence[int], handles: list[int], device: int) -> None:
        self._base: int | None = base
        self.sizes = tuple(sizes)
        self.size = sum(sizes)
        self.device = device
        self._handles = handles
        self._mapped: list[tuple[int, int]] = []  # (address, size) of each mapping made
        self.read_only = False
        self._tensor: torch.Tensor | None = None

    def _map_all(self) -> None:
        """Map each allocation after the one before, then grant this device access."""
        lib = _vmm()
        assert self._base is not None
        at = self._base
        for handle, size in zip(self._handles, self.sizes, strict=True):
            check_driver(lib.cuMemMap(at, size, 0, handle, 0), "cuMemMap")
            self._mapped.append((at, size))
            at += size
        desc = _AccessDesc(_Location(_LOCATION_DEVICE, self.device), _PROT_READ)
        if lib.cuMemSetAccess(self._base, self.size, ctypes.byref(desc), 1) == 0:
            self.read_only = True
        else:
            desc.flags = _PROT_READWRITE
            code = lib.cuMemSetAccess(self._base, self.size, ctypes.byref(desc), 1)
            check_driver(code, "cuMemSetAccess")
        self._tensor = device_tensor(self._base, self.size, self.device)

    @property
    def tensor(self) -> torch.Tensor:
        """The mapped bytes as flat ``uint8`` on the device; raises once closed."""
        if self._tensor is None:
            raise AiosyncError("imported CUDA memory is closed")
        return self._tensor

    def close(self) -> None:
        """Unmap and release once the device is idle (idempotent)."""
        if self._base is None:
            return
        with torch.cuda.device(self.device):
            self._release(synchronize=True)

    def _release(self, *, synchronize: bool) -> None:
        """Unmap what was mapped, free the address range, release every handle."""
        base, self._base, self._tensor = self._base, None, None
        if base is None:
            return
        if synchronize:
            torch.cuda.synchronize(self.device)
        _use_device(self.device)
        lib = _vmm()
        failed = [
            code
            for code in (
                *(lib.cuMemUnmap(at, size) for at, size in self._mapped),
                lib.cuMemAddressFree(base, self.size),
                *(lib.cuMemRelease(handle) for handle in self._handles),
            )
            if code != 0
        ]
        self._handles, self._mapped = [], []
        if failed:
            check_driver(failed[0], "releasing imported CUDA memory")
