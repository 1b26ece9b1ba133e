"""Copy a bucket seen before into its destinations without per-tensor lookups.

The engine's session hands a sink the very same list of specs for a bucket that repeats one
of the last whole version (see :mod:`aiosync.core.stream_state`). For such a list,
:class:`CopyPrograms` keeps what copying it by address needs, worked out once: each small
tensor's destination address and its offset and size in the bucket. Applying the list again
is one tight loop of address copies, each after checking that its destination tensor still
has the storage it had (a target given new storage makes the program be made again). What
a program cannot copy this way (large or chunked tensors, other devices, another dtype, a
target that is not plain) is left to the sink, spec by spec. Programs hold no tensor views
and no bucket memory; those a version did not use are dropped when the next one commits.

A bucket on a CUDA device is copied the same way, every plain target on that device
whatever its size, each copy queued by address and the copies spread over the current
stream and a side stream joined back into it (:mod:`aiosync.planes.cuda_copies`): a few µs
of host time a tensor instead of the tens that ``copy_`` and its views take, so the engine
acks sooner, and the GPU idles less between copies.

A bucket may come in several parts (a direct bucket: one flat view per trainer region,
:mod:`aiosync.planes.direct`): :meth:`CopyPrograms.apply_parts` keeps one program a part
under the bucket's first spec list and queues all their copies in one loop, the device and
stream set up once a bucket, not once a part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aiosync.core.layout import SMALL_COPY, TensorSpec, address_copy, is_plain
from aiosync.planes.base import BucketContext
from aiosync.planes.cuda_copies import DeviceCopies
from aiosync.planes.cuda_graphs import CopyJob

MIN_SPECS = 16
"""Buckets of fewer tensors are copied one by one: a program saves nothing there."""

Part = tuple[torch.Tensor, list[TensorSpec]]
"""A bucket's bytes (a flat ``uint8`` view) and the specs that lie in them."""


@dataclass
class CopyProgram:
    """How to copy one bucket's list of specs: by address, then ``rest`` one by one."""

    specs: list[TensorSpec]
    rest: list[TensorSpec] = field(default_factory=list)
    copied: list[TensorSpec] = field(default_factory=list)  # in the order below
    tensors: list[torch.Tensor] = field(default_factory=list)
    pointers: list[int] = field(default_factory=list)  # each tensor's address when made
    targets: list[int] = field(default_factory=list)  # where each copy goes
    offsets: list[int] = field(default_factory=list)  # where it comes from, in the bucket
    sizes: list[int] = field(default_factory=list)
    jobs: list[CopyJob] | None = None  # (target, offset, size) of each, made on first use


@dataclass
class _Parts:
    """The programs of one bucket's parts, and all their copies in one list (``merged``).

    ``merged`` holds each copy's source as an address (its part's base when merged, plus
    its offset): one loop queues every part's copies; it is merged again when a part's
    bytes move (another ring buffer, a region opened again).
    """

    programs: list[CopyProgram]
    bases: list[int] = field(default_factory=list)
    merged: CopyProgram = field(default_factory=lambda: CopyProgram([]))
    part_of: list[int] = field(default_factory=list)  # each merged copy's part

    def fits(self, parts: list[Part]) -> bool:
        """Whether these programs were made for ``parts``' spec lists (the very lists)."""
        programs = self.programs
        return len(programs) == len(parts) and all(
            p.specs is specs for p, (_, specs) in zip(programs, parts, strict=True)
        )

    def merge(self, bases: list[int]) -> None:
        """Lay every part's copies out in :attr:`merged`, sources at ``bases``."""
        merged = CopyProgram([])
        part_of: list[int] = []
        for k, (program, base) in enumerate(zip(self.programs, bases, strict=True)):
            merged.copied += program.copied
            merged.tensors += program.tensors
            merged.pointers += program.pointers
            merged.targets += program.targets
            merged.offsets += [base + offset for offset in program.offsets]
            merged.sizes += program.sizes
            part_of += [k] * len(program.tensors)
        self.bases, self.merged, self.part_of = bases, merged, part_of


class CopyPrograms:
    """Programs for the spec lists of recent buckets, kept across versions."""

    def __init__(self) -> None:
        self._programs: dict[int, _Parts] = {}
        self._used: set[int] = set()
        self._copies: dict[int, DeviceCopies] = {}  # by device index

    def apply(
        self,
        bucket: torch.Tensor,
        specs: list[TensorSpec],
        target: Callable[[TensorSpec], torch.Tensor | None],
    ) -> list[TensorSpec]:
        """Copy what a program can of ``specs`` from ``bucket``; returns the specs left over.

        ``target(spec)`` is the tensor a spec is copied into as is, or None when it needs
        the sink's own handling (a tied name, another dtype). CPU and CUDA buckets.
        """
        return self.apply_parts([(bucket, specs)], target)[0][1]

    def apply_parts(
        self,
        parts: list[Part],
        target: Callable[[TensorSpec], torch.Tensor | None],
        context: BucketContext | None = None,
    ) -> list[Part]:
        """:meth:`apply` for a bucket in several parts (a direct bucket's regions) at once.

        One program a part, kept together under the first part's spec list, their copies
        queued in one loop; on CUDA the device and stream are set up once for all, and the
        copies take the hints of the bucket's ``context``. Returns each part with the specs
        left over (in the order given; empty where all were copied).
        """
        if not parts:
            return parts
        first = parts[0][0]
        key = id(parts[0][1])
        kept = self._programs.get(key)
        bases = [bucket.data_ptr() for bucket, _ in parts]
        # the same spec lists at the same addresses are the same memory (one address
        # space, CUDA's unified addressing included): the device checks held when it was
        # merged; anything else is checked again
        if kept is None or bases != kept.bases or not kept.fits(parts):
            if not (first.is_cuda or first.is_cpu):
                return parts
            if any(bucket.device != first.device for bucket, _ in parts):
                return parts
            if not first.is_cuda and sum(len(specs) for _, specs in parts) < MIN_SPECS:
                return parts
            if kept is None or not kept.fits(parts):
                device = first.device if first.is_cuda else None
                programs = [_make(s, target, device) for _, s in parts]
                kept = self._programs[key] = _Parts(programs)
            kept.merge(bases)
        self._used.add(key)
        merged = kept.merged
        jobs = _jobs(merged)
        if first.is_cuda:
            stream = torch.cuda.current_stream(first.device)
            self._device_copies(first.device).queue(jobs, stream, context)
        else:
            for job in jobs:
                address_copy(*job)
        done = len(jobs)
        if done == len(merged.tensors):
            pairs = zip(parts, kept.programs, strict=True)
            return [(bucket, program.rest) for (bucket, _), program in pairs]
        del self._programs[key]  # a destination moved: the program is made again
        left: list[list[TensorSpec]] = [[] for _ in parts]
        for k, spec in zip(kept.part_of[done:], merged.copied[done:], strict=True):
            left[k].append(spec)
        return [
            (bucket, rest + program.rest)
            for (bucket, _), program, rest in zip(parts, kept.programs, left, strict=True)
        ]

    def _device_copies(self, device: torch.device) -> DeviceCopies:
        index = device.index if device.index is not None else torch.cuda.current_device()
        copies = self._copies.get(index)
        if copies is None:
            copies = self._copies[index] = DeviceCopies(index)
        return copies

    def version_done(self) -> None:
        """A version committed: drop programs, and graphs of copies, it did not use."""
        for key in [key for key in self._programs if key not in self._used]:
            del self._programs[key]
        self._used.clear()
        for copies in self._copies.values():
            copies.prune()


def _jobs(program: CopyProgram) -> list[CopyJob]:
    """The copies of ``program``'s tensors, up to the first whose destination moved.

    A destination moved if its storage's address changed, or it became a strided view
    (``p.data = p.data.t()`` keeps the address), since the program was made.
    """
    tensors = program.tensors
    if [t.data_ptr() for t in tensors] == program.pointers and all(
        t.is_contiguous() for t in tensors
    ):  # as made: one comparison a property, no loop of Python statements
        if program.jobs is None:
            program.jobs = list(zip(program.targets, program.offsets, program.sizes, strict=True))
        return program.jobs
    jobs: list[CopyJob] = []
    for tensor, pointer, target, offset, size in zip(
        program.tensors,
        program.pointers,
        program.targets,
        program.offsets,
        program.sizes,
        strict=True,
    ):
        if tensor.data_ptr() != pointer or not tensor.is_contiguous():
            break
        jobs.append((target, offset, size))
    return jobs


def _make(
    specs: list[TensorSpec],
    target: Callable[[TensorSpec], torch.Tensor | None],
    device: torch.device | None = None,
) -> CopyProgram:
    """A program for ``specs``: plain destinations by address, the rest left over.

    On the CPU (``device`` None) small destinations only; else those on ``device``.
    """
    program = CopyProgram(specs)
    plain: dict[int, bool] = {}  # by tensor identity: whether it can be written by address
    for spec in specs:
        dst = target(spec) if device is not None or spec.nbytes <= SMALL_COPY else None
        if dst is None:
            program.rest.append(spec)
            continue
        ok = plain.get(id(dst))
        if ok is None:
            where = dst.is_cpu if device is None else dst.device == device
            ok = plain[id(dst)] = where and is_plain(dst)
        if not ok or spec.start + spec.nbytes > dst.nbytes:
            program.rest.append(spec)
            continue
        pointer = dst.data_ptr()
        program.copied.append(spec)
        program.tensors.append(dst)
        program.pointers.append(pointer)
        program.targets.append(pointer + spec.start)
        program.offsets.append(spec.offset)
        program.sizes.append(spec.nbytes)
    return program
