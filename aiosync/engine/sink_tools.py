"""Small pieces both sinks use: renames from the sender's names and waiting for CUDA copies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from aiosync.planes.cuda_order import sync_deferred

Rename = Mapping[str, str] | Callable[[str], str]


def rename_function(rename: Rename | None) -> Callable[[str], str] | None:
    """``rename`` as a function; a mapping leaves names it does not list as they are."""
    if rename is None or callable(rename):
        return rename
    table = dict(rename)
    return lambda name: table.get(name, name)


def sync_cuda(devices: Iterable[torch.device]) -> None:
    """Wait for this thread's copies on every CUDA device among ``devices``.

    Not while a CUDA plane orders this thread's copies with events (it records its own).
    """
    if sync_deferred():
        return
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
