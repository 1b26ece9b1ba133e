"""Trainer and engine processes for the tests that kill a peer mid-stream.

Run as ``python -m tests.helpers.peers engine|trainer --endpoint ...``; each prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Iterable, Iterator

import anyio
import torch

from aiosync import CallbackSink, ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run
from tests.helpers.models import digest, mixed_weights


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def engine(args: argparse.Namespace) -> None:
    """An engine whose loader takes ``--delay`` seconds per bucket (or a module, ``--module``)."""
    if args.module:
        module_engine(args)
        return

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        emit("applying", names=[name for name, _ in pairs])
        time.sleep(args.delay)

    async def main() -> None:
        async with WeightReceiver(CallbackSink(load_weights), args.endpoint) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            await anyio.sleep_forever()

    run(main)


def module_engine(args: argparse.Namespace) -> None:
    """An engine holding ``mixed_weights`` shapes on ``--device``; reports digests per commit."""
    device = torch.device(args.device)
    model = {
        name: torch.zeros(t.shape, dtype=t.dtype, device=device)
        for name, t in mixed_weights().items()
    }

    def committed(version: int) -> None:
        emit("committed", version=version, digests={n: digest(t) for n, t in model.items()})

    async def main() -> None:
        sink = ModuleSink(model)
        async with WeightReceiver(sink, args.endpoint, on_commit=committed) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            await anyio.sleep_forever()

    run(main)


def trainer(args: argparse.Namespace) -> None:
    """Send version 0 whole, then stall inside version 1 after ``--stall-after`` tensors."""
    weights = mixed_weights()

    def stalling() -> Iterator[tuple[str, torch.Tensor]]:
        # The big tensor first: its chunks fill whole buckets, which go out before the stall.
        ordered = sorted(weights.items(), key=lambda kv: kv[0] != "lm_head.weight")
        for i, item in enumerate(ordered):
            if i == args.stall_after:
                emit("stalled")
                signal.pause()  # wait to be killed
            yield item

    async def main() -> None:
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
        async with WeightSender(args.endpoint, config=config) as sender:
            await sender.send(weights.items(), version=0)
            emit("synced", version=0)
            await sender.send(stalling(), version=1)

    run(main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["engine", "trainer"])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--stall-after", type=int, default=1)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    engine(args) if args.role == "engine" else trainer(args)
