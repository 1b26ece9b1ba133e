"""Counters in device memory that streams wait on and write: GPU-side hand-overs (a probe).

An interprocess event can only be waited on after its record was queued (a wait covers the
last record made before it), so a process may queue work behind another's only once a
host message said the record is there. A counter has no such race: a stream waits until
the 32-bit word at an address reaches a value (``cuStreamWaitValue32``), and another
stream, in any process that maps the memory, sets it once its earlier work is done
(``cuStreamWriteValue32``, with a memory barrier). Work can then be queued long before the
work it waits on, with no host between the two.

Used by :mod:`aiosync.bench.cuda_timeline`'s probe to measure what taking the hosts off
the hand-overs would gain (nothing, on one H200: docs/benchmarks.md). Not used by the
library: a stream waiting on a peer's counter waits forever if the peer is gone, and any
device-wide synchronisation queued behind it with it.
"""

from __future__ import annotations

import ctypes
import threading

from aiosync.core.errors import AiosyncError
from aiosync.planes.direct_regions import driver

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: after earlier writes are visible

_lock = threading.Lock()
_declared = False


def _lib() -> ctypes.CDLL:
    global _declared
    lib = driver()
    with _lock:
        if not _declared:
            for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
                call = getattr(lib, name)
                call.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                call.restype = ctypes.c_int
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _declared = True
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        _lib().cuGetErrorString(code, ctypes.byref(text))
        name = text.value.decode() if text.value else str(code)
        raise AiosyncError(f"{what} failed: {name} (CUDA driver error {code})")


def wait_value(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` (a handle) a wait until the word at ``address`` reaches ``value``.

    "Reaches" is modulo 2**32: the word minus ``value``, as a signed 32-bit number, is not
    negative, so a counter may wrap as long as waiters stay within 2**31 of it.
    """
    code = _lib().cuStreamWaitValue32_v2(stream or None, address, value & 0xFFFFFFFF, _WAIT_GEQ)
    _check(code, "cuStreamWaitValue32")


def write_value(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` a write of ``value`` to the word at ``address``, after its work."""
    code = _lib().cuStreamWriteValue32_v2(
        stream or None, address, value & 0xFFFFFFFF, _WRITE_DEFAULT
    )
    _check(code, "cuStreamWriteValue32")
