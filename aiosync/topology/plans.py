"""What each rank of an engine's range will send in a version, and their union (pure).

On the native pipeline (:mod:`aiosync.topology.pipeline`) every rank plans its tensors
first, without copying them: its manifest, and per bucket the specs and bytes used. The
plans travel as msgpack (:class:`RankPlan`) to the engine's source rank, which decodes them
as hostile input and joins them (:func:`union_plans`) into one manifest and one list of
pipeline buckets, each one rank's share, its tensors named ``"<i>/<name>"``.
"""

from __future__ import annotations

import msgspec
import torch

from aiosync.core.colocated_parts import MAX_ERROR_CHARS
from aiosync.core.errors import AiosyncError, MismatchError, ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec, plan_buckets
from aiosync.core.manifest import TensorMeta, build_manifest
from aiosync.planes.gathered import part_name


class RankPlan(msgspec.Struct, frozen=True):
    """One rank's version: its manifest and, per bucket, the specs and bytes used."""

    manifest: list[TensorMeta] = []
    buckets: list[list[TensorSpec]] = []
    used: list[int] = []
    error: str | None = None


def plan_rank(
    pairs: list[tuple[str, torch.Tensor]], capacity: int, rank: int
) -> tuple[bytes, list[BucketPlan]]:
    """A rank's encoded plan and its bucket plans; a failure is encoded as its text."""
    try:
        manifest = build_manifest(pairs, capacity)
        if manifest is None:
            raise MismatchError("a value is not a tensor yet")
        local = list(plan_buckets(pairs, capacity))
        plan = RankPlan(manifest, [p.specs for p in local], [p.used for p in local])
        return msgspec.msgpack.encode(plan), local
    except (AiosyncError, ValueError, TypeError, RuntimeError) as exc:
        text = f"trainer rank {rank} cannot plan its tensors: {exc}"
        return msgspec.msgpack.encode(RankPlan(error=text[:MAX_ERROR_CHARS])), []


def union_plans(
    gathered: list[bytes], first_rank: int, capacity: int
) -> tuple[list[TensorMeta], list[BucketPlan], list[tuple[int, int]]]:
    """The engine's manifest, its pipeline buckets and each one's (part, bucket) of a rank.

    ``gathered[i]`` is the plan of rank ``first_rank + i``. Buckets go round-robin: bucket
    0 of every rank, then bucket 1, so every rank packs while the others' shares stream.
    Raises :class:`MismatchError` with the ranks' own errors, :class:`ProtocolError` for a
    malformed plan.
    """
    ranks: list[RankPlan] = []
    for i, data in enumerate(gathered):
        try:
            ranks.append(msgspec.msgpack.decode(data, type=RankPlan))
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable plan from rank {first_rank + i}: {exc}") from None
    errors = [r.error for r in ranks if r.error is not None]
    if errors:
        raise MismatchError("; ".join(errors))
    manifest = [
        msgspec.structs.replace(meta, name=part_name(i, meta.name))
        for i, rank in enumerate(ranks)
        for meta in rank.manifest
    ]
    plans: list[BucketPlan] = []
    places: list[tuple[int, int]] = []
    for j in range(max((len(r.buckets) for r in ranks), default=0)):
        for i, rank in enumerate(ranks):
            if j >= len(rank.buckets):
                continue
            if len(rank.used) != len(rank.buckets) or not 0 < rank.used[j] <= capacity:
                raise ProtocolError(f"rank {first_rank + i}: bucket {j} does not fit a buffer")
            specs = [msgspec.structs.replace(s, name=part_name(i, s.name)) for s in rank.buckets[j]]
            plans.append(BucketPlan(specs=specs, used=rank.used[j]))
            places.append((i, j))
    return manifest, plans, places
