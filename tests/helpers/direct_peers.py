"""Trainer and engine processes for the CUDA direct-mode tests.

``python -m tests.helpers.direct_peers engine`` serves a model of :func:`shapes` on ``cuda:0``; it
prints ``ready`` (endpoint) and ``committed`` (version, digests) after each commit.
``--staged`` stages each version (a failed one leaves the last intact); ``--die-in-version
V`` exits (``os._exit(9)``, :class:`tests.helpers.cuda_peers.DyingSink`) while applying version V's
second region; ``--answer`` prints ``state`` (current version, digests) for each line on
its stdin.
``python -m tests.helpers.direct_peers trainer --endpoint E [--endpoint E2] --versions N`` holds a
:class:`Net` on ``cuda:0`` (bf16 and fp32 parameters), steps it in place on a side stream
before each version and sends its parameters in direct mode together with two temporaries
(a cast and a fresh tensor); right after each send returns it changes every parameter
again (the snapshot rule: the engine must have read before). Prints ``sent`` (version,
digests of what was sent, the report's byte split, note and committed engines, and whether
the sender split its tensors afresh and how many lookups it made, the kinds of the regions
it reads in place and the physical allocations of its descriptor regions); a send that raises
prints ``failed`` (version, error, seconds) and ends the run. ``--churn`` moves parameters
between versions: before version 3 two get new storages (``.data =`` and ``set_``), before
version 5 one is freed, ``torch.cuda.empty_cache()`` runs and it gets a storage of the same
size again (often at the same address, in a new allocation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.errors import AiosyncError
from aiosync.planes.fd_regions import pieces_of
from aiosync.runtime import run
from tests.helpers.cuda_peers import DyingSink
from tests.helpers.models import digest


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
    dying = DyingSink(model, 0) if args.die_in_version else None
    sink = dying or ModuleSink(model, staged=args.staged)
    receiver: WeightReceiver | None = None

    def state() -> dict[str, object]:
        return {n: digest(t) for n, t in model.items()}

    def committed(version: int) -> None:
        if dying is not None and version == args.die_in_version - 1:
            dying.die_after = dying.buckets + 2  # the next version's second region
        emit("committed", version=version, digests=state())

    async def answer() -> None:
        async for _ in anyio.wrap_file(sys.stdin):
            assert receiver is not None
            emit("state", version=receiver.current_version, digests=state())

    async def serve() -> None:
        nonlocal receiver
        config = ReceiverConfig(stream_timeout=60, session_timeout=60)
        async with WeightReceiver(sink, config=config, on_commit=committed) as rx:
            receiver = rx
            emit("ready", endpoint=rx.endpoint)
            if args.answer:
                await answer()
            await anyio.sleep_forever()

    if args.loop_stream:  # the serving loop's own current stream, as an application might
        with torch.cuda.stream(torch.cuda.Stream()):
            run(serve)
    else:
        run(serve)


def churn(net: Net, version: int) -> None:
    """Move parameters to other memory between versions (see the module's docstring)."""
    with torch.no_grad():
        if version == 3:
            net.big.data = torch.empty_like(net.big)
            net.up.set_(torch.empty_like(net.up))
        elif version == 5:
            shape, dtype = net.big.shape, net.big.dtype
            net.big.data = torch.empty(0, dtype=dtype, device="cuda:0")
            torch.cuda.empty_cache()
            net.big.data = torch.empty(shape, dtype=dtype, device="cuda:0")


def trainer(args: argparse.Namespace) -> None:
    net = Net().to("cuda:0")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    async def main() -> None:
        config = SenderConfig(
            buffer_bytes=1 << 20, num_buffers=2, direct=True, timeout=args.timeout
        )
        async with WeightSender(args.endpoint, device="cuda:0", config=config) as sender:
            reader = sender._direct
            assert reader is not None
            for version in range(args.versions):
                before = net.big.data_ptr()
                if args.churn:
                    churn(net, version)
                with torch.cuda.stream(side):
                    step(net, version)
                    tensors: dict[str, torch.Tensor] = dict(net.named_parameters())
                    tensors["up_fp32"] = net.up.detach().float()
                    tensors["noise"] = torch.full((333, 77), version + 0.5, device="cuda:0").half()
                    started = time.monotonic()
                    try:
                        report = await sender.send(tensors, version=version)
                    except AiosyncError as exc:
                        seconds = time.monotonic() - started
                        emit("failed", version=version, error=str(exc), seconds=seconds)
                        return
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
                    committed=report.committed,
                    fresh=reader.fresh,
                    checked=reader.checked,
                    same_address=net.big.data_ptr() == before,
                    kinds=sorted({type(r).__name__ for r in reader.regions}),
                    pieces=sum(pieces_of(r) for r in reader.regions),
                )

    run(main)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["engine", "trainer"])
    parser.add_argument("--endpoint", action="append", default=[])
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--churn", action="store_true")
    parser.add_argument("--staged", action="store_true")
    parser.add_argument("--die-in-version", type=int, default=0)
    parser.add_argument("--answer", action="store_true")
    parser.add_argument("--loop-stream", action="store_true")
    args = parser.parse_args()
    engine(args) if args.role == "engine" else trainer(args)


if __name__ == "__main__":
    main()
