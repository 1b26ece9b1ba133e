"""The drop-in against the native API on one GPU, in one run.

Run as ``python -m aiosync.bench.cuda_dropin``.

An engine process (``engine`` role) holds a bf16 Llama-shaped model of ``--size-mb`` on
``cuda:0``; this process streams the same shapes to it through
:func:`~aiosync.compat.nemo_rl.stream_weights_via_ipc_zmq_impl` (``--dropin-mb`` in total,
two halves) and through :class:`~aiosync.WeightSender` (2 x ``--buffer-mb``), ``--repeats``
times each after a warm-up, then a lock-step baseline (one buffer of ``--dropin-mb``, a
synchronise per bucket on both sides), and measures the two floors of the same run (one
flat device copy of the model's bytes; a copy of every tensor into buffers and back). The
engine's model is checked against the trainer's at the end (sums and samples of every
tensor's bytes). Prints JSON.
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

from aiosync.bench.model import synthetic_state_dict

MiB = 1 << 20


def model_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor (its byte sum and every 997th byte), in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        raw = tensors[name].reshape(-1).view(torch.uint8)
        h.update(str(int(raw.sum(dtype=torch.int64))).encode())
        h.update(raw[::997].cpu().numpy().tobytes())
    return h.hexdigest()


def timed(fn: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up, device synchronised."""
    out = []
    for _ in range(repeats + 1):  # the first warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out[1:]


def copy_floors(model: dict[str, torch.Tensor], buffer_bytes: int) -> dict[str, float]:
    """The run's copy floors: one flat device copy of the model, and two (via buffers)."""
    total = sum(t.nbytes for t in model.values())
    flat = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    other = torch.empty_like(flat)

    def one_copy() -> None:
        other.copy_(flat)
        torch.cuda.synchronize()

    one = statistics.median(timed(one_copy, 5))
    buf = flat[: 2 * buffer_bytes]

    def two_copies() -> None:
        offset = 0
        for t in model.values():
            raw = t.reshape(-1).view(torch.uint8)
            n = raw.numel()
            if offset + n > buf.numel():
                offset = 0
            buf[offset : offset + n].copy_(raw)
            raw.copy_(buf[offset : offset + n])
            offset += n
        torch.cuda.synchronize()

    two = statistics.median(timed(two_copies, 5))
    return {"one_copy_s": one, "two_copies_s": two}


def engine(args: argparse.Namespace) -> None:
    """Serve the model; print the endpoint, and a digest when stdin asks."""
    from aiosync import ModuleSink, WeightReceiver
    from aiosync.runtime import run

    model = {
        n: torch.zeros_like(t)
        for n, t in synthetic_state_dict(args.size_mb * MiB, torch.bfloat16, 0, "cuda:0").items()
    }

    async def serve() -> None:
        async with WeightReceiver(ModuleSink(model)) as receiver:
            print(json.dumps({"endpoint": receiver.endpoint}), flush=True)
            while True:  # the trainer's commands, one a line
                words = (await anyio.to_thread.run_sync(sys.stdin.readline)).split()
                if not words or words[0] == "digest":
                    print(json.dumps({"digest": model_digest(model)}), flush=True)
                    return
                await anyio.to_thread.run_sync(_lockstep_engine, model, words[1], int(words[2]))

    run(serve)


def _lockstep_engine(model: dict[str, torch.Tensor], handle: str, size: int) -> None:
    """The baseline's engine: copy each announced bucket out, synchronise, answer."""
    from aiosync.planes.cuda_runtime import DeviceMemory

    memory = DeviceMemory.open(bytes.fromhex(handle), size, 0)
    views = {n: t.reshape(-1).view(torch.uint8) for n, t in model.items()}
    print(json.dumps({"opened": True}), flush=True)
    while (line := sys.stdin.readline().strip()) != "end":
        for name, offset, nbytes in json.loads(line):
            views[name].copy_(memory.tensor[offset : offset + nbytes])
        torch.cuda.synchronize()
        print(json.dumps({"ok": True}), flush=True)
    memory.close()


def _lockstep(
    model: dict[str, torch.Tensor], proc: subprocess.Popen[str], size: int, repeats: int
) -> list[float]:
    """A lock-step baseline of the usual shape; its time per version.

    One buffer of ``size`` bytes, one bucket in flight, a synchronise after packing and
    after applying, a reply per bucket.
    """
    from aiosync.planes.cuda_runtime import DeviceMemory

    assert proc.stdin is not None
    assert proc.stdout is not None
    memory = DeviceMemory.allocate(size, 0)
    proc.stdin.write(f"lockstep {memory.handle.hex()} {size}\n")
    proc.stdin.flush()
    json.loads(proc.stdout.readline())
    buffer = memory.tensor

    def one_version() -> None:
        bucket: list[tuple[str, int, int]] = []
        offset = 0
        items = list(model.items())
        for i, (name, tensor) in enumerate(items):
            raw = tensor.reshape(-1).view(torch.uint8)
            buffer[offset : offset + raw.numel()].copy_(raw)
            bucket.append((name, offset, raw.numel()))
            offset += raw.numel()
            last = i == len(items) - 1
            if last or offset + items[i + 1][1].nbytes > size:
                torch.cuda.synchronize()
                proc.stdin.write(json.dumps(bucket) + "\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                json.loads(proc.stdout.readline())  # type: ignore[union-attr]
                bucket, offset = [], 0

    times = timed(one_version, repeats)
    proc.stdin.write("end\n")
    proc.stdin.flush()
    memory.close()
    return times


def trainer(args: argparse.Namespace) -> None:
    """Start the engine, measure the floors, the drop-in and the native API; print JSON."""
    import zmq

    from aiosync import SenderConfig, WeightSender
    from aiosync.compat.nemo_rl import release_ipc_zmq_streams, stream_weights_via_ipc_zmq_impl
    from aiosync.runtime import child_env, run

    model = synthetic_state_dict(args.size_mb * MiB, torch.bfloat16, 1, "cuda:0")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiosync.bench.cuda_dropin",
            "engine",
            "--size-mb",
            str(args.size_mb),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    assert proc.stdin is not None
    try:
        endpoint = json.loads(proc.stdout.readline())["endpoint"]
        out: dict[str, Any] = {"bytes": sum(t.nbytes for t in model.values())}
        out.update(copy_floors(model, args.buffer_mb * MiB))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        total = args.dropin_mb * MiB

        def dropin() -> None:
            stream_weights_via_ipc_zmq_impl(model.items(), total, sock, 1, "bench")

        first = time.perf_counter()
        dropin()
        out["dropin_first_s"] = time.perf_counter() - first
        out["dropin_s"] = timed(dropin, args.repeats)
        release_ipc_zmq_streams(sock)
        sock.close(linger=0)
        ctx.term()

        async def native() -> list[float]:
            config = SenderConfig(buffer_bytes=args.buffer_mb * MiB, num_buffers=2)
            times = []
            async with WeightSender(endpoint, device="cuda:0", config=config) as sender:
                for _ in range(args.repeats + 1):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    await sender.send(model)
                    times.append(time.perf_counter() - start)
            return times[1:]

        out["native_s"] = run(native)
        out["lockstep_s"] = _lockstep(model, proc, total, args.repeats)
        proc.stdin.write("digest\n")
        proc.stdin.flush()
        out["bit_exact"] = json.loads(proc.stdout.readline())["digest"] == model_digest(model)
        for key in ("dropin_s", "native_s", "lockstep_s"):
            out[key.replace("_s", "_median_s")] = statistics.median(out[key])
        out["dropin_over_native"] = out["dropin_median_s"] / out["native_median_s"]
        out["native_over_two_copies"] = out["native_median_s"] / out["two_copies_s"]
        out["lockstep_over_native"] = out["lockstep_median_s"] / out["native_median_s"]
        print(json.dumps(out), flush=True)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def main() -> None:
    """Parse the command line and run one role (``trainer`` starts the engine itself)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "engine"], nargs="?", default="trainer")
    parser.add_argument("--size-mb", type=int, default=15316)
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument("--dropin-mb", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine(args) if args.role == "engine" else trainer(args)


if __name__ == "__main__":
    main()
