"""How a :class:`~aiosync.trainer.sender.WeightSender` buffers, waits and commits."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from aiosync.core.layout import ALIGNMENT
from aiosync.core.trainer_session import Policy

MiB = 1 << 20


@dataclass(frozen=True)
class SenderConfig:
    """How a sender buffers, how long it waits and how it commits.

    ``buffer_bytes`` is the size of each of the ``num_buffers`` buffers (rounded up to the
    alignment); ``timeout`` bounds every wait on an engine, in seconds. Every ``keepalive``
    seconds the sender tells idle engines it is alive (keep it well under their
    ``session_timeout``); a caller's REQ socket cannot, so its sessions are short.
    ``policy`` is the default commit policy, ``"all"`` or ``"available"``.
    ``check_snapshot`` (a debugging aid) samples the tensors when a send starts and again
    once they are packed, and fails the version if the trainer changed them in between.
    ``direct`` (direct mode, :mod:`aiosync.trainer.direct`): engines read persistent
    tensors in the trainer's memory (``True``: parameters and tensors placed by
    :func:`aiosync.share_tensors`; or a collection of names) and the rest is packed.
    """

    buffer_bytes: int = 128 * MiB
    num_buffers: int = 2
    timeout: float = 60.0
    keepalive: float = 10.0
    name: str = ""
    policy: Policy | str = Policy.ALL
    check_snapshot: bool = False
    direct: bool | Collection[str] = False

    def __post_init__(self) -> None:
        if not isinstance(self.direct, bool):
            object.__setattr__(self, "direct", frozenset(self.direct))
        if self.num_buffers < 1:
            raise ValueError("num_buffers must be at least 1")
        if self.buffer_bytes < ALIGNMENT:
            raise ValueError(f"buffer_bytes must be at least {ALIGNMENT}")
        if self.timeout <= 0 or self.keepalive <= 0:
            raise ValueError("timeout and keepalive must be positive")
        object.__setattr__(self, "policy", Policy(self.policy))
