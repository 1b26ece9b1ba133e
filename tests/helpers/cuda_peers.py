"""Trainer and engine processes for the CUDA tests: ``python -m tests.helpers.cuda_peers ROLE ...``.

Both build the same named tensors (:func:`weights`): bf16, fp16, fp32, int8 and fp8, one
tensor larger than a buffer, one non-contiguous and one on the CPU (the trainer's side; the
engine holds every tensor on its GPU). Version ``v``'s values are a function of ``v``.

``engine``: serves on a private endpoint; prints ``ready`` (endpoint), ``committed``
(version, digests) after each commit, ``profile`` (runtime sync calls seen from the commit of
``--profile-from`` to that of the last version, with ``--versions``). ``--die-after K``
exits (SIGKILL-like, ``os._exit``) while applying its K-th bucket.
``trainer``: sends ``--versions`` versions to ``--endpoint``; prints ``sent`` (version,
digests) after each, and ``profile`` with ``--profile-from``. ``reader``: opens a plane spec
(``--spec``, msgpack in hex) and prints ``read`` (its events, the digest of ``--bytes`` bytes
of buffer 0, read without waiting).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Any

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.layout import TensorSpec
from aiosync.runtime import run
from tests.helpers.models import digest

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
BUFFER = 4 << 20


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def shapes() -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor (the transposed one as the engine holds it)."""
    return {
        "bf16": (torch.bfloat16, (512, 1024)),
        "fp16": (torch.float16, (1000, 333)),
        "fp32": (torch.float32, (257, 129)),
        "int8": (torch.int8, (4099,)),
        "fp8": (torch.float8_e4m3fn, (640, 64)),
        "oversized": (torch.bfloat16, (3 * BUFFER // 2 + 77,)),  # chunked over buckets
        "transposed": (torch.float32, (96, 80)),  # sent as a non-contiguous view
        "from_cpu": (torch.float32, (3000,)),
    }


def weights(version: int, device: str) -> dict[str, torch.Tensor]:
    """The trainer's tensors at ``version`` (made on the GPU without host waits)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + version)
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in shapes().items():
        if name == "transposed":
            base = torch.randn(shape[::-1], generator=gen, device=device)
            out[name] = base.t()
        elif dtype == torch.int8:
            out[name] = torch.randint(-128, 128, shape, generator=gen, device=device).to(dtype)
        else:
            out[name] = torch.randn(shape, generator=gen, device=device).to(dtype)
    out["from_cpu"] = torch.full(shapes()["from_cpu"][1], float(version) + 0.25)
    return out


class Profiled:
    """torch.profiler around a range of versions; counts the runtime's sync calls."""

    def __init__(self) -> None:
        self._prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.start()

    def stop(self, versions: int) -> None:
        self._prof.stop()
        counts = Counter(e.name for e in self._prof.events() if e.name in SYNCS)
        emit("profile", versions=versions, syncs=dict(counts))


class DyingSink(ModuleSink):
    def __init__(self, model: dict[str, torch.Tensor], die_after: int) -> None:
        super().__init__(model)
        self.die_after = die_after
        self.buckets = 0

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.buckets += 1
        if self.die_after and self.buckets >= self.die_after:
            os._exit(9)
        super().apply_bucket(bucket, specs)


def engine(args: argparse.Namespace) -> None:
    model = {
        name: torch.zeros(shape, dtype=dtype, device=args.device)
        for name, (dtype, shape) in shapes().items()
    }
    sink = DyingSink(model, args.die_after)
    profiled = Profiled()

    def committed(version: int) -> None:
        last = version == args.versions - 1
        if args.profile_from is not None:
            if version == args.profile_from - 1:
                profiled.start()
            if last:
                profiled.stop(args.versions - args.profile_from)
        if args.profile_from is None or last:
            emit("committed", version=version, digests={n: digest(t) for n, t in model.items()})

    async def serve() -> None:
        config = ReceiverConfig(stream_timeout=60, session_timeout=60)
        async with WeightReceiver(sink, config=config, on_commit=committed) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            await anyio.sleep_forever()

    run(serve)


def trainer(args: argparse.Namespace) -> None:
    profiled = Profiled()

    async def main() -> None:
        config = SenderConfig(buffer_bytes=BUFFER, num_buffers=2, timeout=args.timeout)
        async with WeightSender(args.endpoint, device=args.device, config=config) as sender:
            for version in range(args.versions):
                if version == args.profile_from:
                    profiled.start()
                tensors = weights(version, args.device)
                report = await sender.send(tensors, version=version)
                if args.profile_from is None or version == args.versions - 1:
                    if version == args.versions - 1 and args.profile_from is not None:
                        profiled.stop(args.versions - args.profile_from)
                    digests = {n: digest(t) for n, t in tensors.items()}
                    ahead = getattr(sender._plane, "_count", None)  # buckets sent ahead
                    emit("sent", version=version, digests=digests, bytes=report.bytes, ahead=ahead)

    run(main)


def waiting_engine(args: argparse.Namespace) -> None:
    """Open a trainer's plane (its spec in hex), queue a copy behind a counter value the
    trainer never sets, then close the plane: the close must let the stream go."""
    import msgspec

    from aiosync.core.wire import CudaPlaneSpec
    from aiosync.planes.cuda import CudaReceiverPlane

    spec = msgspec.msgpack.decode(bytes.fromhex(args.spec), type=CudaPlaneSpec)
    plane = CudaReceiverPlane(spec, torch.device(args.device))
    target = torch.zeros(16, dtype=torch.uint8, device=args.device)
    plane.wait_after(1)
    target.copy_(plane.view(0, 16))  # queued behind the wait
    done = torch.cuda.Event()
    done.record()
    emit("waiting", pending=not done.query())
    plane.close()
    torch.cuda.synchronize()
    emit("closed", copied=target.tolist())


def reader(args: argparse.Namespace) -> None:
    """Open an unordered plane (its spec in hex) and read its first buffer at once (no wait)."""
    import msgspec

    from aiosync.core.wire import CudaPlaneSpec
    from aiosync.planes import open_receiver_plane

    spec = msgspec.msgpack.decode(bytes.fromhex(args.spec), type=CudaPlaneSpec)
    plane = open_receiver_plane(spec, torch.device(args.device))
    view = plane.view(0, args.bytes)
    emit("read", events=list(getattr(plane, "events", [])), digest=digest(view.clone()))
    plane.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["engine", "trainer", "waiting_engine", "reader"])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--profile-from", type=int, default=None)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--spec", default="")
    parser.add_argument("--bytes", type=int, default=0)
    args = parser.parse_args()
    roles = {"engine": engine, "trainer": trainer, "waiting_engine": waiting_engine}
    roles["reader"] = reader
    roles[args.role](args)


if __name__ == "__main__":
    main()
