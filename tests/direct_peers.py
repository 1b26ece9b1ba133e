"""Trainer and engine processes for the CUDA direct-mode tests.

``python -m tests.direct_peers engine`` serves a model of :func:`shapes` on ``cuda:0``; it
prints ``ready`` (endpoint) and ``committed`` (version, digests) after each commit.
``python -m tests.direct_peers trainer --endpoint E --versions N`` holds a :class:`Net` on
``cuda:0`` (bf16 and fp32 parameters), steps it in place on a side stream before each
version and sends its parameters in direct mode together with two temporaries (a cast and
a fresh tensor); right after each send returns it changes every parameter again (the
snapshot rule: the engine must have read before). Prints ``sent`` (version, digests of
what was sent, the report's byte split and note).
"""

from __future__ import annotations

import argparse
import json

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run
from tests.models import digest


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class Net(torch.nn.Module):
    """bf16 and fp32 parameters of several sizes (one of 12 MB)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(3000, 1000, dtype=torch.float32))
        self.up = torch.nn.Parameter(torch.zeros(1024, 512, dtype=torch.bfloat16))
        self.down = torch.nn.Parameter(torch.zeros(512, 1024, dtype=torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.zeros(512, dtype=torch.float32))
        self.tiny = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))


def shapes() -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor the engine holds: the parameters and the two temporaries."""
    out = {n: (p.dtype, tuple(p.shape)) for n, p in Net().named_parameters()}
    out["up_fp32"] = (torch.float32, (1024, 512))  # a cast
    out["noise"] = (torch.float16, (333, 77))  # made fresh each version
    return out


def step(net: Net, version: int) -> None:
    """Change every parameter in place (no host wait)."""
    gen = torch.Generator(device="cuda:0")
    gen.manual_seed(100 + version)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda:0").to(p.dtype))


def engine(args: argparse.Namespace) -> None:
    model = {n: torch.zeros(s, dtype=d, device="cuda:0") for n, (d, s) in shapes().items()}

    def committed(version: int) -> None:
        emit("committed", version=version, digests={n: digest(t) for n, t in model.items()})

    async def serve() -> None:
        config = ReceiverConfig(stream_timeout=60, session_timeout=60)
        async with WeightReceiver(ModuleSink(model), config=config, on_commit=committed) as rx:
            emit("ready", endpoint=rx.endpoint)
            await anyio.sleep_forever()

    run(serve)


def trainer(args: argparse.Namespace) -> None:
    net = Net().to("cuda:0")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    async def main() -> None:
        config = SenderConfig(buffer_bytes=1 << 20, num_buffers=2, direct=True)
        async with WeightSender(args.endpoint, device="cuda:0", config=config) as sender:
            for version in range(args.versions):
                with torch.cuda.stream(side):
                    step(net, version)
                    tensors: dict[str, torch.Tensor] = dict(net.named_parameters())
                    tensors["up_fp32"] = net.up.detach().float()
                    tensors["noise"] = torch.full((333, 77), version + 0.5, device="cuda:0").half()
                    report = await sender.send(tensors, version=version)
                    digests = {n: digest(t) for n, t in tensors.items()}
                    with torch.no_grad():  # the engines have read: the trainer may step
                        for p in net.parameters():
                            p.mul_(-3)
                emit(
                    "sent",
                    version=version,
                    digests=digests,
                    direct=report.direct_bytes,
                    packed=report.packed_bytes,
                    note=report.direct_note,
                    params=sum(p.nbytes for p in net.parameters()),
                )

    run(main)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["engine", "trainer"])
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--versions", type=int, default=1)
    args = parser.parse_args()
    engine(args) if args.role == "engine" else trainer(args)


if __name__ == "__main__":
    main()
