"""One engine's sinks, one per GPU of its range, as the single sink a receiver drives.

A tensor-parallel engine spanning ranks ``0..n-1`` of its range holds one shard per GPU;
the trainer rank on GPU ``i`` sends that shard's tensors as ``"<i>/<name>"``
(:func:`aiosync.planes.gathered.part_name`). :class:`RankedSink` takes the union of its
sinks' expectations under those names and hands each bucket (which holds one rank's
tensors only) to the sink of that rank, names stripped. So an ordinary
:class:`~aiosync.WeightReceiver` is a colocated engine's endpoint on the native pipeline,
with its manifest check, two-phase commit and staging unchanged.

On GPUs sink ``i`` lives on GPU ``i`` of the range, where trainer rank ``i``'s CUDA buffers
are: :attr:`RankedSink.part_devices` tells the receiver to open part ``i`` of the gathered
plane there, and every call on sink ``i`` runs with its device current
(``torch.cuda.device``), so its copies and its wait for them are on that GPU's stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec
import torch

from aiosync.core.errors import UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.engine.sink_shape import SinkShape, as_weight_sink
from aiosync.engine.sinks import WeightSink
from aiosync.planes.base import BucketContext, Part
from aiosync.planes.gathered import part_name, part_of, split_name


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """``device`` current in this thread while the block runs, if a CUDA device."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


class RankedSink(WeightSink):
    """Sinks ``sinks[i]`` (GPU ``i`` of the engine's range) behind one sink's interface."""

    def __init__(self, sinks: Sequence[WeightSink | SinkShape]) -> None:
        if not sinks:
            raise UsageError("a ranked sink needs at least one sink")
        self.sinks = [as_weight_sink(sink) for sink in sinks]

    @property
    def device(self) -> torch.device:
        """The first sink's device (each part's buffers open where its own handle says)."""
        return self.sinks[0].device

    @property
    def part_devices(self) -> list[torch.device]:
        """Where part ``i`` of a gathered plane opens: sink ``i``'s device."""
        return [sink.device for sink in self.sinks]

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
        """Each sink's ``reserve``, where it has one of its own (not :class:`WeightSink`'s)."""
        for sink in self.sinks:
            if type(sink).reserve is not WeightSink.reserve:
                with on_device(sink.device):
                    sink.reserve()

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Hand the bucket to the sink of the rank its tensors name, names stripped.

        The sink's device is current meanwhile: its copies and its wait run on that GPU.
        """
        sink, own = self._owner(specs)
        with on_device(sink.device):
            sink.apply_bucket(bucket, own)

    def apply_with(self, parts: list[Part], context: BucketContext) -> None:
        """Each part to the sink of the rank its tensors name, with the bucket's context."""
        for bucket, specs in parts:
            sink, own = self._owner(specs)
            with on_device(sink.device):
                sink.apply_with([(bucket, own)], context)

    def _owner(self, specs: list[TensorSpec]) -> tuple[WeightSink, list[TensorSpec]]:
        """The sink of the rank ``specs`` name, and the specs under that sink's names."""
        sink = self.sinks[part_of(specs, len(self.sinks))]
        return sink, [msgspec.structs.replace(s, name=split_name(s.name)[1]) for s in specs]

    def commit(self, version: int) -> None:
        """Commit every sink."""
        for sink in self.sinks:
            with on_device(sink.device):
                sink.commit(version)

    def abort(self) -> None:
        """Abort every sink."""
        for sink in self.sinks:
            with on_device(sink.device):
                sink.abort()
