"""Many device copies queued with one runtime call: ``cudaMemcpyBatchAsync`` (CUDA 12.8+).

Queueing a bucket's copies one ``cudaMemcpyAsync`` at a time costs a few microseconds of
host time each, and both ends of a packed stream sit on that path once a bucket: the
trainer's pack and the engine's apply lie on the round trip that gates the refill of a
buffer. One batch call queues them all. The copies of a batch run in stream order as a
whole (after what the stream had queued, before what it queues next) but in no set order
among themselves, so they must not depend on each other: a bucket's copies never do (each
writes its own range).

The runtime refuses a batch on the legacy default stream (handle 0): callers queue such
copies one by one, or on a stream of their own. The runtime's ABI changed at 13.0 (12.8
and 12.9 take a trailing ``failIdx``); :func:`batch_available` says whether the loaded
runtime has the call at all.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from aiosync.planes.cuda_runtime import _check, runtime

BATCH_MIN_JOBS = 3
"""Fewer copies than this go one by one: the arrays a batch needs cost what they would save."""

_FIRST_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
_NO_FAIL_INDEX = 13000  # from 13.0 on, the call has no failIdx argument
_SOURCE_IN_STREAM_ORDER = 1  # cudaMemcpySrcAccessOrderStream


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """``cudaMemcpyAttributes``: source order, location hints (zero: none), flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_uint),
        ("src_hint", _Location),
        ("dst_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


_lock = threading.Lock()
_resolved = False
_available = False
_takes_fail_index = False
_attributes = _Attributes(src_access_order=_SOURCE_IN_STREAM_ORDER)
_first_copy = (ctypes.c_size_t * 1)(0)  # the one attribute applies from copy 0 on


def batch_available() -> bool:
    """Whether the CUDA runtime torch loaded has ``cudaMemcpyBatchAsync`` (declared once)."""
    global _resolved, _takes_fail_index
    with _lock:
        if _resolved:
            return _available
        _resolved = True
        lib = runtime()
        version = ctypes.c_int()
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < _FIRST_VERSION:
            return _set_available(False)
        call = getattr(lib, "cudaMemcpyBatchAsync", None)
        if call is None:
            return _set_available(False)
        _takes_fail_index = version.value < _NO_FAIL_INDEX
        sizes = ctypes.POINTER(ctypes.c_size_t)
        head = [sizes, sizes, sizes, ctypes.c_size_t, ctypes.POINTER(_Attributes), sizes]
        tail = [ctypes.c_size_t] + ([sizes] if _takes_fail_index else []) + [ctypes.c_void_p]
        call.argtypes = head + tail
        call.restype = ctypes.c_int
        return _set_available(True)


def _set_available(value: bool) -> bool:
    global _available
    _available = value
    return value


def memcpy_batch_async(
    dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int
) -> None:
    """Queue copies ``srcs[k] -> dsts[k]`` of ``sizes[k]`` bytes on ``stream`` in one call.

    ``stream`` is a stream handle other than 0 (the legacy default stream), on the current
    device; the copies are independent of each other and the caller checked every range,
    as for :func:`~aiosync.planes.cuda_runtime.memcpy_async`. Only after
    :func:`batch_available` said True. Raises :class:`~aiosync.core.errors.AiosyncError`
    with the runtime's text if the runtime refuses the batch.
    """
    count = len(sizes)
    array = ctypes.c_size_t * count
    args: list[object] = [array(*dsts), array(*srcs), array(*sizes), count]
    args += [ctypes.byref(_attributes), _first_copy, 1]
    if _takes_fail_index:
        args.append(ctypes.byref(ctypes.c_size_t()))
    code = runtime().cudaMemcpyBatchAsync(*args, stream)
    if code != 0:
        _check(code, f"cudaMemcpyBatchAsync of {count} copies")
