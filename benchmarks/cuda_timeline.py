"""Where a version's time goes on one GPU: ``python -m benchmarks.cuda_timeline``.

An engine process (``engine`` role) holds a zeroed copy of a Llama-shaped model (bf16
Llama-3-8B shapes on CUDA, or ``--hidden`` scaled-down ones); this process streams the
model to it with :class:`~aiosync.WeightSender` for each ``--variants`` entry (``NxMB``:
N buffers of MB MiB), ``--repeats`` timed versions after a warm-up each, reporting the
median and the trainer loop's longest stall; a variant ending in ``i`` packs and applies
on the event loops, one ending in ``o`` copies one ``copy_`` a tensor as before the
by-address copies, one in ``s`` queues them on one stream, not two, and one in ``g`` spreads
them without gates (:mod:`benchmarks.timeline_switches`); ``d`` sends in direct mode
(the engine copies out of this process's tensors, each its own region: an allocation on
CUDA, a shared segment on the CPU) and ``f`` in direct mode out of one region (the
tensors as views of one allocation or segment); ``e`` sends each ``begin`` after the read,
not before it (:mod:`aiosync.pipeline.early_begin`), and ``b`` bucket 1 after the read,
not with that begin; ``q`` applies every bucket in the engine's worker thread
(:mod:`aiosync.engine.quick_apply`). It then streams ``--traced`` more versions of
the first variant with :mod:`benchmarks.timeline_hooks` in both processes and prints,
per bucket, when each step happened (host marks and GPU spans, ms from the send's start).
On CUDA the same run measures the floors (one flat device copy; every tensor into
buffers and back) and a plain event-chained pack/apply between the two processes with one
line a bucket over a pipe (``probe``): what the design reaches without aiosync's host work.
``--gap-ms`` idles that long before each version (outside the times), as a training step
would: without it, each version starts as the engine finishes the last one's commit.
The engine's model is checked against the trainer's at the end. Prints JSON last.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout
from benchmarks import timeline_hooks, timeline_switches, timeline_view

MiB = 1 << 20


def build(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """The model: Llama-3-8B shapes, or ``--hidden`` wide ones, in bf16 on ``--device``."""
    dims = (
        LLAMA3_8B
        if not args.hidden
        else (args.hidden, args.hidden // 4, 3 * args.hidden, 8 * args.hidden, LLAMA3_8B[4])
    )
    gen = torch.Generator(device=args.device)
    gen.manual_seed(seed)
    out = {}
    for name, shape in llama_layout(*dims):
        t = torch.empty(shape, dtype=torch.bfloat16, device=args.device)
        if seed:
            t.normal_(0.0, 0.02, generator=gen)
        else:
            t.zero_()
        out[name] = t
    return out


def _say(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def engine(args: argparse.Namespace) -> None:
    """Serve the model; obey the trainer's one-line commands on stdin."""
    from aiosync import ModuleSink, WeightReceiver
    from aiosync.bench.cuda_dropin import model_digest
    from aiosync.runtime import run

    model = build(args, 0)
    sink = ModuleSink(model)
    rec = timeline_hooks.Recorder(args.device.startswith("cuda"))
    timeline_hooks.engine_hooks(rec, sink)
    from aiosync.engine import receiver as receiver_module

    inline = timeline_switches.inline_switch(receiver_module)
    mode = timeline_switches.old_copies_switch()

    async def serve() -> None:
        from aiosync.core import where_to_run

        inline_apply = where_to_run.LOOP_SECONDS
        async with WeightReceiver(sink) as receiver:
            quick = receiver._quick.quick
            _say({"endpoint": receiver.endpoint})
            while True:
                words = (await anyio.to_thread.run_sync(sys.stdin.readline)).split()
                if not words or words[0] == "digest":
                    copies = getattr(sink._programs, "_copies", {})
                    batches = {k: dict(c.batches) for k, c in copies.items()}
                    _say({"digest": model_digest(model), "batches": batches})
                    return
                if words[0] == "start":
                    rec.start()
                    _say({"started": True})
                elif words[0] == "mode":  # i: apply on the loop; o, s, g: the old copies
                    mode.clear()
                    mode.update(words[1:])
                    inline.clear()
                    inline.update(["_apply"] if "i" in mode else [])
                    never = "q" in mode  # every apply in a worker thread, as before
                    where_to_run.LOOP_SECONDS = 1e-3 if "l" in mode else inline_apply
                    receiver._quick.quick = (lambda _: False) if never else quick  # type: ignore[method-assign,assignment]
                    _say({"mode": sorted(mode)})
                elif words[0] == "dump":
                    _say({"marks": rec.dump()})
                elif words[0] == "probe":
                    await anyio.to_thread.run_sync(_probe_engine, model, json.loads(words[1]))

    run(serve)


def _probe_engine(model: dict[str, torch.Tensor], spec: dict[str, Any]) -> None:
    """The probe's engine: per line ``k i``, wait on packed[i], copy bucket k, record, reply.

    With ``signals`` in ``spec``: per line ``k i n``, the stream waits until the trainer's
    counter reaches ``n + 1``, copies, then sets its own counter to ``n + 1``.
    """
    from aiosync.core.layout import plan_buckets, tensor_bytes
    from aiosync.planes.cuda import new_event, open_event
    from aiosync.planes.cuda_counters import wait_value, write_value
    from aiosync.planes.cuda_runtime import DeviceMemory

    size = spec["size"]
    buffers = [DeviceMemory.open(bytes.fromhex(h), size, 0) for h in spec["handles"]]
    packed = [open_event(0, bytes.fromhex(h)) for h in spec["events"]]
    made = [new_event(0) for _ in buffers]
    applied = [event for event, _ in made]
    signals = None
    if "signals" in spec:
        signals = DeviceMemory.open(bytes.fromhex(spec["signals"]), 4096, 0)
    plans = [plan.specs for plan in plan_buckets(model.items(), size)]
    views = {name: tensor_bytes(t) for name, t in model.items()}
    stream = torch.cuda.current_stream()
    _say({"events": [handle.hex() for _, handle in made]})
    while (line := sys.stdin.readline().strip()) != "close":
        if line == "end":
            torch.cuda.synchronize()
            _say({"done": True})
            continue
        k, i, *count = (int(word) for word in line.split())
        if signals is not None:
            wait_value(stream.cuda_stream, signals.tensor.data_ptr(), count[0] + 1)
        else:
            stream.wait_event(packed[i])
        source = buffers[i].tensor
        for s in plans[k]:
            views[s.name][s.start : s.start + s.nbytes].copy_(
                source[s.offset : s.offset + s.nbytes]
            )
        if signals is not None:
            write_value(stream.cuda_stream, signals.tensor.data_ptr() + 256, count[0] + 1)
        else:
            applied[i].record(stream)
        print(k, flush=True)
    torch.cuda.synchronize()
    for buffer in [*buffers, *([signals] if signals is not None else [])]:
        buffer.close()
    _say({"closed": True})


def _probe(
    model: dict[str, torch.Tensor],
    proc: subprocess.Popen[str],
    count: int,
    size: int,
    repeats: int,
    signals: bool = False,
    alternate: bool = False,
) -> list[float]:
    """A plain event-chained stream through ``count`` buffers; its time per version.

    ``signals``: chained by counters in device memory instead
    (:mod:`aiosync.planes.cuda_counters`): the trainer queues every pack at once, each
    behind a wait for the engine's counter, and reads the engine's lines only at the end;
    ``alternate`` (with ``signals``): each pack waits for the engine's last apply, not for
    the one that last used its buffer, so the two processes never have work ready at once.
    """
    from aiosync.bench.cuda_dropin import timed
    from aiosync.core.layout import pack_bucket, plan_buckets
    from aiosync.planes.cuda import new_event, open_event
    from aiosync.planes.cuda_counters import wait_value, write_value
    from aiosync.planes.cuda_runtime import DeviceMemory

    assert proc.stdin is not None
    assert proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    buffers = [DeviceMemory.allocate(size, 0) for _ in range(count)]
    made = [new_event(0) for _ in buffers]
    packed = [event for event, _ in made]
    spec: dict[str, Any] = {"size": size, "handles": [b.handle.hex() for b in buffers]}
    spec["events"] = [handle.hex() for _, handle in made]
    counters = DeviceMemory.allocate(4096, 0) if signals else None
    if counters is not None:
        counters.tensor.zero_()
        torch.cuda.synchronize()
        spec["signals"] = counters.handle.hex()
    stdin.write("probe " + json.dumps(spec).replace(" ", "") + "\n")
    stdin.flush()
    applied = [open_event(0, bytes.fromhex(h)) for h in json.loads(stdout.readline())["events"]]
    plans = list(plan_buckets(model.items(), size))
    stream = torch.cuda.current_stream()
    done = [0]  # buckets packed so far, over all versions: the counters' values

    def one_version() -> None:
        for k, plan in enumerate(plans):
            i = k % count
            n = done[0] + k
            if counters is not None:
                after = n if alternate else n - count + 1  # applies done before this pack
                if after > 0:
                    wait_value(stream.cuda_stream, counters.tensor.data_ptr() + 256, after)
            elif k >= count:
                int(stdout.readline())  # bucket k - count applied: its event is recorded
                stream.wait_event(applied[i])
            pack_bucket(buffers[i].tensor, plan)
            if counters is not None:
                write_value(stream.cuda_stream, counters.tensor.data_ptr(), n + 1)
                stdin.write(f"{k} {i} {n}\n")
            else:
                packed[i].record(stream)
                stdin.write(f"{k} {i}\n")
            stdin.flush()
        done[0] += len(plans)
        stdin.write("end\n")
        stdin.flush()
        for _ in range(len(plans) if counters is not None else min(count, len(plans))):
            int(stdout.readline())
        json.loads(stdout.readline())

    times = timed(one_version, repeats)
    stdin.write("close\n")
    stdin.flush()
    json.loads(stdout.readline())  # the engine unmapped the buffers
    torch.cuda.synchronize()
    for buffer in [*buffers, *([counters] if counters is not None else [])]:
        buffer.close()
    return times


async def _native(
    model: dict[str, torch.Tensor],
    endpoint: str,
    args: argparse.Namespace,
    variant: str,
    versions: int,
    before: Any = None,
    source: dict[str, torch.Tensor] | None = None,
) -> tuple[list[float], float]:
    """``versions`` sends through ``variant``'s buffers: each one's seconds, longest stall.

    ``source``: tensors to send in direct mode instead of ``model`` (see :func:`direct_source`).
    """
    from aiosync import SenderConfig, WeightSender

    count, mb = (int(x) for x in variant.split("x"))
    direct = source is not None
    config = SenderConfig(buffer_bytes=mb * MiB, num_buffers=count, timeout=30.0, direct=direct)
    sent = model if source is None else source
    times: list[float] = []
    stall = 0.0
    cuda = args.device.startswith("cuda")
    async with WeightSender(endpoint, device=args.device, config=config) as sender:
        for n in range(versions):
            await anyio.sleep(args.gap_ms / 1000)  # a training step's time, not measured
            if cuda:
                torch.cuda.synchronize()
            if before is not None and n == versions - args.traced:
                await anyio.to_thread.run_sync(before)
            done = anyio.Event()

            async def beat(done: anyio.Event = done) -> float:
                last, worst = time.perf_counter(), 0.0
                while not done.is_set():
                    await anyio.sleep(0.001)
                    now = time.perf_counter()
                    worst, last = max(worst, now - last), now
                return worst

            async with anyio.create_task_group() as tg:
                result: list[float] = []

                async def watch(result: list[float] = result) -> None:
                    result.append(await beat())

                tg.start_soon(watch)
                start = time.perf_counter()
                await sender.send(sent)
                times.append(time.perf_counter() - start)
                done.set()
            stall = max(stall, result[0] if n else 0.0)
    return times, stall


def _variant(variant: str) -> tuple[str, list[str]]:
    """``NxMB`` and its flags.

    ``i`` packs and applies on the event loops (no thread hop); ``o`` copies as before
    by-address queuing (one ``copy_`` a tensor on both sides); ``s`` queues those on one
    stream, ``g`` spreads them without gates; ``d`` / ``f``: direct mode, one region a
    tensor / one region in all; ``w`` puts up to 1024 regions in a direct bucket, not 64;
    ``t`` reads a direct version in a worker thread, never on the loop; ``n`` queues every
    batch of copies copy by copy (no CUDA graphs); ``e`` sends each ``begin`` after the read
    (no early begin); ``b`` sends bucket 1 after the read, not with the begin;
    ``q`` has the engine apply every bucket in a worker thread (no quick applies), ``l``
    inline up to 1 ms of host work, not 0.5; ``p`` sends an early direct bucket 1 in a
    message of its own after the begin (as when the two are too large together), not inside it.
    """
    shape = variant.rstrip("iodfsgwtnebqlp")
    return shape, sorted(set(variant[len(shape) :]))


def trainer(args: argparse.Namespace) -> None:
    """Start the engine, run every variant, the traced versions and the probe; print JSON."""
    from aiosync.bench.cuda_dropin import copy_floors, model_digest
    from aiosync.runtime import child_env, run

    cuda = args.device.startswith("cuda")
    model = build(args, 1)
    argv = [sys.executable, "-m", "benchmarks.cuda_timeline", "engine"]
    argv += ["--device", args.device, "--hidden", str(args.hidden)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def command(line: str) -> dict[str, Any]:
        stdin.write(line + "\n")
        stdin.flush()
        answer: dict[str, Any] = json.loads(stdout.readline())
        return answer

    rec = timeline_hooks.Recorder(cuda)
    mode = timeline_switches.old_copies_switch()
    timeline_hooks.trainer_hooks(rec)
    from aiosync.pipeline import fanout

    inline = timeline_switches.inline_switch(fanout)
    out: dict[str, Any] = {"bytes": sum(t.nbytes for t in model.values()), "tensors": len(model)}
    sources: dict[str, dict[str, torch.Tensor]] = {}
    try:
        endpoint = json.loads(stdout.readline())["endpoint"]
        variants = args.variants.split(",")
        if cuda:
            out.update(copy_floors(model, int(_variant(variants[0])[0].split("x")[1]) * MiB))
        for variant in variants:
            shape, flags = _variant(variant)
            inline.clear()
            inline.update(["_pack_next"] if "i" in flags else [])
            mode.clear()
            mode.update(flags)
            command("mode " + " ".join(flags))
            source = timeline_switches.direct_for(model, flags, sources)
            timeline_switches.trainer_switches(flags)
            times, stall = run(
                functools.partial(
                    _native, model, endpoint, args, shape, args.repeats + 1, None, source
                )
            )
            out[variant] = {
                "median_s": statistics.median(times[1:]),
                "times_s": times[1:],
                "stall_ms": stall * 1e3,
            }
            print(
                f"{variant}: {out[variant]['median_s'] * 1e3:.2f} ms (stall "
                f"{stall * 1e3:.2f} ms) {[round(t * 1e3, 2) for t in times]}",
                flush=True,
            )

        def start() -> None:
            command("start")
            rec.start()

        inline.clear()
        mode.clear()
        command("mode")
        total = 1 + args.traced
        shape, flags = _variant(variants[0])
        traced = timeline_switches.direct_for(model, flags, sources)
        timeline_switches.trainer_switches(flags)
        run(lambda: _native(model, endpoint, args, shape, total, start, traced))
        trainer_marks = rec.dump()
        engine_marks = command("dump")["marks"]
        out["traced"] = []
        for version in sorted({m[2] for m in trainer_marks}):
            view = timeline_view.timeline(trainer_marks, [tuple(m) for m in engine_marks], version)
            print(f"--- traced version {version} ({variants[0]})")
            print(timeline_view.render(view), flush=True)
            out["traced"].append(view)
        if args.out:
            marks = {"trainer": trainer_marks, "engine": engine_marks}
            Path(args.out, "timeline_marks.json").write_text(json.dumps(marks))
        for probe in args.probe.split(",") if cuda and args.probe else []:
            count, mb = (int(x) for x in probe.rstrip("sa").split("x"))
            flags = probe[len(probe.rstrip("sa")) :]
            times = _probe(model, proc, count, mb * MiB, args.repeats, "s" in flags, "a" in flags)
            out["probe " + probe] = {"median_s": statistics.median(times), "times_s": times}
            print(f"probe {probe}: {[round(t * 1e3, 2) for t in times]}", flush=True)
        digest = command("digest")
        out["bit_exact"] = digest["digest"] == model_digest(model)
        out["engine_batches"] = digest.get("batches", {})  # how its copies were queued
        if cuda:
            two = out["two_copies_s"]
            for variant in variants:
                out[variant]["over_two_copies"] = out[variant]["median_s"] / two
        print(json.dumps(out), flush=True)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def main() -> None:
    """Parse the command line and run one role (``trainer`` starts the engine itself)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["trainer", "engine"], nargs="?", default="trainer")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hidden", type=int, default=0, help="0: Llama-3-8B's shapes")
    parser.add_argument(
        "--variants",
        default="2x1024,2x1024o,2x1024i,4x1024,2x2048",
        help="NxMB each; a trailing i packs and applies on the event loops (no thread "
        "hop), o copies one copy_ a tensor (as before by-address queuing), d sends direct "
        "(a region a tensor), f direct out of one region, w up to 1024 regions a direct "
        "bucket, t direct versions read in a thread, n no CUDA graphs of copies",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--traced", type=int, default=2)
    parser.add_argument("--probe", default="2x1024,2x2048", help="NxMB list, empty: none")
    parser.add_argument("--out", default="", help="a folder for the raw marks (JSON)")
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time before each version (a step)"
    )
    args = parser.parse_args()
    engine(args) if args.role == "engine" else trainer(args)


if __name__ == "__main__":
    main()
