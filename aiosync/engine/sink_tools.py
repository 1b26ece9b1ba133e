"""Small pieces around sinks: renames, waits for CUDA copies, a sink's error worded."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from aiosync.core.engine_actions import Apply
from aiosync.core.errors import AiosyncError
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


def apply_error(action: Apply, exc: Exception) -> AiosyncError:
    """``exc`` from applying ``action``'s bucket, as an aiosync error naming its tensors."""
    if isinstance(exc, AiosyncError):
        return exc
    names = ", ".join(spec.name for spec in action.specs[:3])
    return AiosyncError(
        f"engine failed to apply bucket ({names}): {exc}",
        tensor=action.specs[0].name if action.specs else None,
    )
