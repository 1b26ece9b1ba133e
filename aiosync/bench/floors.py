"""The physical floors a transfer is judged against, measured in the same run.

On a CPU host nothing beats one single-threaded memcpy of the same bytes
(:func:`measure_memcpy`); on a GPU, one device-to-device copy (:func:`measure_device_copy`).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with torch limited to ``n`` intra-op threads (restored afterwards)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def measure_memcpy(nbytes: int, repeats: int = 5) -> float:
    """Single-threaded ``dst.copy_(src)`` bandwidth over ``nbytes``, in GB/s (1e9 B/s).

    Bytes are counted once (bytes copied, not read + written). Both buffers are touched
    first, one warm-up copy is done, and the **median** of ``repeats`` timed copies is
    used. torch runs with one thread for the duration (restored afterwards).
    """
    if nbytes <= 0 or repeats <= 0:
        raise ValueError("nbytes and repeats must be positive")
    with torch_threads(1):
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst.zero_()
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    gbps = nbytes / statistics.median(times) / 1e9
    log.info("memcpy %d bytes: %.2f GB/s (median of %d)", nbytes, gbps, repeats)
    return gbps


def measure_device_copy(nbytes: int, device: torch.device | str, repeats: int = 5) -> float:
    """Device-to-device ``copy_`` bandwidth over ``nbytes`` on a GPU, in GB/s (bytes once).

    Timed with CUDA events; median of ``repeats`` after one warm-up copy.
    """
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(nbytes / statistics.median(times) / 1e9)
