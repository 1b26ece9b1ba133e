"""Before any weight moves, every rank of a side group proves itself (the collective steps).

A rendezvous store is no secret: a ``TCPStore`` lists its keys to any client, token and
all. So the group's ranks do not take the store's word for who they are. Right after the
group forms, on each rank's group thread and in the same order everywhere:

1. every rank gathers every rank's row (:func:`aiosync.collectives.rank_proofs.engine_row`;
   the trainer's is zeros), made with the secret its hello carried;
2. the trainer judges them and broadcasts its verdict, with a proof for each admitted rank;
3. a refused group fails on every rank, naming the rank, before the first bucket.

Also here: claiming a rank and waiting, in short polls that a closing plane stops, until
every engine rank is claimed (torch's own rendezvous cannot be interrupted).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

import numpy
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, Store

from aiosync.collectives import ops
from aiosync.collectives.deadline import Deadline
from aiosync.collectives.rank_proofs import (
    ROW_BYTES,
    Admission,
    encode_verdict,
    engine_row,
    judge,
    read_verdict,
    refused_error,
    verdict_bytes,
)
from aiosync.core.errors import PeerGoneError, ProtocolError, SyncTimeoutError

log = logging.getLogger(__name__)

RANK_KEY = "aiosync-next-rank"
POLL = 0.02
"""Seconds between looks at the rank counter while ranks are still joining."""


def claim_rank(store: Store, world_size: int, group: str) -> int:
    """The next free engine rank (raises :class:`ProtocolError` when the group is full)."""
    rank = int(store.add(RANK_KEY, 1))
    if not 0 < rank < world_size:
        raise ProtocolError(f"group {group} is full ({world_size - 1} engine ranks)")
    return rank


def wait_for_ranks(
    store: Store, world_size: int, deadline: Deadline, stopped: threading.Event, group: str
) -> None:
    """Return once every engine rank is claimed; raise if ``stopped`` or past ``deadline``."""
    claimed = 0
    while True:
        if stopped.is_set():
            raise PeerGoneError(f"group {group}: closed before every rank had joined")
        if store.check([RANK_KEY]):
            claimed = int(store.get(RANK_KEY))
            if claimed >= world_size - 1:
                return
        if deadline.expired:
            raise SyncTimeoutError(
                f"group {group}: {claimed} of {world_size - 1} engine ranks joined within "
                f"the {deadline.seconds:g}s deadline"
            )
        stopped.wait(min(POLL, deadline.remaining()))


def admit_ranks(
    group: dist.ProcessGroup,
    device: torch.device,
    world_size: int,
    issued: Collection[str],
    names: tuple[str, str],
    deadline: Deadline,
) -> Admission:
    """The trainer's side (rank 0): judge every rank's row, tell them all; blocking.

    ``issued``: the secrets handed out in hellos; ``names``: the group's name and token.
    Raises :class:`ProtocolError` naming every refused rank (after telling the ranks).
    """
    name, token = names
    rows = _gather(group, device, bytes(ROW_BYTES), world_size, deadline)
    admission = judge(rows, issued, name, token)
    verdict = encode_verdict(admission, world_size, name, token)
    _broadcast(group, device, bytearray(verdict), deadline)
    if admission.refused:
        raise refused_error(admission, name)
    log.debug("group %s: %d engine ranks admitted", name, len(admission.proved))
    return admission


def prove_rank(
    group: dist.ProcessGroup,
    device: torch.device,
    rank: int,
    world_size: int,
    secret: str,
    names: tuple[str, str],
    deadline: Deadline,
) -> None:
    """An engine's side: offer this rank's row, check the trainer's verdict; blocking.

    Raises :class:`ProtocolError` if the trainer refused the group, or if rank 0 could
    not prove it holds this session's secret.
    """
    name, token = names
    _gather(group, device, engine_row(secret, name, token, rank), world_size, deadline)
    verdict = _broadcast(group, device, bytearray(verdict_bytes(world_size)), deadline)
    read_verdict(verdict, secret, name, token, rank)


def _gather(
    group: dist.ProcessGroup,
    device: torch.device,
    row: bytes,
    world_size: int,
    deadline: Deadline,
) -> list[bytes]:
    mine = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(device)
    rows = [torch.empty(ROW_BYTES, dtype=torch.uint8, device=device) for _ in range(world_size)]
    options = AllgatherOptions()
    options.timeout = ops.op_timeout(deadline, mine)
    group.allgather([rows], [mine], options).wait()
    if mine.is_cuda:
        torch.cuda.current_stream(device).synchronize()
    return [_bytes(each) for each in rows]


def _broadcast(
    group: dist.ProcessGroup, device: torch.device, data: bytearray, deadline: Deadline
) -> bytes:
    tensor = torch.frombuffer(data, dtype=torch.uint8).to(device)
    ops.broadcast(group, tensor, 0, deadline)
    return _bytes(tensor)


def _bytes(tensor: torch.Tensor) -> bytes:
    array: numpy.ndarray = tensor.cpu().numpy()  # type: ignore[type-arg]
    return array.tobytes()
