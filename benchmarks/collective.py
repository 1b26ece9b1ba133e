"""Broadcast to an engine on another GPU, against a raw NCCL broadcast of the same bytes.

Run as ``python -m benchmarks.collective`` on a host with two GPUs. This process is the
trainer on GPU 0 with Llama-3-8B's 291 tensors in bf16 (16.06 GB); an engine process (an
ordinary :class:`~aiosync.WeightReceiver` with a :class:`~aiosync.ModuleSink`) holds the
same shapes on GPU 1. In one run, each ``--repeats`` times after a warm-up:

- ``raw``: the same bytes as one flat tensor, broadcast in 1 GiB messages over NCCL (the
  floor);
- ``flat``: :class:`~aiosync.trainer.collective.CollectiveSender`, one broadcast per packed
  bucket of ``--buffer-mb`` (``flat_overlap``, once a mode of its own, is now the same);
- ``per_tensor``: the same sender, one broadcast per tensor;
- ``ipc``: :class:`~aiosync.WeightSender` through its CUDA IPC plane (the engine copies out
  of the trainer's buffers across NVLink).

Every pipeline time is ``await sender.send(...)`` end to end (manifest, buckets, acks,
two-phase commit). After each mode the engine compares every tensor, bit for bit, with a
raw broadcast of the trainer's tensor. Prints one JSON object (medians in ms, ratios to
``raw``, ``bit_exact`` per mode); a mode that fails reports its error, the others still run.
``--traced N`` then streams N more ``flat`` versions with both processes' marks
(:mod:`benchmarks.collective_hooks`) and prints each one's timeline to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist

from aiosync.bench.model import LLAMA3_8B, llama_layout
from aiosync.collectives import host_store, init_process_group, new_token, token_store
from aiosync.collectives.rendezvous import connect_store
from benchmarks import collective_hooks
from benchmarks.timeline_hooks import Recorder
from benchmarks.timeline_view import render

MiB = 1 << 20
GiB = 1 << 30
RAW_GROUP = "aiosync-bench-raw"
SAFE_ENV = {  # NVLink multicast stays off (shared hosts)
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def llama3_8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B's 291 parameter names and shapes (vocab 128256, 32 layers, GQA 8 heads)."""
    return llama_layout(*LLAMA3_8B)


def make_model(scale: float, fill: bool, device: str) -> dict[str, torch.Tensor]:
    """The model on ``device``, ``scale`` of the real sizes (first dimension)."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in llama3_8b_shapes():
        scaled = (max(1, int(shape[0] * scale)), *shape[1:])
        tensor = torch.zeros(scaled, dtype=torch.bfloat16, device=device)
        if fill:
            tensor.normal_(0.0, 0.02, generator=gen)
        out[name] = tensor
    return out


def join_raw(host: str, port: int, token: str, rank: int, backend: str) -> dist.ProcessGroup:
    """The raw group of the two processes (a side group, no default world)."""
    wait = timedelta(seconds=120)
    store = connect_store(host, port, timeout=wait)
    return init_process_group(
        backend, store=token_store(store, token), world_size=2, rank=rank,
        group_name=RAW_GROUP, timeout=wait,
    )  # fmt: skip


def raw_broadcast(group: dist.ProcessGroup, flat: torch.Tensor, message: int) -> float:
    """One broadcast of ``flat`` in ``message``-byte pieces; seconds (after a barrier)."""
    flag = torch.zeros(1, device=flat.device)
    dist.broadcast(flag, 0, group=group)
    _sync(flat.device)
    start = time.perf_counter()
    works = [
        dist.broadcast(flat[i : i + message], 0, group=group, async_op=True)
        for i in range(0, flat.numel(), message)
    ]
    for work in works:
        assert work is not None
        work.wait()
    _sync(flat.device)
    return time.perf_counter() - start


def verify(group: dist.ProcessGroup, model: dict[str, torch.Tensor], root: bool) -> int:
    """Each tensor broadcast raw from the trainer; the engine counts the ones that differ."""
    wrong = 0
    for tensor in model.values():
        if root:
            dist.broadcast(tensor, 0, group=group)
            continue
        reference = torch.empty_like(tensor)
        dist.broadcast(reference, 0, group=group)
        wrong += int(not torch.equal(reference, tensor))
    return wrong


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the engine process ------------------------------------------------------------------


def engine(args: argparse.Namespace) -> None:
    """Serve the model from a WeightReceiver; take part in raw broadcasts when told."""
    from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
    from aiosync.runtime import run

    device, backend = _device(args)
    model = make_model(args.scale, fill=False, device=device)
    total = sum(t.nbytes for t in model.values())
    group = join_raw(args.host, args.port, args.token, 1, backend)
    flat = torch.empty(total, dtype=torch.uint8, device=device)

    def say(**fields: object) -> None:
        print(json.dumps(fields), flush=True)

    sink = ModuleSink(model)
    rec = Recorder(device.startswith("cuda"), device if device.startswith("cuda") else None)

    async def serve() -> None:
        config = ReceiverConfig(stream_timeout=120, session_timeout=600)
        async with WeightReceiver(sink, config=config) as receiver:
            say(endpoint=receiver.endpoint)
            while True:
                words = (await anyio.to_thread.run_sync(sys.stdin.readline)).split()
                if not words or words[0] == "quit":
                    return
                if words[0] == "raw":
                    for _ in range(int(words[1])):
                        await anyio.to_thread.run_sync(raw_broadcast, group, flat, GiB)
                    say(raw="done")
                elif words[0] == "verify":
                    say(wrong=await anyio.to_thread.run_sync(verify, group, model, False))
                elif words[0] == "trace":  # marks from now on (see collective_hooks)
                    collective_hooks.engine_collective_hooks(rec, sink)
                    rec.start()
                    say(trace="on")
                elif words[0] == "dump":
                    say(marks=rec.dump())

    run(serve)


# --- the trainer -------------------------------------------------------------------------


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, run every mode, return the results."""
    from aiosync.runtime import child_env

    device, backend = _device(args)
    model = make_model(args.scale, fill=True, device=device)
    total = sum(t.nbytes for t in model.values())
    hosted, token = host_store(timeout=timedelta(seconds=120)), new_token()
    env = {**child_env(), **SAFE_ENV}
    command = [sys.executable, "-m", "benchmarks.collective", "--role", "engine"]
    command += ["--port", str(hosted.port), "--token", token, "--scale", str(args.scale)]
    command += ["--engine-device", args.engine_device]
    command += ["--cpu"] if args.cpu else []
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    out: dict[str, Any] = {"tensors": len(model), "bytes": total, "repeats": args.repeats}
    try:
        group = join_raw(hosted.host, hosted.port, token, 0, backend)
        endpoint = _reply(proc)["endpoint"]
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        _ask(proc, f"raw {args.repeats + 1}")
        times = [raw_broadcast(group, flat, GiB) for _ in range(args.repeats + 1)][1:]
        _reply(proc)
        del flat
        raw = statistics.median(times)
        out["raw"] = {"ms": raw * 1e3, "GBps": total / raw / 1e9, "all_ms": _ms(times)}
        for mode in args.modes.split(","):
            if mode == "raw":
                continue
            try:
                marks = anyio.run(_pipeline, model, endpoint, mode, device, args)
                times = [m["end"] - m["start"] for m in marks]
                _ask(proc, "verify")
                wrong = verify(group, model, True)
                wrong = int(_reply(proc)["wrong"])
                median = statistics.median(times)
                out[mode] = {
                    "ms": median * 1e3,
                    "ratio_to_raw": median / raw,
                    "GBps": total / median / 1e9,
                    "all_ms": _ms(times),
                    "bit_exact": wrong == 0,
                    "tensors_differing": wrong,
                    "phases_ms": phases(marks),
                }
            except Exception as exc:  # report, and go on with the other modes
                out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.traced:
            out["traced"] = _traced(proc, model, endpoint, device, args)
        _ask(proc, "quit")
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return out


async def _pipeline(
    model: dict[str, torch.Tensor],
    endpoint: str,
    mode: str,
    device: str,
    args: argparse.Namespace,
) -> list[dict[str, float]]:
    """``repeats + 1`` versions through one sender of ``mode``; each one's clock marks.

    The first (the warm-up) is left out; see :func:`phases` for the marks.
    """
    from aiosync import SenderConfig, WeightSender
    from aiosync.planes.collective import CollectiveOptions
    from aiosync.trainer.collective import CollectiveSender

    config = SenderConfig(buffer_bytes=args.buffer_mb * MiB, num_buffers=args.buffers, timeout=120)
    sender: WeightSender
    if mode == "ipc":
        sender = WeightSender([endpoint], device=device, config=config)
    elif mode in ("flat", "flat_overlap", "per_tensor"):
        options = CollectiveOptions(engines=1, per_tensor=mode == "per_tensor", timeout=120)
        sender = CollectiveSender([endpoint], collective=options, device=device, config=config)
    else:
        raise ValueError(f"unknown mode {mode}")
    marker = model["model.norm.weight"]
    times = []
    async with sender:
        for repeat in range(args.repeats + 1):
            marker.fill_(float(repeat))  # every version differs from the one before
            _sync(marker.device)
            marks: dict[str, float] = {}
            packed = anyio.Event()

            def acked(_: object, marks: dict[str, float] = marks) -> None:
                marks.setdefault("first_ack", time.perf_counter())

            async def when_packed(marks: dict[str, float] = marks, packed: Any = packed) -> None:
                await packed.wait()
                marks["packed"] = time.perf_counter()

            async with anyio.create_task_group() as tg:
                tg.start_soon(when_packed)
                marks["start"] = time.perf_counter()
                await sender.send(model, packed=packed, progress=acked)
                marks["end"] = time.perf_counter()
            times.append(marks)
    return times[1:]


def _traced(
    proc: subprocess.Popen[str],
    model: dict[str, torch.Tensor],
    endpoint: str,
    device: str,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """``--traced`` flat versions with both processes' marks; each one's timeline.

    The hooks stay in this process, so this runs after every timed mode.
    """
    rec = Recorder(device.startswith("cuda"), device if device.startswith("cuda") else None)
    collective_hooks.trainer_collective_hooks(rec)
    _ask(proc, "trace")
    _reply(proc)
    rec.start()
    traced = argparse.Namespace(**{**vars(args), "repeats": args.traced})
    anyio.run(_pipeline, model, endpoint, "flat", device, traced)
    mine = rec.dump()
    _ask(proc, "dump")
    theirs = [tuple(mark) for mark in _reply(proc)["marks"]]
    versions = sorted({mark[2] for mark in mine if mark[2] >= 0})[-args.traced :]
    views = []
    for version in versions:
        view = collective_hooks.collective_timeline(mine, theirs, version)  # type: ignore[arg-type]
        print(f"--- traced flat version {version}", file=sys.stderr)
        print(render(view), file=sys.stderr, flush=True)
        views.append(view)
    return views


def phases(marks: list[dict[str, float]]) -> dict[str, float]:
    """Medians (ms) of each version's phases, from the trainer's clock.

    ``to_first_ack``: from the call to the engine's ack of bucket 1 (reading the tensors,
    the manifest, packing and posting bucket 1); ``to_packed``: from there until the send
    says every byte is packed (for the collective plane over NCCL: every broadcast done on
    the GPU); ``to_end``: from there until the engines committed (completion, commit).
    """
    spans = {
        "to_first_ack": [m["first_ack"] - m["start"] for m in marks],
        "to_packed": [m["packed"] - m["first_ack"] for m in marks],
        "to_end": [m["end"] - m["packed"] for m in marks],
    }
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in spans.items()}


def _device(args: argparse.Namespace) -> tuple[str, str]:
    """The device of this process and the backend: a GPU and NCCL, or Gloo on CPUs.

    The engine sees every GPU (its CUDA IPC mode opens the trainer's buffers on GPU 0).
    """
    if args.cpu:
        return "cpu", "gloo"
    device = args.engine_device if args.role == "engine" else "cuda:0"
    torch.cuda.set_device(torch.device(device))
    return device, "nccl"


def _ask(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _reply(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"engine exited with {proc.wait()}")
    reply: dict[str, Any] = json.loads(line)
    return reply


def _ms(times: list[float]) -> list[float]:
    return [round(t * 1e3, 2) for t in times]


def main() -> None:
    """Parse the command line and run one role."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--role", default="trainer", choices=["trainer", "engine"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument("--buffers", type=int, default=2)
    parser.add_argument("--modes", default="raw,flat,per_tensor,ipc")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each tensor")
    parser.add_argument("--engine-device", default="cuda:1")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--cpu", action="store_true", help="Gloo on CPUs (a smoke test)")
    parser.add_argument("--traced", type=int, default=0, help="flat versions with a timeline")
    args = parser.parse_args()
    if args.role == "engine":
        engine(args)
        return
    print(json.dumps(trainer(args), indent=1), flush=True)


if __name__ == "__main__":
    main()
