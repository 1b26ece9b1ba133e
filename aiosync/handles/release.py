"""Leaving a side group at once, on either side.

Destroying an NCCL communicator finalizes it, which can wait for the other ranks to do the
same: a rank that leaves alone (the engine asked first, the trainer after) then waits,
seen on two H200s as a minute per disconnect. Leaving by abort (``ncclCommAbort``, local,
never waits for a peer) and only then stopping each group's thread makes every side leave
at once, whatever the others do. Gloo groups are destroyed, which is local too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiosync.collectives import GroupExecutor, abort_side_group

log = logging.getLogger(__name__)


def release(executors: Sequence[GroupExecutor]) -> None:
    """Abort every NCCL group of ``executors``, then close them all (blocking, bounded).

    Call it when no collective runs on them (a running one: ``executor.fail`` first).
    """
    for executor in executors:
        group = executor.group
        try:
            if group is not None and abort_side_group(group):
                executor.group = None
        except Exception as exc:  # closing destroys it instead
            log.info("group %s: abort on leaving failed: %s", executor.name, exc)
    for executor in executors:
        executor.close()
