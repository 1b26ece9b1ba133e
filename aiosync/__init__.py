"""aiosync: stream model weights from RL trainers to rollout engines, as asyncio stages.

The native API is async: :class:`WeightSender` in the trainer (one or many engines),
:class:`WeightReceiver` with a sink (:class:`ModuleSink`, :class:`CallbackSink`) in each
engine. Drop-in names of NeMo-RL's ``nemo_rl.models.policy.utils`` live in
:mod:`aiosync.compat.nemo_rl`.

The names below are imported on first use, so ``import aiosync`` (and the ``aiosync``
command's ``--help`` and ``--version``) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiosync.core.engine_actions import SyncFailure
    from aiosync.core.errors import (
        AiosyncError,
        BusyError,
        FleetError,
        InDoubtError,
        MismatchError,
        PeerGoneError,
        ProtocolError,
        RejectedError,
        SyncTimeoutError,
        UsageError,
    )
    from aiosync.core.manifest import TensorMeta
    from aiosync.core.trainer_session import EngineOutcome, Policy
    from aiosync.engine.blocking import BackgroundReceiver
    from aiosync.engine.config import ReceiverConfig
    from aiosync.engine.receiver import WeightReceiver
    from aiosync.engine.sinks import CallbackSink, ModuleSink, WeightSink
    from aiosync.pipeline.report import SyncProgress, SyncReport
    from aiosync.planes.shared_tensors import SharedTensors, share_tensors
    from aiosync.trainer.sender import SenderConfig, WeightSender

__version__ = "0.3.0"

_ORIGINS = {
    "aiosync.core.engine_actions": ("SyncFailure",),
    "aiosync.core.errors": (
        "AiosyncError",
        "BusyError",
        "FleetError",
        "InDoubtError",
        "MismatchError",
        "PeerGoneError",
        "ProtocolError",
        "RejectedError",
        "SyncTimeoutError",
        "UsageError",
    ),
    "aiosync.core.manifest": ("TensorMeta",),
    "aiosync.core.trainer_session": ("EngineOutcome", "Policy"),
    "aiosync.engine.blocking": ("BackgroundReceiver",),
    "aiosync.engine.config": ("ReceiverConfig",),
    "aiosync.engine.receiver": ("WeightReceiver",),
    "aiosync.engine.sinks": ("CallbackSink", "ModuleSink", "WeightSink"),
    "aiosync.pipeline.report": ("SyncProgress", "SyncReport"),
    "aiosync.planes.shared_tensors": ("SharedTensors", "share_tensors"),
    "aiosync.trainer.sender": ("SenderConfig", "WeightSender"),
}
_LAZY = {name: module for module, names in _ORIGINS.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiosync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AiosyncError",
    "BackgroundReceiver",
    "BusyError",
    "CallbackSink",
    "EngineOutcome",
    "FleetError",
    "InDoubtError",
    "MismatchError",
    "ModuleSink",
    "PeerGoneError",
    "Policy",
    "ProtocolError",
    "ReceiverConfig",
    "RejectedError",
    "SenderConfig",
    "SharedTensors",
    "SyncFailure",
    "SyncProgress",
    "SyncReport",
    "SyncTimeoutError",
    "TensorMeta",
    "UsageError",
    "WeightReceiver",
    "WeightSender",
    "WeightSink",
    "__version__",
    "share_tensors",
]
