"""A subscriber engine process for the server's tests and benchmark.

Run as ``python -m tests.server_engine --control ENDPOINT --name NAME [--size-mb N]``.
It holds a zeroed synthetic Llama-shaped model (``aiosync.bench.model``), subscribes, and
prints JSON lines: ``ready`` once subscribed, ``committed`` per version (with the seconds
since it subscribed), and ``digest`` (of the whole model) when it reaches ``--until``. A
line ``follow`` on stdin makes a ``--no-follow`` subscriber follow the newest version
(close stdin once done with it: the process exits after ``--until`` only then).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import anyio
import torch

from aiosync import ModuleSink
from aiosync.bench.model import llama_shapes, tensor_digest
from aiosync.runtime import run
from aiosync.server import Subscriber


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--max-lag", type=int, default=0)
    parser.add_argument("--no-follow", action="store_true")
    parser.add_argument("--until", type=int, default=None, help="exit after this version")
    args = parser.parse_args()
    shapes = llama_shapes(int(args.size_mb * (1 << 20)), torch.float32)
    model = {name: torch.zeros(shape) for name, shape in shapes}
    started = time.perf_counter()

    reached = threading.Event()

    def committed(version: int) -> None:  # a worker thread, after each commit
        emit("committed", version=version, seconds=time.perf_counter() - started)
        if version == args.until:
            emit("digest", version=version, digest=tensor_digest(model))
            reached.set()

    async def serve() -> None:
        nonlocal started
        sink = ModuleSink(model)
        sub = Subscriber(
            args.control,
            sink,
            name=args.name,
            max_lag=args.max_lag,
            follow=not args.no_follow,
            on_commit=committed,
        )
        started = time.perf_counter()
        async with sub, anyio.create_task_group() as tg:
            emit("ready", endpoint=sub.receiver.endpoint)

            async def commands() -> None:
                while line := await anyio.to_thread.run_sync(
                    sys.stdin.readline, abandon_on_cancel=True
                ):
                    if line.strip() == "follow":
                        await sub.follow()

            tg.start_soon(commands)
            if args.until is not None:
                await anyio.to_thread.run_sync(reached.wait, 600)
                tg.cancel_scope.cancel()

    run(serve)


if __name__ == "__main__":
    main()
