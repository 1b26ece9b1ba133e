"""The metadata of one broadcast bucket, checked and laid out: pure functions, no IO.

Engines receive ``names``, ``dtypes`` and ``shapes`` from the trainer (SGLang's
``update_weights_from_distributed`` arguments) and must treat them as hostile input:
:func:`bucket_layout` checks them and places every tensor at an aligned offset of one flat
buffer, the same way on both sides, so that either each tensor is broadcast into its own
view of that buffer or the whole buffer is broadcast at once (``load_format`` of
:data:`FLATTENED`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import ALIGNMENT, TensorSpec, dtype_from_name, dtype_name

FLATTENED = "flattened_bucket"
"""``load_format`` for one broadcast of the whole bucket (laid out by :func:`bucket_layout`)."""

PER_TENSOR_FORMATS = (None, "", "auto", "direct")
"""``load_format`` values meaning one broadcast per tensor, in order."""

MAX_TENSORS = 1 << 20
"""Most tensors in one bucket an engine accepts."""

MAX_NAME = 1024
"""Longest tensor name an engine accepts (characters)."""

MAX_DIMS = 16
"""Most dimensions of one tensor an engine accepts."""


def wire_dtype(name: str) -> str:
    """A dtype name as sent (``"torch.bfloat16"`` or ``"bfloat16"``) in aiosync's wire form."""
    bare = name.removeprefix("torch.")
    dtype_from_name(bare)  # ProtocolError for an unknown one
    return bare


def describe(
    tensors: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` of named tensors, as plain lists (the trainer side)."""
    names = [name for name, _ in tensors]
    dtypes = [dtype_name(tensor.dtype) for _, tensor in tensors]
    shapes = [list(tensor.shape) for _, tensor in tensors]
    return names, dtypes, shapes


def bucket_layout(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    max_bytes: int,
) -> tuple[list[TensorSpec], int]:
    """Check a bucket's metadata and lay it out: ``(specs, bytes used)``.

    Raises :class:`ProtocolError` naming the tensor for lists of different lengths, a
    repeated or overlong name, an unknown dtype, a negative or non-integer dimension, or a
    bucket larger than ``max_bytes``. Offsets are multiples of :data:`ALIGNMENT`.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ProtocolError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)})"
        )
    if len(names) > MAX_TENSORS:
        raise ProtocolError(f"{len(names)} tensors in one bucket (at most {MAX_TENSORS})")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    used = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise ProtocolError(f"bad tensor name {str(name)[:80]!r}")
        if name in seen:
            raise ProtocolError("tensor appears twice in one bucket", tensor=name)
        seen.add(name)
        if not isinstance(dtype, str):
            raise ProtocolError(f"dtype is not a name: {dtype!r}", tensor=name)
        try:
            wire = wire_dtype(dtype)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, tensor=name) from None
        if not isinstance(shape, Sequence) or len(shape) > MAX_DIMS:
            raise ProtocolError(f"bad shape {str(shape)[:80]}", tensor=name)
        dims = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ProtocolError(f"bad shape {list(dims)}", tensor=name)
        numel = 1
        for dim in dims:
            numel *= dim
        nbytes = numel * dtype_from_name(wire).itemsize
        if used + nbytes > max_bytes:
            raise ProtocolError(
                f"bucket needs more than the {max_bytes} bytes an engine accepts", tensor=name
            )
        specs.append(TensorSpec(name, wire, dims, used, nbytes))
        used += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return specs, used
