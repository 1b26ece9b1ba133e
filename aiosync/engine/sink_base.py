"""What a receiver needs from the thing that owns the weights: :class:`WeightSink`.

Every member a receiver calls is declared here. Six are abstract (what every sink has);
the rest are hooks with a default that does what a sink without that step needs, so the
receiver calls each directly. A sink that does not subclass :class:`WeightSink` (one
written before it was an abstract class) is wrapped once, when the receiver is made, in an
adapter that supplies these defaults (:func:`aiosync.engine.sink_shape.as_weight_sink`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.planes.base import BucketContext, Part


class WeightSink(ABC):
    """What a receiver needs from the thing that owns the weights.

    It is driven from one worker thread at a time: :meth:`apply_bucket` (through
    :meth:`apply_with`) with a bucket's bytes (a flat ``uint8`` view of the data plane,
    valid only during the call) and the checked specs saying where each tensor lies in
    them, then :meth:`commit` or :meth:`abort` at the end of the version. The hooks with a
    default: :meth:`reserve`, :meth:`commit_quickly`, :meth:`applies_quickly`,
    :attr:`part_devices`, :meth:`apply_parts` and :meth:`apply_with`.
    """

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the weights live (CUDA buffers are opened on this device)."""

    @property
    @abstractmethod
    def staged(self) -> bool:
        """True when nothing visible changes before :meth:`commit` (a broken stream is harmless)."""

    @abstractmethod
    def expectations(self) -> Expectations | None:
        """What the sink takes and what a version must cover; None: anything, nothing."""

    @abstractmethod
    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Write one bucket: ``bucket`` holds each spec's bytes at ``spec.offset``."""

    @abstractmethod
    def commit(self, version: int) -> None:
        """Make everything applied since the last commit visible as ``version``."""

    @abstractmethod
    def abort(self) -> None:
        """Forget everything applied since the last commit that is not yet visible."""

    def reserve(self) -> None:
        """Allocate what staging a version needs; called once, in a worker thread, at start.

        Raises an :class:`~aiosync.AiosyncError` saying how many bytes are needed and how
        many are free when they are not (:meth:`ModuleSink.reserve
        <aiosync.engine.sinks.ModuleSink.reserve>`). Here: nothing to allocate.
        """
        return None

    def commit_quickly(self, version: int) -> bool:
        """Commit now, on the event loop, if no byte has to move (a pointer swap).

        Tried before :meth:`commit` runs in a worker thread; False (here, always): nothing
        was done, call :meth:`commit`.
        """
        return False

    def applies_quickly(self) -> bool:
        """Whether a bucket that was quick last time may be applied on the event loop.

        Here False: a sink's own code may block, or need a worker thread.
        """
        return False

    @property
    def part_devices(self) -> Sequence[torch.device] | None:
        """For a sink made of one sink per trainer rank: where each part of a gathered plane opens.

        None (here): every part opens on :attr:`device`.
        """
        return None

    def apply_parts(self, parts: list[Part]) -> None:
        """One bucket that comes in several (bytes, specs) parts (a direct bucket's regions).

        Here: :meth:`apply_bucket` for each part. A sink that sets its copies up once a
        bucket overrides it (:meth:`ModuleSink.apply_parts
        <aiosync.engine.sinks.ModuleSink.apply_parts>`).
        """
        for bucket, specs in parts:
            self.apply_bucket(bucket, specs)

    def apply_with(self, parts: list[Part], context: BucketContext) -> None:
        """One bucket as the receiver hands it over: its parts and its per-bucket context.

        ``context`` (:class:`~aiosync.planes.base.BucketContext`) holds the plane's hints
        for the copies that follow and says whether the device wait is left to the commit.
        Here it is not used: the parts go to :meth:`apply_parts` or :meth:`apply_bucket`
        (:func:`apply_parts`).
        """
        apply_parts(self, parts)


def apply_parts(sink: WeightSink, parts: list[Part]) -> None:
    """Hand ``sink`` one bucket's parts: in one call where it takes them together.

    That is a sink whose ``apply_parts`` is at least as specific as its ``apply_bucket``
    (a subclass, or an instance, that overrides only ``apply_bucket`` gets one call a
    part, as does a sink whose ``apply_parts`` is :class:`WeightSink`'s).
    """
    if len(parts) > 1 and takes_parts(sink):
        sink.apply_parts(parts)
        return
    for bucket, specs in parts:
        sink.apply_bucket(bucket, specs)


def takes_parts(sink: object) -> bool:
    """Whether ``sink`` has an ``apply_parts`` at least as specific as its ``apply_bucket``.

    Read from its instance's and its classes' own members (:class:`WeightSink`'s default
    counts as not taking parts together).
    """
    try:
        own = vars(sink)
    except TypeError:  # slots: no instance overrides
        own = {}
    if "apply_bucket" in own:
        return "apply_parts" in own
    for cls in type(sink).__mro__:
        if cls is WeightSink:
            return False  # the default: one apply_bucket a part
        if "apply_parts" in cls.__dict__:
            return True
        if "apply_bucket" in cls.__dict__:
            return False
    return False
