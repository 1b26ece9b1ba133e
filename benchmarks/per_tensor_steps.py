"""Each per-tensor step of one version, timed alone: ``python -m benchmarks.per_tensor_steps``.

The trainer's steps (lay out, encode the ``begin``, pack, encode the buckets) and the
engine's (decode, open the stream, resolve the buckets, apply them to a ``ModuleSink``,
check the version whole) run one after the other in this process on the bench's model of
one-element tensors, each timed with ``time.thread_time`` (CPU seconds of this thread, so
other processes on the machine count less than in wall time). Prints microseconds per
tensor for the first version and the least of the later ones (the steady state, where the
sender's kept layout and the engine's remembered stream apply), one step a line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from aiosync.bench.model import small_state_dict
from aiosync.core.layout import MAX_BUCKET_ITEMS, pack_bucket
from aiosync.core.layout_memory import LayoutMemory
from aiosync.core.limits import Limits
from aiosync.core.stream_state import StreamMemory, open_stream
from aiosync.core.wire import Begin, Bucket, Complete, Slot, decode, encode
from aiosync.engine.sinks import ModuleSink

BUCKET_BYTES = 4 << 20  # one buffer per bucket here, so no bucket overwrites another


class _Steps:
    """The two sides' state across versions, and each step's times."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.weights = small_state_dict(count)
        self.model = {name: torch.zeros_like(t) for name, t in self.weights.items()}
        self.sink = ModuleSink(self.model)
        self.expectations = self.sink.expectations()
        self.layouts = LayoutMemory()
        self.remembered: StreamMemory | None = None
        self.times: dict[str, list[float]] = {}

    def timed(self, step: str, fn: Callable[[], Any]) -> Any:
        started = time.thread_time()
        out = fn()
        self.times.setdefault(step, []).append((time.thread_time() - started) / self.count * 1e6)
        return out

    def version(self, version: int) -> None:
        """One version: the trainer's steps, then the engine's."""
        timed, capacity = self.timed, 128 << 20
        with torch.no_grad():
            for tensor in self.weights.values():
                tensor.add_(1.0)
        layout = timed(
            "trainer: lay out",
            lambda: self.layouts.lay_out(
                self.weights.items(), capacity, MAX_BUCKET_ITEMS, dedupe=True
            ),
        )
        begin = timed("trainer: encode begin", lambda: encode(Begin(version, layout.manifest)))
        plans = list(layout.buckets(capacity))
        buffers = [torch.empty(BUCKET_BYTES, dtype=torch.uint8) for _ in plans]
        pairs = list(zip(buffers, plans, strict=True))

        def pack() -> None:
            for buffer, plan in pairs:
                pack_bucket(buffer, plan)

        timed("trainer: pack", pack)

        def buckets() -> list[bytes]:
            out = []
            for seq, plan in enumerate(plans, start=1):
                if plan.slots is None:
                    each = zip(plan.entries, plan.specs, strict=True)
                    plan.slots = [Slot(e, s.offset, s.nbytes, s.start) for e, s in each]
                out.append(encode(Bucket(version, seq, seq - 1, plan.used, slots=plan.slots)))
            return out

        messages = timed("trainer: slots and encoding", buckets)
        opened = timed("engine: decode begin", lambda: decode(begin))
        stream = timed(
            "engine: open the stream",
            lambda: open_stream(opened, self.expectations, Limits(), self.remembered),
        )
        decoded = timed("engine: decode buckets", lambda: [decode(m) for m in messages])
        sizes = [BUCKET_BYTES] * len(buffers)
        specs = timed("engine: resolve", lambda: [stream.resolve(b, sizes) for b in decoded])

        def apply() -> None:
            for bucket, resolved in zip(decoded, specs, strict=True):
                self.sink.apply_bucket(buffers[bucket.buffer][: bucket.used], resolved)

        timed("engine: apply", apply)
        stream.buckets = len(decoded)
        done = Complete(version, len(decoded) + 1, len(decoded), self.count)
        timed("engine: check whole", lambda: stream.check_whole(done))
        self.sink.commit(version)
        self.remembered = stream.memory() or self.remembered


def measure(count: int, versions: int) -> dict[str, tuple[float, float]]:
    """Step -> (first version, least of the later ones), in µs of CPU per tensor."""
    torch.set_num_threads(1)
    steps = _Steps(count)
    for version in range(versions):
        steps.version(version)
    if not all(torch.equal(steps.model[n], t) for n, t in steps.weights.items()):
        raise AssertionError("the engine's tensors differ from the trainer's")
    return {step: (values[0], min(values[1:] or values)) for step, values in steps.times.items()}


def main() -> None:
    """Print each step's µs per tensor (first version, then the steady state)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()
    totals = {"trainer": [0.0, 0.0], "engine": [0.0, 0.0]}
    for step, (first, steady) in measure(args.tensors, args.versions).items():
        print(f"{step:30s} {steady:6.2f} µs per tensor (first version {first:.2f})")
        sums = totals[step.split(":")[0]]
        sums[0] += first
        sums[1] += steady
    for name, (first, steady) in totals.items():
        print(f"{name + ' in all':30s} {steady:6.2f} µs per tensor (first version {first:.2f})")


if __name__ == "__main__":
    main()
