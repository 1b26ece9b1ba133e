"""aiosync: stream model weights from RL trainers to rollout engines, as asyncio stages.

The native API is async: :class:`WeightSender` in the trainer (one or many engines),
:class:`WeightReceiver` with a sink (:class:`ModuleSink`, :class:`CallbackSink`) in each
engine. Drop-in names of NeMo-RL's ``nemo_rl.models.policy.utils`` live in
:mod:`aiosync.compat.nemo_rl`.
"""

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
