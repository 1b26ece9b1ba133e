"""An engine whose prefix cache is cleared the moment new weights go live.

    python examples/reset_cache_on_live.py

A rollout engine caches what it computed for a prompt's prefix (vLLM's prefix cache keeps
KV blocks). Those entries were computed by the weights live then: served after a new
version goes live, they mix old weights into new answers. ``on_live`` runs under the
swap, once the new weights are in place and before any read lease on them is granted, so
clearing the cache there means no request ever reads an entry of another version.

Here a toy cache maps a prefix to the hidden state the model computed for it; every
request under a lease checks its cached entry against a fresh computation by the weights
it is reading. The trainer and the engine share one asyncio program (they still talk
only through ZMQ and shared memory). Runs on the CPU. The hook may be an ``async def``
too (awaited on the loop); a plain function, as here, runs in a worker thread.
"""

from __future__ import annotations

import logging
import random

import anyio
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run

PROMPTS = [tuple(range(start, start + 4)) for start in range(0, 32, 4)]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32))


class PrefixCache:
    """Hidden states by prompt prefix, as computed by the weights live when they were made."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], torch.Tensor] = {}
        self.hits = self.misses = self.resets = 0

    def on_live(self, version: int) -> None:
        """The receiver's hook: the old weights' entries go before any request reads v."""
        self.entries.clear()
        self.resets += 1

    def hidden(self, model: torch.nn.Module, prefix: tuple[int, ...]) -> torch.Tensor:
        cached = self.entries.get(prefix)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        computed = forward(model, prefix)
        self.entries[prefix] = computed
        return computed


@torch.no_grad()
def forward(model: torch.nn.Module, prefix: tuple[int, ...]) -> torch.Tensor:
    hidden: torch.Tensor = model(torch.tensor(prefix))
    return hidden.sum(0)


async def main() -> None:
    trainer_model, engine_model = make_model(), make_model()
    cache = PrefixCache()
    stale = served = 0
    config = SenderConfig(buffer_bytes=1 << 16, num_buffers=2, timeout=60)
    receiver = WeightReceiver(ModuleSink(engine_model, staged=True), on_live=cache.on_live)

    async def request(prefix: tuple[int, ...]) -> None:
        nonlocal stale, served
        async with receiver.serving():  # the weights stay one version for the request
            got = cache.hidden(engine_model, prefix)
            await anyio.sleep(0.001)  # generation takes a while; versions arrive meanwhile
            if not torch.equal(got, forward(engine_model, prefix)):
                stale += 1  # an entry computed by other weights than the ones read
            served += 1

    async def requests(stop: anyio.Event) -> None:
        pick = random.Random(0)
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                tg.start_soon(request, pick.choice(PROMPTS))
                await anyio.sleep(0.0005)

    async with receiver, WeightSender(receiver.endpoint, config=config) as trainer:
        await trainer.send(trainer_model, version=0)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests, stop)
            for step in range(1, 5):
                with torch.no_grad():
                    for p in trainer_model.parameters():
                        p.add_(0.01 * torch.randn_like(p))
                await anyio.sleep(0.02)  # requests fill the cache
                await trainer.send(trainer_model, version=step)
                print(f"version {step} live; cache reset {cache.resets} times")
            await anyio.sleep(0.02)
            stop.set()
    print(f"{served} requests, {cache.hits} cache hits, {cache.misses} misses, {stale} stale")
    if stale or not cache.hits or cache.resets != 5:
        raise SystemExit("a request read a cache entry computed by other weights")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run(main)
