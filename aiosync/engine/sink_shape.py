"""A sink's shape, checked when a receiver is made; a sink not subclassing WeightSink adapted.

A sink written against an older aiosync (one without ``expectations()`` or ``staged``, say)
would otherwise fail the first time the receiver reaches for the missing member: at start
with a bare ``AttributeError``, or only when a trainer's stream arrives, with a message
naming nothing but the attribute. :func:`check_sink` names every missing member at once.

A sink that has every member but does not subclass :class:`~aiosync.engine.sinks.WeightSink`
(duck-typed, as sinks were before it was an abstract class) keeps working:
:func:`as_weight_sink` wraps it in a :class:`SinkAdapter`, which reads its members once,
here, and supplies :class:`~aiosync.engine.sinks.WeightSink`'s defaults for the hooks it
lacks. The receiver then calls every hook directly, never looking one up by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from aiosync.core.errors import UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.engine.sink_base import WeightSink, takes_parts
from aiosync.planes.base import Part

METHODS = ("expectations", "apply_bucket", "commit", "abort")
"""What a receiver calls on every sink (:class:`~aiosync.engine.sinks.WeightSink`)."""
PROPERTIES = ("device", "staged")
"""What a receiver reads on every sink."""
HOOKS = ("reserve", "commit_quickly", "applies_quickly", "part_devices", "apply_parts")
"""The hooks with a default that a duck-typed sink may have of its own."""

_ABSENT = object()


class SinkShape(Protocol):
    """The members every sink has: what a sink that does not subclass ``WeightSink`` needs."""

    @property
    def device(self) -> torch.device:
        """Where the weights live."""

    @property
    def staged(self) -> bool:
        """True when nothing visible changes before :meth:`commit`."""

    def expectations(self) -> Expectations | None:
        """What the sink takes and what a version must cover."""

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Write one bucket."""

    def commit(self, version: int) -> None:
        """Make everything applied since the last commit visible as ``version``."""

    def abort(self) -> None:
        """Forget everything applied since the last commit."""


def _members(candidate: object, names: Sequence[str]) -> dict[str, Any]:
    """``candidate``'s members of ``names`` (``_ABSENT`` for each it lacks).

    The one look at a sink's members by name: when a receiver is made, never per bucket.
    """
    return {name: getattr(candidate, name, _ABSENT) for name in names}


def missing_members(sink: object) -> list[str]:
    """The members of :class:`~aiosync.engine.sinks.WeightSink` that ``sink`` lacks.

    Methods are named with ``()``; a method that is there but not callable counts as missing.
    """
    found = _members(sink, (*PROPERTIES, *METHODS))
    missing = [name for name in PROPERTIES if found[name] is _ABSENT]
    missing += [f"{name}()" for name in METHODS if not callable(found[name])]
    return missing


def check_sink(sink: object) -> None:
    """Raise :class:`UsageError` naming each member ``sink`` lacks, before anything runs."""
    missing = missing_members(sink)
    if not missing:
        return
    raise UsageError(
        f"{type(sink).__name__} is not a weight sink: it has no {', '.join(missing)}. A sink "
        "needs device, staged, expectations() (None takes any tensor), "
        "apply_bucket(bucket, specs), commit(version) and abort() "
        "(aiosync.engine.sinks.WeightSink; ModuleSink and CallbackSink have them all)"
    )


def as_weight_sink(sink: WeightSink | SinkShape) -> WeightSink:
    """``sink`` as a :class:`WeightSink`: itself if it subclasses it, else in an adapter.

    A sink lacking a member the receiver calls is refused (:func:`check_sink`).
    """
    if isinstance(sink, WeightSink):
        return sink
    reserve = _members(sink, ("reserve",))["reserve"]
    return SinkAdapter(sink) if not callable(reserve) else ReservingSinkAdapter(sink)


class SinkAdapter(WeightSink):
    """A sink of :class:`SinkShape` that does not subclass :class:`WeightSink`, as one.

    Every member of ``wrapped`` is read once, when the adapter is made: each hook of
    :data:`HOOKS` that it has of its own is called, the default of :class:`WeightSink`
    otherwise. ``apply_parts`` is the sink's only where it is at least as specific as its
    ``apply_bucket`` (see :func:`~aiosync.engine.sinks.apply_parts`). A sink with a
    ``reserve()`` of its own is adapted by :class:`ReservingSinkAdapter`: here ``reserve``
    stays :class:`WeightSink`'s (so a :class:`~aiosync.topology.RankedSink` knows, by the
    method, that there is nothing to reserve on that sink's device).
    """

    def __init__(self, wrapped: SinkShape) -> None:
        check_sink(wrapped)
        self.wrapped = wrapped
        hooks = _members(wrapped, HOOKS)
        self._reserve: Callable[[], None] | None = _callable(hooks["reserve"])
        self._commit_quickly: Callable[[int], bool] | None = _callable(hooks["commit_quickly"])
        self._applies_quickly: Callable[[], bool] | None = _callable(hooks["applies_quickly"])
        devices = hooks["part_devices"]
        self._part_devices: Sequence[torch.device] | None = None if devices is _ABSENT else devices
        self._apply_parts: Callable[[list[Part]], None] | None = (
            _callable(hooks["apply_parts"]) if takes_parts(wrapped) else None
        )

    @property
    def device(self) -> torch.device:
        """The wrapped sink's ``device``."""
        return self.wrapped.device

    @property
    def staged(self) -> bool:
        """The wrapped sink's ``staged``."""
        return self.wrapped.staged

    def expectations(self) -> Expectations | None:
        """The wrapped sink's ``expectations()``."""
        return self.wrapped.expectations()

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """The wrapped sink's ``apply_bucket``."""
        self.wrapped.apply_bucket(bucket, specs)

    def commit(self, version: int) -> None:
        """The wrapped sink's ``commit``."""
        self.wrapped.commit(version)

    def abort(self) -> None:
        """The wrapped sink's ``abort``."""
        self.wrapped.abort()

    def commit_quickly(self, version: int) -> bool:
        """The wrapped sink's ``commit_quickly(version)`` if it has one; else False."""
        return self._commit_quickly is not None and bool(self._commit_quickly(version))

    def applies_quickly(self) -> bool:
        """The wrapped sink's ``applies_quickly()`` if it has one; else False."""
        return self._applies_quickly is not None and bool(self._applies_quickly())

    @property
    def part_devices(self) -> Sequence[torch.device] | None:
        """The wrapped sink's ``part_devices`` as read when the adapter was made; else None."""
        return self._part_devices

    def apply_parts(self, parts: list[Part]) -> None:
        """The wrapped sink's ``apply_parts`` where it takes parts together; else one a part."""
        if self._apply_parts is not None:
            self._apply_parts(parts)
            return
        for bucket, specs in parts:
            self.wrapped.apply_bucket(bucket, specs)


class ReservingSinkAdapter(SinkAdapter):
    """A :class:`SinkAdapter` for a sink with a ``reserve()`` of its own."""

    def reserve(self) -> None:
        """The wrapped sink's ``reserve()``."""
        if self._reserve is not None:
            self._reserve()


def _callable(member: Any) -> Any:
    """``member`` if it can be called, else None."""
    return member if callable(member) else None
