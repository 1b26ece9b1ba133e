"""Serving under a steady request load while new versions arrive (``aiosync bench --serving``).

One process holds a trainer (:class:`~aiosync.WeightSender`) and an engine
(:class:`~aiosync.WeightReceiver` on a :class:`~aiosync.ModuleSink`) on one event loop, as
the tests do; a fixed number of request workers take read leases back to back, each holding
its lease for a fixed time, while the trainer steps and sends versions. For each way of
making a version live (in place, staged copy, staged pointer; and staged pointer with the
commit acknowledged at staging) it reports:

* ``send_to_live_ms``: from the trainer calling ``send`` to the version being live in the
  engine (the receiver's own timestamp, ``swap_stats.last_live``), and ``send_ms``, when
  ``send`` returned;
* ``commit_step_ms``: inside the receiver, from the commit message to the version being
  live and acknowledged; ``swap_wait_ms``, the part of it spent waiting for read leases to
  be released; ``commit_less_wait_ms``, the rest (what making the version live adds to a
  sync); ``swap_ms``, the sink's commit alone, and ``swap_cpu_ms``, the CPU time of the
  thread that ran it (less than ``swap_ms`` when the machine's cores are busy elsewhere);
* ``longest_request_wait_ms``: the longest any request waited to start (for a lease, or,
  in place, for the stream to end: an in-place engine pauses serving during a sync), beside
  ``bucket_apply_ms``, the longest a bucket took to apply;
* ``extra_bytes`` and ``extra_ratio``: the staged copy the sink holds, over the model size.

A second, 300-tensor model (Llama shapes, 265 MiB) gives the commit step of copy against
pointer swap for the issue's 300-tensor target. Medians over the timed versions after one
warm-up. No test asserts any of these numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.layout import TensorSpec
from aiosync.engine.config import AckAt
from aiosync.engine.staging import Swap

POLL = 0.002  # seconds between looks at an in-place engine's stream (it has no lease gate)
GAP = 0.05  # seconds between versions: requests run with no sync in progress too


@dataclass(frozen=True)
class Mode:
    """One way of making a version live."""

    name: str
    staged: bool
    swap: Swap = "copy"
    ack_at: AckAt = "live"


MODES = (
    Mode("in place", staged=False),
    Mode("staged copy", staged=True, swap="copy"),
    Mode("staged pointer", staged=True, swap="pointer"),
    Mode("staged pointer, ack at staging", staged=True, swap="pointer", ack_at="staged"),
)


@dataclass(frozen=True)
class Load:
    """The request load and the stream's settings."""

    requests: int = 4  # request workers, each taking leases back to back
    request_s: float = 0.005  # how long each request holds its lease
    versions: int = 3  # timed versions, after one warm-up
    buffer_bytes: int = 128 << 20
    buffers: int = 2
    timeout: float = 120.0


class TimedSink(ModuleSink):
    """A :class:`ModuleSink` that keeps how long each bucket took to apply (commit untouched)."""

    applies: list[float]

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Apply and time one bucket."""
        started = time.perf_counter()
        super().apply_bucket(bucket, specs)
        self.applies.append(time.perf_counter() - started)


def llama_300() -> dict[str, torch.Tensor]:
    """300 fp32 tensors in Llama shapes (33 layers, hidden 384): 278,204,928 bytes."""
    hidden, kv, inter, vocab = 384, 96, 1024, 24000
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    per_layer = {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }
    for i in range(33):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _ms(values: list[float]) -> dict[str, float]:
    """Median and max of ``values`` (seconds) in milliseconds."""
    if not values:
        return {"median": 0.0, "max": 0.0}
    return {"median": statistics.median(values) * 1e3, "max": max(values) * 1e3}


async def run_mode(
    mode: Mode, make_weights: Callable[[], dict[str, torch.Tensor]], load: Load
) -> dict[str, Any]:
    """Stream ``load.versions`` + 1 versions under the request load; the figures of one mode."""
    trainer = make_weights()
    engine = {name: torch.zeros_like(t) for name, t in trainer.items()}
    model_bytes = sum(t.nbytes for t in trainer.values())
    sink = TimedSink(engine, staged=mode.staged, swap=mode.swap)
    sink.applies = []
    waits: list[float] = []
    sent: list[float] = []
    to_live: list[float] = []
    commits: list[float] = []
    swaps: list[float] = []
    swap_waits: list[float] = []
    swap_cpu: list[float] = []
    config = SenderConfig(
        buffer_bytes=load.buffer_bytes, num_buffers=load.buffers, timeout=load.timeout
    )
    receiver_config = ReceiverConfig(ack_at=mode.ack_at, swap_timeout=load.timeout / 4)

    def step() -> None:
        with torch.no_grad():
            for tensor in trainer.values():
                tensor.add_(1.0)

    async with (
        WeightReceiver(sink, config=receiver_config) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        stop = anyio.Event()

        async def request() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                if mode.staged:
                    async with receiver.serving():
                        waits.append(time.perf_counter() - started)
                        await anyio.sleep(load.request_s)
                else:  # an in-place engine pauses serving while a version streams
                    while receiver.streaming is not None or not receiver.servable:  # noqa: ASYNC110 (no event for a stream's end)
                        await anyio.sleep(POLL)
                    waits.append(time.perf_counter() - started)
                    await anyio.sleep(load.request_s)

        async with anyio.create_task_group() as tg:
            for _ in range(load.requests):
                tg.start_soon(request)
            for version in range(load.versions + 1):  # version 0 warms up
                if version:
                    await anyio.to_thread.run_sync(step)
                if version == 1:
                    waits.clear()
                    sink.applies.clear()
                started = time.perf_counter()
                await sender.send(trainer, version=version)
                returned = time.perf_counter()
                await receiver.wait_for_version(version, timeout=load.timeout)
                stats = receiver.swap_stats
                if version:
                    sent.append(returned - started)
                    to_live.append(stats.last_live - started)
                    commits.append(stats.last_commit)
                    swaps.append(stats.last_swap)
                    swap_waits.append(stats.last_wait)
                    swap_cpu.append(stats.last_swap_cpu)
                await anyio.sleep(GAP)
            stop.set()
        verified = all(torch.equal(engine[name], t) for name, t in trainer.items())
    return {
        "mode": mode.name,
        "staged": mode.staged,
        "swap": mode.swap if mode.staged else None,
        "ack_at": mode.ack_at,
        "tensors": len(trainer),
        "bytes": model_bytes,
        "versions": len(sent),
        "send_ms": _ms(sent),
        "send_to_live_ms": _ms(to_live),
        "commit_step_ms": _ms(commits),
        "swap_wait_ms": _ms(swap_waits),
        "commit_less_wait_ms": _ms([c - w for c, w in zip(commits, swap_waits, strict=True)]),
        "swap_ms": _ms(swaps),
        "swap_cpu_ms": _ms(swap_cpu),
        "requests": len(waits),
        "longest_request_wait_ms": max(waits, default=0.0) * 1e3,
        "bucket_apply_ms": _ms(sink.applies),
        "extra_bytes": sink.extra_bytes,
        "extra_ratio": sink.extra_bytes / model_bytes,
        "verified": verified,
    }


def measure(
    make_weights: Callable[[], dict[str, torch.Tensor]],
    load: Load,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Every mode on the main model, then copy against pointer on the 300-tensor model."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"requests": load.requests, "request_ms": load.request_s * 1e3}
    out["modes"] = []
    for mode in MODES:
        case = anyio.run(run_mode, mode, make_weights, load)
        out["modes"].append(case)
        say(describe(case))
    out["tensors_300"] = []
    for mode in MODES[1:3]:
        case = anyio.run(run_mode, mode, llama_300, load)
        out["tensors_300"].append(case)
        say(describe(case))
    return out


def describe(case: dict[str, Any]) -> str:
    """One line for stderr."""
    return (
        f"{case['mode']} ({case['tensors']} tensors, {case['bytes'] / 2**20:,.0f} MiB): "
        f"send to live {case['send_to_live_ms']['median']:.1f} ms, commit step "
        f"{case['commit_step_ms']['median']:.2f} ms ({case['swap_wait_ms']['median']:.2f} "
        f"waiting for leases, {case['commit_less_wait_ms']['median']:.2f} not; swap "
        f"{case['swap_ms']['median']:.2f}, {case['swap_cpu_ms']['median']:.2f} of CPU); "
        f"longest request wait {case['longest_request_wait_ms']:.1f} ms over "
        f"{case['requests']} requests (longest bucket apply "
        f"{case['bucket_apply_ms']['max']:.1f} ms); extra memory "
        f"{case['extra_ratio']:.2f}x the model; verified {case['verified']}"
    )
