"""The collective plane's options: how a trainer broadcasts buckets, checked when made.

:class:`~aiosync.planes.collective.CollectiveSenderPlane` is built from them; they are
re-exported by :mod:`aiosync.planes.collective`.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass

from aiosync.collectives.rendezvous import LOOPBACK, valid_host
from aiosync.planes.collective_meeting import RENDEZVOUS, Rendezvous, file_rendezvous
from aiosync.planes.collective_receiver import BACKENDS, MAX_TIMEOUT_MS, MAX_WORLD

__all__ = ["CollectiveOptions"]


@dataclass(frozen=True)
class CollectiveOptions:
    """How a trainer broadcasts buckets to ``engines`` engine ranks (world size 1 + that).

    ``backend``: ``"nccl"`` or ``"gloo"`` (default: NCCL for a CUDA device, else Gloo).
    The rendezvous store listens on ``host`` (an IP address, loopback by default) or on
    the address of network interface ``interface``. ``per_tensor``: one broadcast per
    tensor instead of one per packed bucket. ``timeout`` (seconds) bounds the rendezvous
    and each broadcast. Over NCCL, engines always copy bucket k into their model while
    they receive bucket k + 1 (their sinks wait for the GPU once, at commit, as with the
    CUDA IPC plane's events). ``overlap=`` is deprecated: it changes nothing and warns.

    ``rendezvous``: where the ranks meet. ``"auto"`` (default): a private file on this
    host when the store would listen on loopback (no other user can open it), else a
    ``TCPStore`` on ``host`` / ``interface``. ``"file"``: the file (this host only);
    ``"tcp"``: the ``TCPStore`` even on loopback (engines of another user, or in another
    container sharing the network but not ``/tmp``). Either way every engine rank proves
    the secret of its own session before any weight is broadcast (docs/security.md).
    """

    engines: int
    backend: str | None = None
    host: str = LOOPBACK
    interface: str | None = None
    per_tensor: bool = False
    timeout: float = 60.0
    overlap: InitVar[bool | None] = None
    rendezvous: Rendezvous = "auto"

    def __post_init__(self, overlap: bool | None) -> None:
        if overlap is not None:
            warnings.warn(
                "CollectiveOptions(overlap=...) is deprecated and changes nothing: over NCCL, "
                "engines always copy a bucket out while they receive the next",
                DeprecationWarning,
                stacklevel=3,
            )
        if not 1 <= self.engines < MAX_WORLD:
            raise ValueError(f"engines must be in [1, {MAX_WORLD}), got {self.engines}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.timeout * 1000 <= MAX_TIMEOUT_MS:
            raise ValueError(f"timeout must be positive and at most a day, got {self.timeout}")
        valid_host(self.host)
        if self.rendezvous not in RENDEZVOUS:
            raise ValueError(f"rendezvous must be one of {RENDEZVOUS}, got {self.rendezvous!r}")
        file_rendezvous(self.rendezvous, self.host, self.interface)
