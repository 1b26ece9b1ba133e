"""A helper process for the collectives tests:
``python -m tests.helpers.collective_worker MODE ...``.

Modes (each prints JSON lines):

- ``worlds RANK PORT TOKEN DIR``: a default world of 2 ranks plus two side groups (one from
  a store with a token prefix, one from a ``file://`` init_method), each used, then torn down.
- ``hold PORT TOKEN NAME TIMEOUT``: joins side group NAME as rank 1 of 2, prints ``joined``,
  then for each stdin line ``go`` takes part in one broadcast from rank 0 (printing what it
  received); at end of input it leaves.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from aiosync.collectives import (
    connect_store,
    destroy_side_group,
    init_process_group,
    token_store,
)


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def worlds(rank: int, port: int, token: str, directory: str) -> None:
    timeout = timedelta(seconds=30)
    client = connect_store("127.0.0.1", port, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default", client), rank=rank, world_size=2
    )
    # side group 1: the same store, a token prefix, ranks swapped relative to the world
    s1 = init_process_group(
        "gloo",
        store=token_store(client, token),
        world_size=2,
        rank=1 - rank,
        group_name="s1",
        timeout=timeout,
    )
    # side group 2: its own rendezvous through init_method
    s2 = init_process_group(
        "gloo",
        init_method=f"file://{directory}/s2",
        world_size=2,
        rank=rank,
        group_name="s2",
        timeout=timeout,
    )
    world = torch.tensor([float(rank + 1)])
    dist.all_reduce(world)
    one = torch.tensor([10.0 * rank])
    dist.broadcast(one, src=0, group=s1)  # s1's rank 0 is world rank 1
    two = torch.tensor([100.0 + rank])
    dist.broadcast(two, src=0, group=s2)
    dist.all_reduce(world)  # the default world still works after the side groups
    emit(
        "worlds",
        rank=rank,
        world=world.item(),
        s1=one.item(),
        s2=two.item(),
        default_size=dist.get_world_size(),
        default_is_side=c10d._get_default_group() in (s1, s2),
        s1_rank=s1.rank(),
    )
    destroy_side_group(s1)
    destroy_side_group(s2)
    destroy_side_group(s2)  # idempotent
    dist.all_reduce(world)  # the world survives its side groups
    emit("done", world=world.item())
    dist.destroy_process_group()


def hold(port: int, token: str, name: str, timeout: float) -> None:
    wait = timedelta(seconds=timeout)
    client = connect_store("127.0.0.1", port, timeout=wait)
    group = init_process_group(
        "gloo", store=token_store(client, token), world_size=2, rank=1, group_name=name,
        timeout=wait,
    )  # fmt: skip
    emit("joined")
    for line in sys.stdin:
        if line.strip() != "go":
            break
        received = torch.zeros(4)
        try:
            dist.broadcast(received, src=0, group=group)
        except RuntimeError as exc:
            emit("failed", error=str(exc).splitlines()[0])
            return
        emit("received", values=received.tolist())
    destroy_side_group(group)


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "worlds":
        worlds(int(args[0]), int(args[1]), args[2], args[3])
    elif mode == "hold":
        hold(int(args[0]), args[1], args[2], float(args[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
