"""An engine process for the collective tests:
``python -m tests.helpers.collective_engine [options]``.

A plain :class:`aiosync.WeightReceiver` over ``mixed_weights`` shapes (zeros at start); the
trainer's hello makes it join the broadcast group. Prints JSON lines: ``ready`` (endpoint),
``applying`` (version, after each bucket arrived), ``committed`` (version, digests) and
``failed`` (version, reason, the current version and the model's digests).
``--slow-version V --delay S``: after the first bucket of version V (the V+1-th), work S
seconds (the window in which a test kills or freezes a peer mid-broadcast).
``--refuse-version V``: the sink fails bucket 2 of version V (once): the engine refuses it.
The sink is staged, so a failed version leaves the model as it was.
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
from aiosync.core.layout import TensorSpec
from aiosync.runtime import run
from tests.helpers.fleet_engine import emit
from tests.helpers.models import digest, mixed_weights


class PacedSink(ModuleSink):
    """A staged sink that reports each bucket; slow once, in the version after ``slow`` commits.

    (Versions in these tests are 0, 1, 2...: the one being applied is the commit count.)
    """

    def __init__(
        self, model: dict[str, torch.Tensor], slow: int, delay: float, refuse: int = -1
    ) -> None:
        super().__init__(model, staged=True)
        self.slow, self.delay, self.refuse = slow, delay, refuse
        self.commits = self.buckets = 0
        self.slowed = self.refused = False

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.buckets += 1
        if self.commits == self.refuse and self.buckets == 2 and not self.refused:
            self.refused = True
            raise RuntimeError("bucket 2 refused on purpose")
        super().apply_bucket(bucket, specs)
        emit("applying", version=self.commits, names=[spec.name for spec in specs])
        if self.commits == self.slow and not self.slowed:  # once: a retry goes at full speed
            self.slowed = True
            time.sleep(self.delay)

    def commit(self, version: int) -> None:
        super().commit(version)
        self.commits += 1
        self.buckets = 0

    def abort(self) -> None:
        super().abort()
        self.buckets = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-version", type=int, default=-1)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--refuse-version", type=int, default=-1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    model = {
        name: torch.zeros(t.shape, dtype=t.dtype, device=args.device)
        for name, t in mixed_weights().items()
    }
    sink = PacedSink(model, args.slow_version, args.delay, args.refuse_version)

    def digests() -> dict[str, str]:
        return {n: digest(t) for n, t in model.items()}

    def committed(version: int) -> None:
        emit("committed", version=version, digests=digests())

    async def serve() -> None:
        config = ReceiverConfig(stream_timeout=args.timeout, session_timeout=60)
        async with WeightReceiver(sink, config=config, on_commit=committed) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            seen = 0
            while True:
                await anyio.sleep(0.05)
                for failure in receiver.failures[seen:]:
                    emit("failed", version=failure.version, reason=failure.reason,
                         current=receiver.current_version, digests=digests())  # fmt: skip
                seen = len(receiver.failures)

    run(serve)


if __name__ == "__main__":
    main()
