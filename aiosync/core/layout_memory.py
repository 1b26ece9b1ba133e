"""A sender's last layout, reused while versions keep the same names, dtypes and shapes.

A trainer sends the same tensors every version, with new values. Laying a version out
(:func:`~aiosync.core.planning.lay_out`) reads each tensor's dtype, shape and size and
builds a manifest entry and a spec for it; checking that each tensor still has the name,
dtype and shape it had costs a third of that. :class:`LayoutMemory` keeps the last layout
and, when every tensor checks out, reuses its manifest and bucket specs with the current
tensor objects. Any difference (a name, a dtype, a shape, the count, a value that is not a
tensor, two tensors now at one address) lays the version out afresh. The layout depends on
nothing else, so a reused one is exactly what a fresh pass would make.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from aiosync.core.layout import BucketPlan, dtype_from_name
from aiosync.core.planning import ChunkedTensor, VersionLayout, lay_out


@dataclass(frozen=True)
class _Kept:
    """The last layout and what each of its tensors looked like."""

    capacity: int
    max_items: int
    dedupe: bool
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    layout: VersionLayout

    def matches(self, pairs: Collection[tuple[str, Any]]) -> list[torch.Tensor] | None:
        """The tensors of ``pairs`` if they look as the kept ones did, else None.

        One comprehension per property: cheaper than a loop that checks each tensor in turn.
        """
        if len(pairs) != len(self.names) or [name for name, _ in pairs] != self.names:
            return None
        tensors = [tensor for _, tensor in pairs]
        tensor_type = torch.Tensor
        if not all(type(t) is tensor_type or isinstance(t, tensor_type) for t in tensors):
            return None
        if [t.dtype for t in tensors] != self.dtypes:
            return None
        # (a list of sizes compared whole with a list of tuples is many times slower)
        if any(t.shape != shape for t, shape in zip(tensors, self.shapes, strict=True)):
            return None
        if self.dedupe:
            addresses = {t.data_ptr() for t in tensors}
            if len(addresses) != len(tensors):
                return None  # now two at one address: which one goes is decided afresh
        return tensors

    def rebuild(self, tensors: list[torch.Tensor]) -> VersionLayout:
        """The kept layout with ``tensors`` (in manifest order) in its plans."""
        items: list[BucketPlan | ChunkedTensor] = []
        at = 0
        for item in self.layout.items:
            if isinstance(item, ChunkedTensor):
                items.append(ChunkedTensor(tensors[at], item.meta, item.nbytes, item.entry))
                at += 1
                continue
            count = len(item.specs)
            items.append(
                BucketPlan(
                    tensors[at : at + count],
                    item.specs,
                    item.used,
                    item.entries,
                    item.tiny,
                    item.whole,
                    item.payload,
                    item.slots,
                )
            )
            at += count
        return VersionLayout(self.layout.manifest, items)


class LayoutMemory:
    """Lays versions out, reusing the last layout while the tensors look the same.

    Used from one thread at a time (a sender's reads of its versions never overlap).
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    def kept_first(self) -> BucketPlan | None:
        """Bucket 1 of the kept layout, with the slots its message was made with, if any.

        A guess, before reading: a read that keeps the layout hands out a plan with the
        very same specs list (:meth:`_Kept.rebuild`). None without a kept layout, or where
        bucket 1 is a chunk of a tensor larger than a buffer, or its slots were never made.
        """
        kept = self._kept
        if kept is None or not kept.layout.items:
            return None
        first = kept.layout.items[0]
        if not isinstance(first, BucketPlan) or first.slots is None:
            return None
        return first

    def lay_out(
        self,
        pairs: Collection[tuple[str, Any]],
        capacity: int,
        max_items: int,
        *,
        dedupe: bool = False,
    ) -> VersionLayout | None:
        """What :func:`~aiosync.core.planning.lay_out` returns for the same arguments."""
        kept = self._kept
        if kept is not None and (kept.capacity, kept.max_items, kept.dedupe) == (
            capacity,
            max_items,
            dedupe,
        ):
            tensors = kept.matches(pairs)
            if tensors is not None:
                return kept.rebuild(tensors)
        self._kept = None
        layout = lay_out(pairs, capacity, max_items, dedupe=dedupe)
        if layout is None or len(layout.manifest) != len(pairs):
            return layout  # values to wait for, or names dropped as a tensor's second name
        manifest = layout.manifest
        self._kept = _Kept(
            capacity,
            max_items,
            dedupe,
            [meta.name for meta in manifest],
            [dtype_from_name(meta.dtype) for meta in manifest],
            [meta.shape for meta in manifest],
            layout,
        )
        return layout
