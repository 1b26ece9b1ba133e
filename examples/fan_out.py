"""One trainer feeding three engines with one set of buffers, then the fleet changing.

    python examples/fan_out.py

Each bucket is packed once and read by every engine; a version commits on all engines
together (policy "all"), and engines join or leave between versions.
"""

from __future__ import annotations

import logging

import torch

from aiosync import ModuleSink, Policy, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))


def identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


async def main() -> None:
    policy = make_model()
    engines = [make_model() for _ in range(3)]
    config = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=10)
    async with (
        WeightReceiver(ModuleSink(engines[0])) as a,
        WeightReceiver(ModuleSink(engines[1])) as b,
        WeightReceiver(ModuleSink(engines[2], staged=True)) as c,
        WeightSender([a.endpoint, b.endpoint], config=config) as trainer,
    ):
        report = await trainer.send(policy, version=0)  # a module: its manifest is read first
        print(f"version 0 to {len(report.committed)} engines in {report.seconds * 1e3:.1f} ms")

        late = await trainer.add_engine(c.endpoint)  # joins between versions
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(0.5)
        report = await trainer.send(policy, version=1, policy=Policy.AVAILABLE)
        for outcome in report.engines:
            print(f"  {outcome.engine.rsplit('/', 2)[-2]}: {outcome.status} at {outcome.version}")

        await trainer.remove_engine(late)
        print("engines now:", len(trainer.engines))
    if not all(identical(policy, engine) for engine in engines):
        raise SystemExit("an engine differs from the trainer")
    print("all three engines hold version 1 bit-exact")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run(main)
