"""Pure layout logic of a colocated topology: which engine covers which trainer rank.

Colocated trainers and engines share GPUs: engine ``i`` spans ``engine_gpu_counts[i]``
consecutive GPUs starting at ``engine_gpu_offsets[i]``, and the trainer rank on each of those
GPUs hands that engine its share of every bucket. The first rank of an engine's range is its
*source* rank (it gathers the others' bucket descriptions and calls the engine); a rank no
engine covers is a *placeholder* and takes no part. Nothing here does IO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiosync.core.errors import AiosyncError


class LayoutError(AiosyncError, ValueError):
    """A colocated layout that cannot be built (a ``ValueError``, as NeMo-RL raises)."""


def derive_engine_gpu_offsets(engine_gpu_counts: Sequence[int]) -> list[int]:
    """Offsets of a dense layout: engine ``i`` starts where engine ``i - 1`` ends.

    ``[2, 2] -> [0, 2]``, ``[1, 3] -> [0, 1]``, ``[] -> []``. Raises :class:`LayoutError`
    (a ``ValueError``) for a count that is not a positive integer.
    """
    offsets: list[int] = []
    start = 0
    for index, count in enumerate(engine_gpu_counts):
        _check_count(index, count)
        offsets.append(start)
        start += count
    return offsets


def _check_count(index: int, count: object) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise LayoutError(f"engine {index}: GPU count must be a positive integer, got {count!r}")


@dataclass(frozen=True)
class EngineRange:
    """Engine ``index`` spans the trainer ranks ``offset .. offset + count - 1``."""

    index: int
    offset: int
    count: int

    @property
    def ranks(self) -> list[int]:
        """The trainer ranks colocated with this engine, source first."""
        return list(range(self.offset, self.offset + self.count))

    @property
    def source(self) -> int:
        """The rank that gathers the others' descriptions and calls the engine."""
        return self.offset

    def covers(self, rank: int) -> bool:
        """Whether ``rank`` is one of this engine's ranks."""
        return self.offset <= rank < self.offset + self.count


@dataclass(frozen=True)
class Layout:
    """A checked colocated layout over ``world_size`` trainer ranks.

    ``engines`` are in the caller's engine order; their rank ranges do not overlap and lie
    inside the world. :attr:`key` is the signature that says whether a layout changed.
    """

    world_size: int
    engines: tuple[EngineRange, ...]

    @property
    def key(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The layout's signature: the world size and each engine's (offset, count)."""
        return (self.world_size, tuple((e.offset, e.count) for e in self.engines))

    def engine_of(self, rank: int) -> EngineRange | None:
        """The engine covering ``rank``, or None for a placeholder rank."""
        for engine in self.engines:
            if engine.covers(rank):
                return engine
        return None

    @property
    def covered_ranks(self) -> list[int]:
        """Every rank some engine covers, ascending (the ranks that sync together)."""
        return sorted(rank for engine in self.engines for rank in engine.ranks)

    @property
    def placeholders(self) -> list[int]:
        """Ranks no engine covers, ascending."""
        covered = set(self.covered_ranks)
        return [rank for rank in range(self.world_size) if rank not in covered]


def plan_layout(
    engine_gpu_counts: Sequence[int],
    engine_gpu_offsets: Sequence[int] | None,
    world_size: int,
) -> Layout:
    """Check a layout and describe it; ``engine_gpu_offsets=None`` means the dense layout.

    Raises :class:`LayoutError` (a ``ValueError``) when the counts are empty, a count is not
    a positive integer, the two lists differ in length, an offset is negative, an engine
    reaches past the last rank, or two engines share a rank. Ranks may be left uncovered
    (placeholders).
    """
    counts = list(engine_gpu_counts)
    if not counts:
        raise LayoutError("engine_gpu_counts is empty: a colocated topology needs an engine")
    if world_size <= 0:
        raise LayoutError(f"world size must be positive, got {world_size}")
    offsets = (
        derive_engine_gpu_offsets(counts)
        if engine_gpu_offsets is None
        else list(engine_gpu_offsets)
    )
    if len(offsets) != len(counts):
        raise LayoutError(
            f"engine_gpu_offsets has {len(offsets)} entries but engine_gpu_counts has {len(counts)}"
        )
    engines: list[EngineRange] = []
    owner: dict[int, int] = {}
    for index, (count, offset) in enumerate(zip(counts, offsets, strict=True)):
        _check_count(index, count)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise LayoutError(
                f"engine {index}: offset must be a non-negative integer, got {offset!r}"
            )
        if offset + count > world_size:
            raise LayoutError(
                f"engine {index} spans ranks {offset}..{offset + count - 1} but the trainer "
                f"world has {world_size} ranks"
            )
        for rank in range(offset, offset + count):
            if rank in owner:
                raise LayoutError(f"engines {owner[rank]} and {index} both cover rank {rank}")
            owner[rank] = index
        engines.append(EngineRange(index, offset, count))
    return Layout(world_size, tuple(engines))
