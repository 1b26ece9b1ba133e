"""How a direct-mode version's tensors are cut into direct buckets (pure; no device call).

The sender's reader (:mod:`aiosync.trainer.direct`) located each chosen tensor in a region
of trainer memory (a :class:`~aiosync.planes.direct_regions.Spot`). Here those are made
distinct (a tensor overlapping an earlier one in its region is packed instead), kept within
half an engine's bounds on open regions, and cut into :class:`~aiosync.planes.direct.
DirectPlan` buckets of at most :data:`REGIONS_PER_BUCKET` regions, the engine's tensor
bound and :data:`~aiosync.planes.direct.DIRECT_BYTES`, each with its specs' offsets running
through its regions in order.
"""

from __future__ import annotations

from typing import Any

import torch

from aiosync.core.layout import DTYPE_NAMES, TensorSpec, calculate_aligned_size
from aiosync.core.manifest import TensorMeta
from aiosync.core.wire import Region
from aiosync.planes.direct import DIRECT_BYTES, MAX_OPEN_PIECES, MAX_OPEN_REGIONS, DirectPlan
from aiosync.planes.direct_regions import Spot
from aiosync.planes.fd_regions import pieces_of

REGIONS_PER_BUCKET = 64
"""Regions a sender puts in one direct bucket (an engine takes up to
:data:`~aiosync.planes.direct.MAX_REGIONS_PER_BUCKET`; one bucket of all of them measured
slower on an H200, docs/benchmarks.md)."""
OPEN_REGIONS = MAX_OPEN_REGIONS // 2
"""Regions one version reads directly at most (the rest is packed; see :func:`within_bounds`)."""
OPEN_BYTES = DIRECT_BYTES // 2
"""Bytes of regions one version reads directly at most."""
OPEN_PIECES = MAX_OPEN_PIECES // 2
"""Physical allocations of descriptor regions one version reads directly at most."""

Located = tuple[str, torch.Tensor, Spot]
"""A chosen tensor, by name, and where it lies."""


def distinct(direct: list[Located], packed: list[tuple[str, Any]]) -> list[Located]:
    """``direct`` by region and address; a tensor overlapping an earlier one goes to ``packed``.

    (A module's own tensors never overlap: ``unique_storage`` made tied ones one.)
    """
    groups: dict[object, list[Located]] = {}
    for item in direct:
        groups.setdefault(item[2].key, []).append(item)
    out: list[Located] = []
    for group in groups.values():
        group.sort(key=lambda item: item[2].offset)
        end = 0
        for name, tensor, spot in group:
            if spot.offset < end:
                packed.append((name, tensor))
                continue
            end = spot.offset + tensor.nbytes
            out.append((name, tensor, spot))
    return out


def within_bounds(direct: list[Located], packed: list[tuple[str, Any]]) -> list[Located]:
    """``direct`` within half an engine's bounds on open regions; the rest to ``packed``.

    An engine keeps the regions of the last version open while it opens the next
    version's, so a version whose regions all moved needs room for both: half of
    :data:`~aiosync.planes.direct.MAX_OPEN_REGIONS` regions, of
    :data:`~aiosync.planes.direct.DIRECT_BYTES` and of
    :data:`~aiosync.planes.direct.MAX_OPEN_PIECES`. Regions are taken in the order met.
    """
    taken: set[object] = set()
    left: set[object] = set()
    held = pieces = 0
    out: list[Located] = []
    for name, tensor, spot in direct:
        key = spot.key
        if key not in taken and key not in left:
            size, more = spot.region.size, pieces_of(spot.region)
            if (
                len(taken) < OPEN_REGIONS
                and held + size <= OPEN_BYTES
                and pieces + more <= OPEN_PIECES
            ):
                taken.add(key)
                held += size
                pieces += more
            else:
                left.add(key)
        if key in taken:
            out.append((name, tensor, spot))
        else:
            packed.append((name, tensor))
    return out


def direct_plans(
    direct: list[Located],
    first: int | None,
    max_items: int,
    buffer: int,
) -> tuple[list[DirectPlan], list[TensorMeta], int]:
    """Direct buckets of ``direct``, their manifest entries and their bytes.

    ``direct`` is distinct and by region and address; entries are numbered from ``first``
    (None: no manifest). A region with more tensors than a bucket may hold spans several buckets.
    """
    by_region: dict[object, tuple[Region, list[tuple[str, torch.Tensor, int]]]] = {}
    for name, tensor, spot in direct:
        by_region.setdefault(spot.key, (spot.region, []))[1].append((name, tensor, spot.offset))
    plans: list[DirectPlan] = []
    metas: list[TensorMeta] = []
    plan = DirectPlan(whole=0, payload=0, buffer=buffer)
    moved = 0
    for region, items in by_region.values():
        aligned = calculate_aligned_size(region.size)
        for at in range(0, len(items), max_items):
            chunk = items[at : at + max_items]
            if plan.regions and (
                len(plan.regions) >= REGIONS_PER_BUCKET
                or plan.used + aligned > DIRECT_BYTES
                or len(plan.specs) + len(chunk) > max_items
            ):
                plans.append(plan)
                plan = DirectPlan(whole=0, payload=0, buffer=buffer)
            start = plan.used
            plan.regions.append(region)
            for name, tensor, offset in chunk:
                nbytes = tensor.nbytes
                meta = TensorMeta(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))
                if first is not None:
                    plan.entries.append(first + len(metas))
                metas.append(meta)
                plan.tensors.append(tensor)
                spec = TensorSpec(meta.name, meta.dtype, meta.shape, start + offset, nbytes)
                plan.specs.append(spec)
                plan.whole += 1
                plan.payload += nbytes
                moved += nbytes
            plan.used = start + aligned
    if plan.regions:
        plans.append(plan)
    return plans, metas, moved
