"""One engine's sinks, one per GPU of its range, as the single sink a receiver drives.

A tensor-parallel engine spanning ranks ``0..n-1`` of its range holds one shard per GPU;
the trainer rank on GPU ``i`` sends that shard's tensors as ``"<i>/<name>"``
(:func:`aiosync.planes.gathered.part_name`). :class:`RankedSink` takes the union of its
sinks' expectations under those names and hands each bucket (which holds one rank's
tensors only) to the sink of that rank, names stripped. So an ordinary
:class:`~aiosync.WeightReceiver` is a colocated engine's endpoint on the native pipeline,
with its manifest check, two-phase commit and staging unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from aiosync.core.errors import UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.engine.sinks import WeightSink
from aiosync.planes.gathered import part_name, part_of, split_name


class RankedSink:
    """Sinks ``sinks[i]`` (GPU ``i`` of the engine's range) behind one sink's interface."""

    def __init__(self, sinks: Sequence[WeightSink]) -> None:
        if not sinks:
            raise UsageError("a ranked sink needs at least one sink")
        self.sinks = list(sinks)

    @property
    def device(self) -> torch.device:
        """The first sink's device (each part's buffers open where its own handle says)."""
        return self.sinks[0].device

    @property
    def staged(self) -> bool:
        """True when every sink is staged (nothing visible changes before commit)."""
        return all(sink.staged for sink in self.sinks)

    def expectations(self) -> Expectations | None:
        """Every sink's expectations under ``"<i>/<name>"``; None if none says anything."""
        tensors = {}
        required: set[str] = set()
        aliases: dict[str, str] = {}
        said = False
        for i, sink in enumerate(self.sinks):
            exp = sink.expectations()
            if exp is None:
                continue
            said = True
            if exp.rename is not None:
                raise UsageError("a ranked sink's sinks cannot rename (name the tensors as sent)")
            tensors.update({part_name(i, k): v for k, v in exp.tensors.items()})
            required.update(part_name(i, k) for k in exp.required)
            aliases.update({part_name(i, k): part_name(i, v) for k, v in exp.aliases.items()})
        return Expectations(tensors, frozenset(required), aliases) if said else None

    def reserve(self) -> None:
        """Each sink's ``reserve``, where it has one."""
        for sink in self.sinks:
            reserve = getattr(sink, "reserve", None)
            if reserve is not None:
                reserve()

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Hand the bucket to the sink of the rank its tensors name, names stripped."""
        sink = self.sinks[part_of(specs, len(self.sinks))]
        own = [msgspec.structs.replace(s, name=split_name(s.name)[1]) for s in specs]
        sink.apply_bucket(bucket, own)

    def commit(self, version: int) -> None:
        """Commit every sink."""
        for sink in self.sinks:
            sink.commit(version)

    def abort(self) -> None:
        """Abort every sink."""
        for sink in self.sinks:
            sink.abort()
