"""A subscriber engine process for the server's tests and benchmark.

Run as ``python -m tests.helpers.server_engine --control ENDPOINT --name NAME [--size-mb N]``.
It holds a zeroed synthetic Llama-shaped model (``aiosync.bench.model``), subscribes, and
prints JSON lines: ``ready`` once subscribed, ``committed`` per version (with the seconds
since it subscribed), and ``digest`` (of the whole model) when it reaches ``--until``. A
line ``follow`` on stdin makes a ``--no-follow`` subscriber follow the newest version
(close stdin once done with it: the process exits after ``--until`` only then).
``--resume-dir D`` keeps the buckets of an unfinished version in ``D`` (engine resume);
``--stall-after K`` blocks for good in the bucket after the K-th, once it printed
``stalled`` (a test then kills the process mid-version).
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
from aiosync.core.layout import TensorSpec
from aiosync.runtime import run
from aiosync.server import Subscriber


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class StallingSink(ModuleSink):
    """Takes ``count`` buckets, then blocks in the next one for good (after ``stalled``)."""

    def __init__(self, model: dict[str, torch.Tensor], count: int) -> None:
        super().__init__(model)
        self.left = count

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        if self.left == 0:
            emit("stalled")
            threading.Event().wait()
        self.left -= 1
        super().apply_bucket(bucket, specs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--max-lag", type=int, default=0)
    parser.add_argument("--no-follow", action="store_true")
    parser.add_argument("--until", type=int, default=None, help="exit after this version")
    parser.add_argument("--resume-dir", default=None, help="keep unfinished buckets here")
    parser.add_argument("--stall-after", type=int, default=None, metavar="K")
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
        sink = (
            ModuleSink(model) if args.stall_after is None else StallingSink(model, args.stall_after)
        )
        sub = Subscriber(
            args.control,
            sink,
            name=args.name,
            max_lag=args.max_lag,
            follow=not args.no_follow,
            on_commit=committed,
            resume_dir=args.resume_dir,
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
