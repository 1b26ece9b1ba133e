"""An engine process for the fleet tests: ``python -m tests.helpers.fleet_engine [options]``.

It serves ``mixed_weights`` shapes (zeros at start) from a private endpoint and prints JSON
lines: ``ready`` (with the endpoint), ``applying`` before each bucket (with ``--delay``
seconds of work after it), ``committed`` (with per-tensor digests) after each commit.
``--extra NAME`` adds a required tensor no trainer sends, so every version is refused;
``--device cuda:N`` holds the model on a GPU (buffers then arrive through CUDA IPC);
``--die-in-commit`` exits once a version is prepared, before it commits. Each failed stream
is reported (``failed``) with the servable flag and the model's digests it left.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
from aiosync.core.layout import TensorSpec
from aiosync.runtime import run
from tests.helpers.models import digest, mixed_weights


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class SlowSink(ModuleSink):
    """A module sink that reports each bucket and then works for ``delay`` seconds."""

    def __init__(
        self,
        model: dict[str, torch.Tensor],
        delay: float,
        staged: bool,
        die_in_commit: bool,
        swap: str = "copy",
    ) -> None:
        super().__init__(model, staged=staged, swap=swap)
        self.delay = delay
        self.die_in_commit = die_in_commit

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        emit("applying", names=[spec.name for spec in specs])
        super().apply_bucket(bucket, specs)
        time.sleep(self.delay)  # a slow engine, in the sink's worker thread

    def commit(self, version: int) -> None:
        if self.die_in_commit:  # prepared, then gone before committing
            os._exit(3)
        super().commit(version)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--extra", default=None)
    parser.add_argument("--staged", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--die-in-commit", action="store_true")
    parser.add_argument("--swap", default="copy", choices=["copy", "pointer"])
    args = parser.parse_args()
    model = {
        name: torch.zeros(t.shape, dtype=t.dtype, device=args.device)
        for name, t in mixed_weights().items()
    }
    if args.extra:
        model[args.extra] = torch.zeros(3)
    sink = SlowSink(model, args.delay, args.staged, args.die_in_commit, args.swap)

    def committed(version: int) -> None:
        emit("committed", version=version, digests={n: digest(t) for n, t in model.items()})

    async def serve() -> None:
        config = ReceiverConfig(stream_timeout=60, session_timeout=60)
        async with WeightReceiver(sink, config=config, on_commit=committed) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            seen = 0
            while True:  # report each failed stream with the state it left the model in
                await anyio.sleep(0.05)
                for failure in receiver.failures[seen:]:
                    digests = {n: digest(t) for n, t in model.items()}
                    emit("failed", version=failure.version, reason=failure.reason,
                         servable=receiver.servable, current=receiver.current_version,
                         digests=digests)  # fmt: skip
                seen = len(receiver.failures)

    run(serve)


if __name__ == "__main__":
    main()
