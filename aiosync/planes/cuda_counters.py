"""Counters in device memory that streams wait on and write: hand-overs with no host race.

An interprocess event can only be waited on after its record was queued (a wait covers the
last record made before it), so a process may queue work behind another's only once a
host message said the record is there. A counter has no such race: a stream waits until
the 32-bit word at an address reaches a value (``cuStreamWaitValue32``), and a stream of
the process that owns the memory sets it once its earlier work is done
(``cuStreamWriteValue32``, with a memory barrier). Work can be queued before the work it
waits on was.

The CUDA plane uses one to let an engine queue bucket 1's copies before the trainer packed
it (:mod:`aiosync.planes.cuda`). Only the trainer writes its counter, into its own
memory, so a trainer never waits on a peer's counter and never writes a peer's memory; an
engine's stream may wait on the trainer's, and the engine sets it itself (:func:`write_now`)
only when its session ends with such a wait still pending.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aiosync.core.errors import AiosyncError
from aiosync.planes.cuda_runtime import check_cuda, driver, runtime

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: after earlier writes are visible
_NON_BLOCKING = 0x1  # cudaStreamNonBlocking: no implicit order with the legacy default stream
_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost

_lock = threading.Lock()  # the page-locked word below


def _check(code: int, what: str) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(code, ctypes.byref(text))
        name = text.value.decode() if text.value else str(code)
        raise AiosyncError(f"{what} failed: {name} (CUDA driver error {code})")


def wait_value(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` (a handle) a wait until the word at ``address`` reaches ``value``.

    "Reaches" is modulo 2**32: the word minus ``value``, as a signed 32-bit number, is not
    negative, so a counter may wrap as long as waiters stay within 2**31 of it.
    """
    code = driver().cuStreamWaitValue32_v2(stream or None, address, value & 0xFFFFFFFF, _WAIT_GEQ)
    _check(code, "cuStreamWaitValue32")


def write_value(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` a write of ``value`` to the word at ``address``, after its work."""
    code = driver().cuStreamWriteValue32_v2(
        stream or None, address, value & 0xFFFFFFFF, _WRITE_DEFAULT
    )
    _check(code, "cuStreamWriteValue32")


@contextmanager
def _own_stream(device: int) -> Iterator[torch.cuda.ExternalStream]:
    """A non-blocking stream made for this call alone, destroyed after it.

    Not one of torch's pooled streams: the pool hands its streams out in turn, so a
    "new" one may be the very stream that waits on the counter.
    """
    lib = runtime()
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        code = lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _NON_BLOCKING)
        check_cuda(code, "cudaStreamCreateWithFlags")
        try:
            where = torch.device("cuda", device)
            yield torch.cuda.ExternalStream(handle.value or 0, device=where)  # type: ignore[no-untyped-call]
        finally:
            lib.cudaStreamSynchronize(handle)
            lib.cudaStreamDestroy(handle)


_pinned_word: ctypes.c_void_p | None = None  # 4 bytes of page-locked host memory


def reached(word: torch.Tensor, value: int) -> bool:
    """Whether the counter ``word`` (4 bytes of device memory) has reached ``value`` now.

    Copied into page-locked memory on a stream of its own: a copy to pageable memory, or
    on the legacy default stream, could wait behind the very stream that waits on the
    counter.
    """
    global _pinned_word
    lib = runtime()
    device = word.device.index if word.device.index is not None else torch.cuda.current_device()
    with _lock:
        if _pinned_word is None:
            pinned = ctypes.c_void_p()
            check_cuda(lib.cudaMallocHost(ctypes.byref(pinned), ctypes.c_size_t(4)), "pin")
            _pinned_word = pinned
        with _own_stream(device) as stream:
            code = lib.cudaMemcpyAsync(
                _pinned_word, word.data_ptr(), 4, _DEVICE_TO_HOST, stream.cuda_stream
            )
            check_cuda(code, "cudaMemcpyAsync")
        now = ctypes.c_int32.from_address(_pinned_word.value or 0).value
    return ((now - value) & 0xFFFFFFFF) < (1 << 31)


def write_now(device: int, address: int, value: int) -> None:
    """Set the word at ``address`` to ``value`` now, on a stream of its own, and wait for it.

    What releases a stream left waiting on a peer's counter when the peer's session ends.
    """
    with _own_stream(device) as stream:
        write_value(stream.cuda_stream, address, value)
