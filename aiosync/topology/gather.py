"""Moving descriptions between trainer ranks over Gloo: bytes in ``uint8`` tensors, no pickle.

torch's ``gather_object`` pickles; here each rank's bytes travel as a ``uint8`` tensor. The
ranks first exchange their lengths (one ``int64`` each, fixed size), so every rank pads to
the same width and checks the same bounds, then gather the padded bytes to one rank, which
cuts each back to its length. Blocking calls: run them where blocking is allowed (a worker
thread under an event loop). The group's own timeout bounds every wait.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from aiosync.core.errors import AiosyncError, PeerGoneError, ProtocolError, SyncTimeoutError


def collective_error(exc: RuntimeError, what: str, ranks: list[int]) -> AiosyncError:
    """A failed Gloo collective as an aiosync error naming the ranks it spanned.

    Gloo reports a wait past the group's timeout and a peer that closed its connection
    (it exited or was killed) both as ``RuntimeError``; the text tells them apart.
    """
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(f"{what} over ranks {ranks} timed out: {text}")
    return PeerGoneError(f"{what} over ranks {ranks} failed: {text}")


def gather_bytes(payload: bytes, *, group: Any, dst: int, max_bytes: int) -> list[bytes] | None:
    """Gather every group member's ``payload`` to global rank ``dst``, in group-rank order.

    Returns the list on ``dst`` and None elsewhere. Every member sees all lengths, so a
    length over ``max_bytes`` raises :class:`ProtocolError` naming the rank on every member
    alike (none is left waiting in the second collective). A collective that fails raises
    :func:`collective_error`'s error.
    """
    size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    mine = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    try:
        dist.all_gather(lengths, mine, group=group)
    except RuntimeError as exc:
        raise collective_error(exc, "exchanging description lengths", ranks) from exc
    sizes = [int(t.item()) for t in lengths]
    for rank, length in zip(ranks, sizes, strict=True):
        if not 0 <= length <= max_bytes:
            raise ProtocolError(
                f"rank {rank} describes its bucket in {length} bytes (most {max_bytes})"
            )
    width = max(1, *sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    mine_is_dst = dist.get_rank() == dst
    try:
        dist.gather(padded, out if mine_is_dst else None, dst=dst, group=group)
    except RuntimeError as exc:
        raise collective_error(exc, f"gathering descriptions to rank {dst}", ranks) from exc
    if not mine_is_dst:
        return None
    return [t[:length].numpy().tobytes() for t, length in zip(out, sizes, strict=True)]


def agree_on_failures(failed: list[bool], *, group: Any) -> list[bool]:
    """All-reduce per-engine failure flags over ``group``: an engine failed if anyone says so.

    Each source rank sets its own engine's flag; afterwards every member knows which engines
    failed this bucket. This is also the point where all the covered ranks meet.
    """
    flags = torch.tensor([1 if f else 0 for f in failed], dtype=torch.int64)
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        ranks = dist.get_process_group_ranks(group)
        raise collective_error(exc, "agreeing on the bucket's outcome", ranks) from exc
    return [bool(v) for v in flags.tolist()]


def broadcast_ints(values: list[int], *, group: Any, src: int) -> list[int]:
    """Broadcast a few ``int64`` from global rank ``src`` over ``group``; the values on every rank.

    The source's command to its engine's ranks on the native pipeline (every member passes a
    list of the same length; the others' values are overwritten).
    """
    tensor = torch.tensor(values, dtype=torch.int64)
    try:
        dist.broadcast(tensor, src=src, group=group)
    except RuntimeError as exc:
        ranks = dist.get_process_group_ranks(group)
        raise collective_error(exc, f"waiting for rank {src}'s command", ranks) from exc
    return [int(v) for v in tensor.tolist()]
