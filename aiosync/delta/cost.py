"""Whether a version should travel as a delta or dense, per engine, from measured rates.

A pure function of numbers: the rates of one engine's path (:class:`Rates`, measured by
whoever calls it) and the step (:class:`Step`: its dense bytes and how many elements
changed, or the delta's measured size). A version is a pipeline of stages over its buffers
(the trainer packs or encodes the next buffer while the link carries this one and the
engine applies the last), so by default its time is its slowest stage plus a fixed cost per
message; ``Rates(overlapped=False)`` adds the stages instead.

A delta adds two stages that read the whole tensor (the encode reads both versions, the
decode walks the bitmask and scatters) to save link bytes. Where the link is about as fast
as reading memory (shared memory on one host, a device copy), the encode alone costs as
much as the dense copy and dense wins; on a 10 Gb/s link a delta of a few percent wins
by the ratio of the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from aiosync.delta.format import CHUNK_BYTES, encoding_bytes

GB = 1e9
"""Bytes in the GB of every rate here."""


@dataclass(frozen=True)
class Rates:
    """One engine's path, measured, in GB/s of the bytes each stage handles.

    ``link_gbps``: bytes the path carries (the plane's copy or the wire). ``encode_gbps``:
    dense bytes the trainer's encoder turns into a delta per second (it reads both
    versions). ``decode_gbps``: dense bytes an engine applies a delta over per second.
    ``apply_gbps``: dense bytes an engine applies per second when sent dense (``inf``: the
    link's copy is the apply). ``message_s``: fixed cost of one message of up to
    ``message_bytes``. ``overlapped``: the stages pipeline (the stream) or run in turn.
    """

    link_gbps: float
    encode_gbps: float
    decode_gbps: float
    apply_gbps: float = math.inf
    message_s: float = 0.0
    message_bytes: int = 1 << 30
    overlapped: bool = True


@dataclass(frozen=True)
class Step:
    """One version's change: its dense bytes and how much of it changed.

    ``dense_bytes`` of ``itemsize``-byte elements, a fraction ``density`` of them changed
    (spread evenly), or the delta's measured size ``delta_bytes`` (then used instead).
    """

    dense_bytes: int
    itemsize: int
    density: float = 0.0
    delta_bytes: int | None = None


@dataclass(frozen=True)
class Choice:
    """The decision for one engine and both estimates behind it (seconds, bytes)."""

    delta: bool
    delta_s: float
    dense_s: float
    delta_bytes: int
    dense_bytes: int

    @property
    def kind(self) -> str:
        """``"delta"`` or ``"dense"``."""
        return "delta" if self.delta else "dense"


def estimated_delta_bytes(step: Step, chunk_bytes: int = CHUNK_BYTES) -> int:
    """A delta's bytes (payloads and headers) for ``step``.

    The measured size if given, else each chunk's smallest encoding at the step's density.
    """
    if step.delta_bytes is not None:
        return step.delta_bytes
    numel = step.dense_bytes // step.itemsize
    chunk = max(8, chunk_bytes // step.itemsize)
    chunks = -(-numel // chunk)
    changed = round(step.density * chunk)
    per_chunk = min(encoding_bytes(chunk, changed, step.itemsize))
    return chunks * (per_chunk + 5) + 48


def _seconds(stages: list[float], nbytes: int, rates: Rates) -> float:
    messages = max(1, -(-nbytes // rates.message_bytes))
    total = max(stages) if rates.overlapped else sum(stages)
    return total + messages * rates.message_s


def dense_seconds(step: Step, rates: Rates) -> float:
    """The version's time sent dense."""
    n = step.dense_bytes
    return _seconds([n / (rates.link_gbps * GB), n / (rates.apply_gbps * GB)], n, rates)


def delta_seconds(step: Step, rates: Rates, delta_bytes: int | None = None) -> float:
    """The version's time sent as a delta of ``delta_bytes`` (estimated if not given)."""
    n = step.dense_bytes
    d = estimated_delta_bytes(step) if delta_bytes is None else delta_bytes
    stages = [
        n / (rates.encode_gbps * GB),
        d / (rates.link_gbps * GB),
        n / (rates.decode_gbps * GB),
    ]
    return _seconds(stages, d, rates)


def choose(step: Step, rates: Rates) -> Choice:
    """Delta or dense for one engine: the faster estimate (dense when equal)."""
    d = estimated_delta_bytes(step)
    delta_s, dense_s = delta_seconds(step, rates, d), dense_seconds(step, rates)
    return Choice(delta_s < dense_s, delta_s, dense_s, d, step.dense_bytes)


def choose_per_engine(step: Step, rates: Mapping[str, Rates]) -> dict[str, Choice]:
    """:func:`choose` for each engine of a fleet, by its own path's rates.

    The delta is encoded once for every engine that takes it, but each waits for it at the
    encoder's rate, so each engine's choice stands on its own.
    """
    return {engine: choose(step, path) for engine, path in rates.items()}
