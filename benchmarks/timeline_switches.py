"""Experiments for :mod:`benchmarks.cuda_timeline`: switch a step back or off its thread.

Each switch patches this process's pipeline in place and returns a set of flags; an empty
set (the default) leaves the code as it is, so one run measures the code and the variants.
:func:`direct_source` makes the tensors a direct-mode variant sends. Never imported by the
library.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """Put back, while the returned set holds a flag, the copies of before.

    ``"o"``: as before by-address queuing, the trainer's pack of a CUDA plane goes through
    ``pack_bucket`` (one ``copy_`` a tensor) and an engine's CUDA buckets skip the copy
    programs. ``"s"``: the by-address copies all go on the caller's stream, as before they
    were spread over two (:mod:`aiosync.planes.cuda_copies`); ``"g"``: spread, but the side
    stream waits on its fork only, not first on the other process's events; ``"n"``: no
    graphs, every batch queued copy by copy. The same run
    then measures each. Call before :func:`trainer_hooks` (which wraps what this installs).
    """
    from aiosync.core.layout import pack_bucket
    from aiosync.engine import bulk_apply
    from aiosync.planes import cuda, cuda_copies

    mode: set[str] = set()
    new_pack = cuda._pack
    new_apply = bulk_apply.CopyPrograms.apply_parts
    new_queue = cuda_copies.DeviceCopies.queue

    def pack(buffer: Any, plan: Any, stream: Any, copies: Any, context: Any = None) -> None:
        if "o" in mode:
            pack_bucket(buffer.tensor, plan)
        else:
            new_pack(buffer, plan, stream, copies, context)

    def apply(self: Any, parts: list[Any], target: Any, context: Any = None) -> Any:
        if "o" in mode and parts and parts[0][0].is_cuda:
            return parts
        return new_apply(self, parts, target, context)

    widths: dict[int, int] = {}  # each instance's own width, by id
    graphs: dict[int, bool] = {}  # and whether it makes graphs

    def queue(self: Any, jobs: Any, stream: Any, context: Any = None) -> None:
        own = widths.setdefault(id(self), self.width)
        self.width = 1 if "s" in mode else own
        if "n" in mode:
            graphs.setdefault(id(self), self.graphs)
            self.graphs = False
        elif id(self) in graphs:
            self.graphs = graphs.pop(id(self))
        if "g" in mode and context is not None:  # the side stream waits on its fork only
            context.gates = []
        new_queue(self, jobs, stream, context)

    cuda._pack = pack  # type: ignore[assignment]
    bulk_apply.CopyPrograms.apply_parts = apply  # type: ignore[method-assign]
    cuda_copies.DeviceCopies.queue = queue  # type: ignore[method-assign]
    return mode


def _switch(owner: Any, name: str, replacement: Any, on: bool) -> None:
    """``owner.name`` is ``replacement`` while ``on``, else its own (kept the first time)."""
    own = getattr(owner, f"_own_{name}", getattr(owner, name))
    setattr(owner, f"_own_{name}", own)
    setattr(owner, name, replacement if on else own)


def trainer_switches(flags: list[str]) -> None:
    """Set every switch of the trainer's side from a variant's ``flags``.

    ``w`` (:func:`regions_per_bucket`); ``t``: a direct-mode sender reads every version in
    a worker thread (as before :meth:`~aiosync.trainer.direct.DirectReader.read_kept`: no
    read on the loop); ``e``: every ``begin`` goes after the read, as before (no
    :mod:`~aiosync.pipeline.early_begin` guess); ``b``: a direct bucket 1 goes after the
    read, not with an early begin, and so does a packed one (not ahead of its packing,
    ``Bucket.after``); ``p``: an early direct bucket 1 goes after the begin in a message of
    its own, not inside it (as when the two are too large together).
    """
    from aiosync.core.layout_memory import LayoutMemory
    from aiosync.pipeline import early_begin
    from aiosync.pipeline.begin import encode_begin as own_encode
    from aiosync.trainer.direct import DirectReader
    from aiosync.trainer.sender import WeightSender

    async def never(*_: Any) -> None:
        return None

    def apart(version: int, guess: Any, marks: Any, limits: Any, first: Any = None) -> Any:
        if first is not None:  # "too large together": begin_early sends the two apart
            return b"", None
        return own_encode(version, guess, marks, limits)

    regions_per_bucket(flags)
    _switch(WeightSender, "_read_here", lambda *_: None, "t" in flags)
    _switch(WeightSender, "_begin_early", never, "e" in flags)
    _switch(DirectReader, "kept_first", lambda _: None, "b" in flags)
    _switch(LayoutMemory, "kept_first", lambda _: None, "b" in flags)
    _switch(early_begin, "encode_begin", apart, "p" in flags)


def regions_per_bucket(flags: list[str]) -> None:
    """Direct buckets of up to 1024 regions with flag ``w``, else the library's default."""
    from aiosync.planes.direct import MAX_REGIONS_PER_BUCKET
    from aiosync.trainer import direct_plans

    default = getattr(direct_plans, "_DEFAULT_REGIONS", direct_plans.REGIONS_PER_BUCKET)
    direct_plans._DEFAULT_REGIONS = default  # type: ignore[attr-defined]
    direct_plans.REGIONS_PER_BUCKET = MAX_REGIONS_PER_BUCKET if "w" in flags else default


def direct_for(
    model: Mapping[str, torch.Tensor], flags: list[str], made: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor] | None:
    """The direct source a variant's flags ask for (made once a kind), or None (packed)."""
    kind = "f" if "f" in flags else "d" if "d" in flags else None
    if kind is None:
        return None
    if kind not in made:
        made[kind] = direct_source(model, kind == "f")
    return made[kind]


def direct_source(model: Mapping[str, torch.Tensor], flat: bool) -> dict[str, torch.Tensor]:
    """``model``'s values as tensors direct mode reads in place (parameters, or shared).

    CUDA: parameters over the model's own tensors (one allocation each), or (``flat``) views
    of one new allocation. CPU: each tensor in a shared segment of its own, or (``flat``)
    all in one segment (:func:`aiosync.share_tensors`).
    """
    from aiosync import share_tensors

    first = next(iter(model.values()))
    if first.is_cuda and not flat:
        return {n: torch.nn.Parameter(t, requires_grad=False) for n, t in model.items()}
    if first.is_cuda:
        sizes = [-(-t.nbytes // 512) * 512 for t in model.values()]
        whole = torch.empty(sum(sizes), dtype=torch.uint8, device=first.device)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for (name, t), size in zip(model.items(), sizes, strict=True):
            view = whole[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            out[name] = torch.nn.Parameter(view, requires_grad=False)
            offset += size
        return out
    holders = [torch.nn.Module() for _ in range(1 if flat else len(model))]
    for i, t in enumerate(model.values()):
        param = torch.nn.Parameter(t.clone(), requires_grad=False)
        holders[0 if flat else i].register_parameter(f"p{i}", param)
    for holder in holders:
        share_tensors(holder)  # closed with its module
    params = [p for holder in holders for p in holder.parameters()]
    kept: dict[str, torch.Tensor] = dict(zip(model, params, strict=True))
    _HELD.extend(holders)
    return kept


_HELD: list[torch.nn.Module] = []  # the segments' modules, alive until the run ends
