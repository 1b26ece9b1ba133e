"""Small pieces both sinks use: renames from the sender's names and waiting for CUDA copies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from aiosync.planes.base import BucketContext

Rename = Mapping[str, str] | Callable[[str], str]


def rename_function(rename: Rename | None) -> Callable[[str], str] | None:
    """``rename`` as a function; a mapping leaves names it does not list as they are."""
    if rename is None or callable(rename):
        return rename
    table = dict(rename)
    return lambda name: table.get(name, name)


def sync_cuda(devices: Iterable[torch.device], context: BucketContext | None = None) -> None:
    """Wait for this thread's copies on every CUDA device among ``devices``.

    Not for a bucket whose ``context`` says ``deferred``: a CUDA plane orders its copies
    with events (it records its own), and the wait comes once, at commit.
    """
    if context is not None and context.deferred:
        return
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
