"""Experiments for :mod:`aiosync.bench.cuda_timeline`: switch a step back or off its thread.

Each switch patches this process's pipeline in place and returns a set of flags; an empty
set (the default) leaves the code as it is, so one run measures the code and the variants.
Never imported by the library.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch


class _ToThread:
    """``anyio.to_thread`` that runs the functions named in ``inline`` on the caller's thread."""

    def __init__(self, inline: set[str]) -> None:
        self.inline = inline

    async def run_sync(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") in self.inline:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, **kwargs)


class _Anyio:
    def __init__(self, inline: set[str]) -> None:
        self.to_thread = _ToThread(inline)

    def __getattr__(self, name: str) -> Any:
        return getattr(anyio, name)


def inline_switch(module: Any) -> set[str]:
    """Make ``module`` run the functions named in the returned set on its event loop.

    An experiment: what the thread hops of packing (``_pack_next``) and applying
    (``_apply``) cost. Empty (the default) changes nothing.
    """
    inline: set[str] = set()
    module.anyio = _Anyio(inline)
    return inline


def old_copies_switch() -> set[str]:
    """Put back, while the returned set holds ``"o"``, the copies before by-address queuing.

    The trainer's pack of a CUDA plane goes through ``pack_bucket`` (one ``copy_`` a tensor)
    and an engine's CUDA buckets skip the copy programs: the same run then measures both.
    Call before :func:`trainer_hooks` (which wraps what this installs).
    """
    from aiosync.core.layout import pack_bucket
    from aiosync.engine import bulk_apply
    from aiosync.planes import cuda_legacy

    mode: set[str] = set()
    new_pack = cuda_legacy._pack
    new_apply = bulk_apply.CopyPrograms.apply

    def pack(buffer: Any, plan: Any, stream: Any) -> None:
        if "o" in mode:
            pack_bucket(buffer.tensor, plan)
        else:
            new_pack(buffer, plan, stream)

    def apply(self: Any, bucket: torch.Tensor, specs: Any, target: Any) -> Any:
        if "o" in mode and bucket.is_cuda:
            return specs
        return new_apply(self, bucket, specs, target)

    cuda_legacy._pack = pack  # type: ignore[assignment]
    bulk_apply.CopyPrograms.apply = apply  # type: ignore[method-assign]
    return mode
