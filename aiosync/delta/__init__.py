"""Deltas between versions of a tensor, a version's digest, and when a delta is worth it.

The building blocks of sending a version as a delta against a base the engine holds
(issue 28), each usable on its own: :mod:`~aiosync.delta.format` (the bytes),
:mod:`~aiosync.delta.encode` and :mod:`~aiosync.delta.decode` (torch, CPU and CUDA,
bit-exact), :mod:`~aiosync.delta.digest` (a device checksum of a version's bytes),
:mod:`~aiosync.delta.cost` (delta or dense, per engine) and :mod:`~aiosync.delta.base`
(what the trainer diffs against). The stream does not use them yet.
"""

from aiosync.delta.base import Base, BaseConfig, BaseStore
from aiosync.delta.cost import Choice, Rates, Step, choose, choose_per_engine
from aiosync.delta.decode import apply_delta
from aiosync.delta.digest import VersionDigest, version_digest
from aiosync.delta.encode import EncodedDelta, encode_delta, encode_tensors
from aiosync.delta.format import BITMASK, DENSE, POSITIONS, DeltaHeader

__all__ = [
    "BITMASK",
    "DENSE",
    "POSITIONS",
    "Base",
    "BaseConfig",
    "BaseStore",
    "Choice",
    "DeltaHeader",
    "EncodedDelta",
    "Rates",
    "Step",
    "VersionDigest",
    "apply_delta",
    "choose",
    "choose_per_engine",
    "encode_delta",
    "encode_tensors",
    "version_digest",
]
