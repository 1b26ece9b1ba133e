"""Collectives: side process groups, their rendezvous, and the thread that runs them.

- :func:`init_process_group`: a torch.distributed group beside the default world
  (NeMo-RL's reference semantics); :func:`destroy_side_group`, :func:`abort_side_group`.
- :mod:`aiosync.collectives.rendezvous`: a TCPStore listening on loopback or one named
  interface, and the random token that prefixes a group's keys.
- :class:`GroupExecutor`: one thread per group for its blocking collectives, a
  :class:`Deadline` per sync, abort on timeout.

The collective data plane of the native pipeline is :mod:`aiosync.planes.collective`.
"""

from __future__ import annotations

from aiosync.collectives.executor import Deadline, GroupExecutor, collective_error
from aiosync.collectives.process_group import (
    abort_side_group,
    destroy_side_group,
    group_backend,
    init_process_group,
)
from aiosync.collectives.rendezvous import (
    HostedStore,
    connect_store,
    host_store,
    new_token,
    token_store,
)

__all__ = [
    "Deadline",
    "GroupExecutor",
    "HostedStore",
    "abort_side_group",
    "collective_error",
    "connect_store",
    "destroy_side_group",
    "group_backend",
    "host_store",
    "init_process_group",
    "new_token",
    "token_store",
]
