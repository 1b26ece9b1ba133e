"""``aiosync bench``: the stream's throughput against memcpy and the simple ways."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from aiosync.cli.args import MiB
from aiosync.cli.spawn import run_stream


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark; prints every figure (as JSON on the last line with ``--json``)."""
    from aiosync.bench import baselines, floors, model

    show = not args.quiet
    nbytes_target = args.size_mb * MiB
    device = args.device
    memcpy = floors.measure_memcpy(min(nbytes_target, 1 << 30))
    if show:
        print(f"memcpy (1 thread): {memcpy:.2f} GB/s", file=sys.stderr)
    gpu_copy = None
    if device.startswith("cuda"):
        gpu_copy = floors.measure_device_copy(nbytes_target, device)
        if show:
            print(f"GPU copy on {device}: {gpu_copy:.1f} GB/s", file=sys.stderr)
    args.versions = args.repeats + 1  # the first version warms up buffers and page tables
    result = run_stream(args, verify=False, show=show)
    if result["trainer_rc"] or result["engine_rc"] or len(result["synced"]) != args.versions:
        print("aiosync bench: the stream failed", file=sys.stderr)
        return 1
    timed = result["synced"][1:]
    seconds = statistics.median(s["seconds"] for s in timed)
    nbytes = timed[0]["bytes"]
    engine = statistics.median(c["engine_seconds"] for c in result["committed"][1:])
    out: dict[str, Any] = {
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9,
        "memcpy_GBps": memcpy,
        "ratio_to_memcpy": memcpy / (nbytes / seconds / 1e9),
        "trainer_seconds": seconds,
        "engine_seconds": engine,
        "device": device,
        "buffers": args.buffers,
        "buffer_mb": args.buffer_mb,
    }
    if gpu_copy is not None:
        out["gpu_copy_GBps"] = gpu_copy
        out["ratio_to_gpu_copy"] = gpu_copy / out["GBps"]
    if not args.skip_baselines:
        state = model.synthetic_state_dict(nbytes_target)
        out["torch_save_zmq"] = baselines.measure_torch_save_zmq(state, repeats=args.repeats)
        out["safetensors_shm"] = baselines.measure_safetensors_shm(state, repeats=args.repeats)
        del state
    if show:
        print(f"aiosync shm stream: {out['GBps']:.2f} GB/s", file=sys.stderr)
        for key in ("torch_save_zmq", "safetensors_shm"):
            if key in out:
                print(f"{key}: {out[key]['GBps']:.2f} GB/s", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0
