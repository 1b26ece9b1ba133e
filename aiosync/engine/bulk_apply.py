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
whatever its size, each copy queued by address on the current stream
(:func:`~aiosync.planes.cuda_runtime.memcpy_async`): a few µs of host time a tensor instead
of the tens that ``copy_`` and its views take, so the engine acks sooner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aiosync.core.layout import SMALL_COPY, TensorSpec, address_copy, is_plain

MIN_SPECS = 16
"""Buckets of fewer tensors are copied one by one: a program saves nothing there."""


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


class CopyPrograms:
    """Programs for the spec lists of recent buckets, kept across versions."""

    def __init__(self) -> None:
        self._programs: dict[int, CopyProgram] = {}
        self._used: set[int] = set()

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
        cuda = bucket.is_cuda
        if not (cuda or bucket.is_cpu) or (not cuda and len(specs) < MIN_SPECS):
            return specs
        key = id(specs)
        program = self._programs.get(key)
        if program is None or program.specs is not specs:
            program = _make(specs, target, bucket.device if cuda else None)
            self._programs[key] = program
        self._used.add(key)
        if cuda:
            with torch.cuda.device(bucket.device):
                done = _run(program, bucket.data_ptr(), _device_copy(bucket.device))
        else:
            done = _run(program, bucket.data_ptr(), address_copy)
        if done == len(program.tensors):
            return program.rest
        del self._programs[key]  # a destination has new storage: make it again next time
        return program.copied[done:] + program.rest

    def version_done(self) -> None:
        """A version committed: drop programs it did not use."""
        for key in [key for key in self._programs if key not in self._used]:
            del self._programs[key]
        self._used.clear()


def _device_copy(device: torch.device) -> Callable[[int, int, int], object]:
    """Queue copies by address on ``device``'s current stream."""
    from aiosync.planes.cuda_runtime import memcpy_async

    stream = torch.cuda.current_stream(device).cuda_stream
    return lambda dst, src, nbytes: memcpy_async(dst, src, nbytes, stream)


def _run(program: CopyProgram, base: int, copy: Callable[[int, int, int], object]) -> int:
    """Copy ``program``'s tensors from the bucket at ``base``; how many were copied.

    Stops at the first destination whose storage moved since the program was made.
    """
    done = 0
    for tensor, pointer, target, offset, size in zip(
        program.tensors,
        program.pointers,
        program.targets,
        program.offsets,
        program.sizes,
        strict=True,
    ):
        if tensor.data_ptr() != pointer:
            return done
        copy(target, base + offset, size)
        done += 1
    return done


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
