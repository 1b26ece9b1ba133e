"""What ``SenderConfig(check_snapshot=True)`` costs, measured on and off in one run.

    python benchmarks/snapshot_check.py --device cpu --tensors 100000     # 100,000 CPU tensors
    python benchmarks/snapshot_check.py --device cuda:0 --size-mb 16384   # packed and direct

An engine process holds the model; this process streams it with :class:`~aiosync.WeightSender`,
alternating the check off and on (``--rounds`` times each, after a warm-up of each), so both
see the same machine state. On CUDA it does so in packed mode and in direct mode. Prints one
JSON object: every time, the medians, and each mode's ratio on/off. The engine's model is
checked bit-exact against the trainer's at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio
import torch

MiB = 1 << 20


def model_of(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """The streamed model: ``--tensors`` one-element tensors, else Llama shapes in bf16."""
    from aiosync.bench.model import small_state_dict, synthetic_state_dict

    if args.tensors:
        tensors = small_state_dict(args.tensors, args.device)
        return {n: t.fill_(seed) for n, t in tensors.items()}
    return synthetic_state_dict(args.size_mb * MiB, torch.bfloat16, seed, args.device)


def digest(model: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor's bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(model):
        h.update(name.encode())
        h.update(model[name].detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine(args: argparse.Namespace) -> None:
    """Serve a zeroed model; print the endpoint; print its digest when stdin says so."""
    from aiosync import ModuleSink, WeightReceiver
    from aiosync.runtime import run

    model = {n: torch.zeros_like(t) for n, t in model_of(args, 0).items()}

    async def serve() -> None:
        async with WeightReceiver(ModuleSink(model)) as receiver:
            print(json.dumps({"endpoint": receiver.endpoint}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            print(json.dumps({"digest": digest(model)}), flush=True)

    run(serve)


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate the check off and on per mode; return every figure."""
    from aiosync import SenderConfig, WeightSender
    from aiosync.runtime import child_env, run

    plain = model_of(args, 1)
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in plain.items()}
    options = [a for a in sys.argv[1:] if a != "trainer"]
    cmd = [sys.executable, __file__, "engine", *options]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    modes = ["packed", "direct"] if plain[next(iter(plain))].is_cuda else ["packed"]
    out: dict[str, Any] = {
        "device": args.device,
        "tensors": len(plain),
        "bytes": sum(t.nbytes for t in plain.values()),
        "rounds": args.rounds,
    }
    try:
        endpoint = json.loads(proc.stdout.readline())["endpoint"]

        versions = iter(range(1 << 30))

        async def one(sender: WeightSender) -> float:
            if plain[next(iter(plain))].is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            await sender.send(params, version=next(versions))
            return time.perf_counter() - start

        async def measure() -> None:
            for mode in modes:
                configs = {
                    check: SenderConfig(
                        buffer_bytes=args.buffer_mb * MiB,
                        num_buffers=2,
                        direct=mode == "direct",
                        check_snapshot=check,
                        timeout=300,
                    )
                    for check in (False, True)
                }
                times: dict[bool, list[float]] = {False: [], True: []}
                # one sender a setting, opened once; versions alternate between them
                async with (
                    WeightSender(endpoint, device=args.device, config=configs[False]) as off,
                    WeightSender(endpoint, device=args.device, config=configs[True]) as on,
                ):
                    await one(off)  # warm-ups
                    await one(on)
                    for _ in range(args.rounds):
                        times[False].append(await one(off))
                        times[True].append(await one(on))
                for check, label in ((False, "off"), (True, "on")):
                    out[f"{mode}_check_{label}_s"] = times[check]
                    out[f"{mode}_check_{label}_median_s"] = statistics.median(times[check])
                out[f"{mode}_on_over_off"] = (
                    out[f"{mode}_check_on_median_s"] / out[f"{mode}_check_off_median_s"]
                )

        run(measure)
        proc.stdin.write("digest\n")
        proc.stdin.flush()
        out["bit_exact"] = json.loads(proc.stdout.readline())["digest"] == digest(plain)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return out


def main() -> None:
    """Parse the options; run the trainer (default) or the engine role."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["trainer", "engine"], nargs="?", default="trainer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensors", type=int, default=0, help="one-element tensors (0: Llama)")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--buffer-mb", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.role == "engine":
        engine(args)
    else:
        print(json.dumps(trainer(args)), flush=True)


if __name__ == "__main__":
    main()
