"""A trainer and an engine in one asyncio program: three versions of a small model.

    python examples/stream_in_process.py

The two sides still talk only through ZMQ and shared memory, exactly as across processes.
"""

from __future__ import annotations

import logging

import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )


async def main() -> None:
    trainer_model, engine_model = make_model(), make_model()
    optimizer = torch.optim.SGD(trainer_model.parameters(), lr=0.1)
    config = SenderConfig(buffer_bytes=1 << 20, num_buffers=2, timeout=10)
    async with (
        WeightReceiver(ModuleSink(engine_model)) as engine,
        WeightSender(engine.endpoint, config=config) as trainer,
    ):
        for step in range(3):
            loss = trainer_model(torch.randn(8, 256)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report = await trainer.send(trainer_model.state_dict().items(), version=step)
            same = all(
                torch.equal(a, b)
                for a, b in zip(
                    trainer_model.state_dict().values(),
                    engine_model.state_dict().values(),
                    strict=True,
                )
            )
            print(
                f"step {step}: {report.bytes / 1e6:.1f} MB in {report.seconds * 1e3:.1f} ms, "
                f"engine at version {engine.current_version}, identical: {same}"
            )
            if not same:
                raise SystemExit("engine weights differ from the trainer's")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run(main)
