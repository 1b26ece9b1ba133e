"""A version's manifest and its bucket plans, made in one pass over its tensors.

A sender that can read its tensors without consuming them (a mapping, its ``.items()``, a
list of pairs) needs both the manifest (sent first) and the bucket layout. Reading each
tensor's dtype, shape and size costs more than anything else done with it when tensors are
small, so :func:`lay_out` reads each once and builds both: manifest entries, bucket specs,
each spec's manifest entry (so per-bucket slots need no lookup by name) and the groups of
tiny tensors that :func:`~aiosync.core.layout.pack_bucket` copies in one call per dtype.
Tensors larger than a buffer are only described here; their chunks are planned when the
packer reaches them (:meth:`VersionLayout.buckets`), so at most one contiguous copy of such
a tensor exists at a time, as with :func:`~aiosync.core.layout.plan_buckets`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, ItemsView, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aiosync.core.errors import MismatchError
from aiosync.core.layout import (
    ALIGNMENT,
    DTYPE_NAMES,
    MAX_BUCKET_ITEMS,
    TINY_BYTES,
    BucketPlan,
    TensorSpec,
    chunk_plans,
    plan_buckets,
)
from aiosync.core.manifest import (
    TensorMeta,
    build_manifest,
    module_tensors,
    unique_storage,
    visible_pairs,
)

Planner = Callable[..., "VersionLayout | None"]
"""Lays pairs out as :func:`lay_out` does (``pairs, capacity, max_items, *, dedupe``)."""


@dataclass
class ChunkedTensor:
    """A tensor larger than a buffer: its chunk plans are made when the packer gets there."""

    tensor: torch.Tensor
    meta: TensorMeta
    nbytes: int
    entry: int


@dataclass
class VersionLayout:
    """One version of visible tensors: its manifest and, in order, its planned buckets."""

    manifest: list[TensorMeta]
    items: list[BucketPlan | ChunkedTensor] = field(default_factory=list)

    def buckets(self, capacity: int) -> LayoutPlans:
        """The bucket plans in order; a chunked tensor is made contiguous when reached."""
        return LayoutPlans(self.items, capacity)


class LayoutPlans(Iterator[BucketPlan]):
    """A layout's bucket plans in order, knowing when it handed out the last one.

    :attr:`done` is true once the plan just returned was the last, so a packer learns
    that the version ended without asking for one more plan (and first waiting for a
    free buffer). Nothing is read ahead: a chunked tensor is made contiguous only when
    its first chunk is asked for.
    """

    def __init__(self, items: list[BucketPlan | ChunkedTensor], capacity: int) -> None:
        self._items = iter(items)
        self._left = len(items)
        self._capacity = capacity
        self._chunks: Iterator[BucketPlan] | None = None
        self.done = not items

    def __next__(self) -> BucketPlan:
        while True:
            if self._chunks is not None:
                plan = next(self._chunks, None)
                if plan is not None:
                    self.done = bool(plan.whole) and self._left == 0  # a tensor's last chunk
                    return plan
                self._chunks = None
            item = next(self._items)  # StopIteration: no plan left
            self._left -= 1
            if isinstance(item, BucketPlan):
                self.done = self._left == 0
                return item
            self._chunks = self._chunked(item)

    def _chunked(self, item: ChunkedTensor) -> Iterator[BucketPlan]:
        meta = item.meta
        spec = TensorSpec(meta.name, meta.dtype, meta.shape, 0, item.nbytes)
        for plan in chunk_plans(item.tensor, spec, self._capacity):
            plan.entries.append(item.entry)
            yield plan


def lay_out(
    pairs: Collection[tuple[str, Any]],
    capacity: int,
    max_items: int = MAX_BUCKET_ITEMS,
    *,
    dedupe: bool = False,
) -> VersionLayout | None:
    """The manifest and bucket plans of ``pairs`` in one pass; None if a value is no tensor.

    None (an async result among the values) means: no manifest, plan lazily with
    :func:`~aiosync.core.layout.plan_buckets`. ``dedupe`` sends each tensor once: a later
    name of the same tensor (tied weights) is left out, as
    :func:`~aiosync.core.manifest.unique_storage` does. The manifest and the buckets are
    exactly what :func:`~aiosync.core.manifest.build_manifest` and
    :func:`~aiosync.core.layout.plan_buckets` make of the same (deduplicated) pairs, with
    the same errors (:class:`MismatchError` for a repeated name or a dtype that cannot be
    streamed).
    """
    if capacity < ALIGNMENT or capacity % ALIGNMENT:
        raise ValueError(f"buffer capacity must be a positive multiple of {ALIGNMENT}")
    addresses: list[int] | None = [] if dedupe else None
    layout = _one_pass(pairs, capacity, max_items, addresses)
    if layout is None or addresses is None or len(set(addresses)) == len(addresses):
        return layout
    # two tensors at one address (tied weights, views): drop later names of one tensor first
    return _one_pass(unique_storage(pairs), capacity, max_items, None)


def _one_pass(
    pairs: Collection[tuple[str, Any]],
    capacity: int,
    max_items: int,
    addresses: list[int] | None,
) -> VersionLayout | None:
    """:func:`lay_out` without deduplication; each tensor's address goes to ``addresses``.

    Everything per tensor is kept in local variables: at a hundred thousand tensors, each
    attribute update saved is milliseconds.
    """
    manifest: list[TensorMeta] = []
    items: list[BucketPlan | ChunkedTensor] = []
    sent: list[str] = []  # names, checked for repeats at the end (or at the first error)
    names, tensor_type, tiny_bytes, align = DTYPE_NAMES, torch.Tensor, TINY_BYTES, ALIGNMENT
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    entries: list[int] = []
    tiny: dict[str, list[int]] = {}
    group_dtype, group = "", list[int]()
    count = payload = used = entry = 0
    for name, tensor in pairs:
        if type(tensor) is not tensor_type and not isinstance(tensor, tensor_type):
            return None
        if addresses is not None:
            addresses.append(tensor.data_ptr())
        sent.append(name)
        dtype = names.get(tensor.dtype)
        if dtype is None:
            _check_names(sent)
            raise MismatchError(f"dtype {tensor.dtype} cannot be streamed", tensor=name)
        shape = tuple(tensor.shape)
        nbytes = tensor.nbytes
        aligned = -(-nbytes // align) * align
        if aligned > capacity or (count and (used + aligned > capacity or count >= max_items)):
            if count:
                items.append(BucketPlan(tensors, specs, used, entries, tiny, count, payload))
                tensors, specs, entries, tiny = [], [], [], {}
                group_dtype, group = "", []
                count = payload = used = 0
            if aligned > capacity:
                meta = TensorMeta(name, dtype, shape, -(-nbytes // capacity))
                manifest.append(meta)
                items.append(ChunkedTensor(tensor, meta, nbytes, entry))
                entry += 1
                continue
        manifest.append(TensorMeta(name, dtype, shape))
        if nbytes <= tiny_bytes and len(shape) == 1:
            if dtype != group_dtype:
                group_dtype = dtype
                group = tiny.setdefault(dtype, [])
            group.append(count)
        tensors.append(tensor)
        specs.append(TensorSpec(name, dtype, shape, used, nbytes))
        entries.append(entry)
        entry += 1
        count += 1
        payload += nbytes
        used += aligned
    if count:
        items.append(BucketPlan(tensors, specs, used, entries, tiny, count, payload))
    _check_names(sent)
    return VersionLayout(manifest, items)


def _check_names(names: list[str]) -> None:
    """Raise :class:`MismatchError` naming the first name that appears twice."""
    if len(set(names)) == len(names):
        return
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise MismatchError(f"tensor {name!r} appears twice in one version", tensor=name)
        seen.add(name)


@dataclass
class VersionSource:
    """What a sender reads of one version before streaming it.

    ``pairs`` are the (name, tensor) pairs readable without consuming the source (None for
    a generator), ``manifest`` the version's manifest if known, ``plans`` its buckets (a
    generator's are planned as it is consumed).
    """

    pairs: Collection[tuple[str, Any]] | None
    manifest: list[TensorMeta] | None
    plans: Iterator[BucketPlan]


def read_source(
    source: Any,
    given: Sequence[TensorMeta] | Mapping[str, torch.Tensor] | None,
    capacity: int,
    max_items: int = MAX_BUCKET_ITEMS,
    planner: Planner | None = None,
) -> VersionSource:
    """Read ``source`` (and the ``given`` manifest, if any) into what a send streams.

    Per-tensor work: a sender runs it in a worker thread. A module, a mapping or its
    ``.items()`` sends each tensor once: a second name of the same tensor (tied weights)
    is dropped when the manifest is read from the source itself. Without ``given``, the
    manifest and the plans come from one pass of ``planner`` (default :func:`lay_out`; a
    sender passes :meth:`~aiosync.core.layout_memory.LayoutMemory.lay_out`, which reuses
    the last layout while the tensors look as they did last time).
    """
    if isinstance(source, torch.nn.Module):
        source = module_tensors(source)
    pairs = visible_pairs(source)
    if given is None and pairs is not None:
        dedupe = isinstance(source, Mapping | ItemsView)
        layout = (planner or lay_out)(pairs, capacity, max_items, dedupe=dedupe)
        if layout is not None:
            return VersionSource(pairs, layout.manifest, layout.buckets(capacity))
        if dedupe:  # values still to be waited for: no manifest, as each bucket names its own
            pairs = unique_storage(pairs)
        return VersionSource(pairs, None, plan_buckets(pairs, capacity, max_items))
    if given is None:
        return VersionSource(None, None, plan_buckets(source, capacity, max_items))
    if isinstance(given, Mapping):
        manifest = build_manifest(given.items(), capacity)
    else:
        manifest = list(given)
    plans = plan_buckets(source if pairs is None else pairs, capacity, max_items)
    return VersionSource(pairs, manifest, plans)
