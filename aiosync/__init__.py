"""aiosync: stream model weights from RL trainers to rollout engines, as asyncio stages.

The native API is async: :class:`WeightSender` in the trainer, :class:`WeightReceiver` with a
sink (:class:`ModuleSink`, :class:`CallbackSink`) in the engine. Drop-in names of NeMo-RL's
``nemo_rl.models.policy.utils`` live in :mod:`aiosync.compat.nemo_rl`.
"""

from aiosync.errors import (
    AiosyncError,
    MismatchError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.pipeline import SyncProgress, SyncReport
from aiosync.receiver import ReceiverConfig, SyncFailure, WeightReceiver
from aiosync.sender import SenderConfig, WeightSender
from aiosync.sinks import CallbackSink, ModuleSink, WeightSink

__version__ = "0.1.0"

__all__ = [
    "AiosyncError",
    "CallbackSink",
    "MismatchError",
    "ModuleSink",
    "PeerGoneError",
    "ProtocolError",
    "ReceiverConfig",
    "RejectedError",
    "SenderConfig",
    "SyncFailure",
    "SyncProgress",
    "SyncReport",
    "SyncTimeoutError",
    "WeightReceiver",
    "WeightSender",
    "WeightSink",
    "__version__",
]
