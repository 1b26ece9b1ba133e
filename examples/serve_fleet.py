"""A weight server between a trainer and a fleet of engines, all in one process.

The trainer publishes five versions to the server and never waits for the engines; two
engines follow the newest version, one of them joining late. The trainer then waits until
every engine is within its lag bound, and then until every one holds the last version.
Exits non-zero unless every engine ends on the trainer's last weights, bit for bit.

In production the server runs on its own (``aiosync serve``) and the engines in their own
processes, with the endpoints from its ready line.
"""

from __future__ import annotations

import sys

import anyio
import torch

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.server import RetentionPolicy, ServerConfig, Subscriber, WeightServer


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


async def main() -> int:
    trainer = make_model()
    engines = [make_model(), make_model()]
    config = ServerConfig(retention=RetentionPolicy(max_versions=2))
    async with (
        WeightServer(config) as server,
        WeightSender(server.publish_endpoint, config=SenderConfig(timeout=30)) as sender,
        Subscriber(server.control_endpoint, ModuleSink(engines[0]), name="early", max_lag=1),
    ):
        for version in range(5):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * torch.randn_like(p))  # a training step
            await sender.send(trainer, version=version)  # returns once the server holds it
            print(f"published version {version}; server retains {server.store.versions}")
        async with Subscriber(
            server.control_endpoint, ModuleSink(engines[1]), name="late", max_lag=0
        ) as late:
            await late.wait_for_version(4, timeout=30)  # a late joiner: served at once
            await server.wait_within_bounds(timeout=30)  # every engine within its bound
            status = await server.wait_for(4, timeout=30)  # and now every one on version 4
            for engine in status.engines:
                print(f"engine {engine.name}: version {engine.version}, lag {engine.lag}")
    expected = trainer.state_dict()
    exact = all(
        all(torch.equal(engine.state_dict()[k], v) for k, v in expected.items())
        for engine in engines
    )
    print("every engine holds the last version bit-exact" if exact else "MISMATCH")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
