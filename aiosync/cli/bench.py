"""``aiosync bench``: the stream against the physical floor and the simple ways, in one run.

Cases, each a trainer process and engine processes on this machine:
- one engine, the Llama-shaped model: GB/s and the ratio to a single-threaded memcpy (CPU)
  or a device copy (GPU) measured in the same run;
- ``--engines N``: the same model to N engines at once, and its time over the one-engine time;
- ``--per-tensor N``: N one-element tensors, in microseconds per tensor.
- ``--device cuda`` (or ``cuda:0``), unless ``--skip-baselines``: the CUDA cases of
  :mod:`aiosync.bench.cuda_cases` (the NeMo-RL drop-in, a lock-step baseline, the one- and
  two-copy floors, with the default allocator and with expandable segments).
Every case reports the longest event-loop stall on each side (a 1 ms heartbeat's longest gap).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from aiosync.cli.checks import CommandError, MiB
from aiosync.cli.spawn import run_stream


def _case(args: argparse.Namespace, *, engines: int, tensors: int, show: bool) -> dict[str, Any]:
    """Stream ``args.repeats`` timed versions after one warm-up; medians of the timed ones."""
    run = copy.copy(args)
    run.versions = args.repeats + 1  # the first version warms up buffers and page tables
    run.tensors = tensors
    result = run_stream(run, verify=False, show=show, engines=engines)
    if result["trainer_rc"] or result["engine_rc"] or len(result["synced"]) != run.versions:
        raise CommandError(f"the stream to {engines} engine(s) failed")
    timed = result["synced"][1:]
    engine_side = [each for version in result["committed"][1:] for each in version]
    seconds = statistics.median(s["seconds"] for s in timed)
    return {
        "engines": engines,
        "tensors": timed[0]["tensors"],
        "bytes": timed[0]["bytes"],
        "seconds": seconds,
        "GBps": timed[0]["bytes"] / seconds / 1e9,
        "engine_seconds": statistics.median(c["engine_seconds"] for c in engine_side),
        "trainer_stall_ms": max(s["stall_ms"] for s in timed),
        "engine_stall_ms": max(c["stall_ms"] for c in engine_side),
    }


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark; prints every figure (as JSON on the last line with ``--json``)."""
    from aiosync.bench import baselines, floors, model

    show = not args.quiet

    def say(text: str) -> None:
        if show:
            print(text, file=sys.stderr)

    nbytes_target = args.size_mb * MiB
    device = args.device
    if args.serving:
        return _serving(args, say)
    memcpy = floors.measure_memcpy(min(nbytes_target, 1 << 30))
    say(f"memcpy (1 thread): {memcpy:.2f} GB/s")
    out: dict[str, Any] = {
        "device": device,
        "buffers": args.buffers,
        "buffer_mb": args.buffer_mb,
        "memcpy_GBps": memcpy,
    }
    floor = memcpy
    if device.startswith("cuda"):
        floor = out["gpu_copy_GBps"] = floors.measure_device_copy(nbytes_target, device)
        say(f"GPU copy on {device}: {floor:.1f} GB/s")
    one = _case(args, engines=1, tensors=0, show=show)
    one["ratio_to_floor"] = floor / one["GBps"]
    out["one_engine"] = one
    out.update({k: one[k] for k in ("bytes", "seconds", "GBps", "engine_seconds")})
    out["trainer_seconds"] = one["seconds"]
    out["ratio_to_memcpy"] = memcpy / one["GBps"]
    say(_line(f"aiosync, 1 engine ({device})", one))
    if args.engines > 1:
        many = _case(args, engines=args.engines, tensors=0, show=show)
        many["ratio_to_floor"] = floor / many["GBps"]
        many["ratio_to_one_engine"] = many["seconds"] / one["seconds"]
        out["many_engines"] = many
        say(_line(f"aiosync, {args.engines} engines", many))
    if args.per_tensor:
        small = _case(args, engines=1, tensors=args.per_tensor, show=False)
        small["us_per_tensor"] = small["seconds"] / small["tensors"] * 1e6
        out["per_tensor"] = small
        say(
            f"aiosync, {small['tensors']} tensors of 4 bytes: {small['us_per_tensor']:.1f} us "
            f"per tensor; longest stall {small['trainer_stall_ms']:.1f} ms (trainer), "
            f"{small['engine_stall_ms']:.1f} ms (engine)"
        )
    if device in ("cuda", "cuda:0") and not args.skip_baselines:  # drop-in, lock-step
        from aiosync.bench import cuda_cases

        out["cuda_cases"] = cuda_cases.measure(args.size_mb, args.buffer_mb, args.repeats, say)
    if not args.skip_baselines:
        state = model.synthetic_state_dict(nbytes_target)
        out["torch_save_zmq"] = baselines.measure_torch_save_zmq(state, repeats=args.repeats)
        out["safetensors_shm"] = baselines.measure_safetensors_shm(state, repeats=args.repeats)
        del state
        for key in ("torch_save_zmq", "safetensors_shm"):
            say(f"{key}: {out[key]['GBps']:.2f} GB/s")
    if args.json:
        print(json.dumps(out))
    return 0


def _line(label: str, case: dict[str, Any]) -> str:
    return (
        f"{label}: {case['GBps']:.2f} GB/s ({case['ratio_to_floor']:.2f}x the floor); longest "
        f"stall {case['trainer_stall_ms']:.1f} ms (trainer), {case['engine_stall_ms']:.1f} ms "
        "(engine)"
    )


def _serving(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """``--serving``: the request-load benchmark of :mod:`aiosync.bench.serving` (CPU)."""
    from aiosync.bench import model, serving

    if args.device != "cpu":
        raise CommandError("--serving runs on the CPU only (--device cpu)")
    load = serving.Load(
        requests=args.requests,
        request_s=args.request_ms / 1e3,
        versions=args.repeats,
        buffer_bytes=int(args.buffer_mb * MiB),
        buffers=args.buffers,
        timeout=args.timeout,
    )
    out = serving.measure(lambda: model.synthetic_state_dict(args.size_mb * MiB), load, say)
    if not all(case["verified"] for case in out["modes"] + out["tensors_300"]):
        raise CommandError("the engine's weights differ from the trainer's")
    if args.json:
        print(json.dumps(out))
    return 0
