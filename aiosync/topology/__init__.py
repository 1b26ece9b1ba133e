"""Colocated topologies: trainer ranks on an engine's GPUs hand it each bucket together.

- :mod:`~aiosync.topology.layout` (pure): which engine covers which rank, source and
  placeholder ranks, the dense offsets;
- :mod:`~aiosync.topology.connect`: the Gloo groups of a layout, built collectively, cached;
- :mod:`~aiosync.core.colocated_parts` (pure) and :mod:`~aiosync.topology.gather`: a rank's
  bucket description as msgpack bytes, gathered in ``uint8`` tensors (never pickled);
- :mod:`~aiosync.topology.send`: the trainer ranks' sync;
- :mod:`~aiosync.engine.colocated`: the engine's side, one sink per GPU (with the engine
  package: the engine handles use it too, and the topology sits above them);
- :mod:`~aiosync.topology.pipeline`, :mod:`~aiosync.topology.plans` (pure) and
  :mod:`~aiosync.topology.sink`: the same on the native pipeline (a ``WeightReceiver`` over
  a :class:`RankedSink` is the engine).
"""

from aiosync.engine.colocated import ColocatedReceiver
from aiosync.topology.connect import connect_topology, disconnect_topology
from aiosync.topology.layout import (
    EngineRange,
    Layout,
    LayoutError,
    derive_engine_gpu_offsets,
    plan_layout,
)
from aiosync.topology.pipeline import ColocatedSession, TopologyReport
from aiosync.topology.send import ColocatedReport, send_colocated
from aiosync.topology.sink import RankedSink

__all__ = [
    "ColocatedReceiver",
    "ColocatedReport",
    "ColocatedSession",
    "EngineRange",
    "Layout",
    "LayoutError",
    "RankedSink",
    "TopologyReport",
    "connect_topology",
    "derive_engine_gpu_offsets",
    "disconnect_topology",
    "plan_layout",
    "send_colocated",
]
