"""vLLM-style fused targets on a ``CallbackSink``: q/k/v into qkv_proj, gate/up into gate_up.

    python examples/fused_targets.py

The trainer has separate ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj``
weights; the engine, like vLLM, holds one fused ``qkv_proj`` and one ``gate_up_proj``.
The engine's ``load_weights`` (the shape of vLLM's) copies each incoming tensor into its
slice of the fused tensor, as vLLM's ``stacked_params_mapping`` does. After each version
the fused engine must compute exactly what the trainer computes; the script exits
non-zero otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from aiosync import CallbackSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run

HIDDEN, HEADS_Q, KV, FFN = 64, 64, 32, 128  # q is wider than k and v (grouped-query)

# sender's name piece -> (engine's fused name piece, the shard it fills)
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# rows of each shard in its fused weight: (start, length)
SHARDS = {
    "q": (0, HEADS_Q),
    "k": (HEADS_Q, KV),
    "v": (HEADS_Q + KV, KV),
    "gate": (0, FFN),
    "up": (FFN, FFN),
}


class Trainer(nn.Module):
    """Unfused projections, as a training framework (Hugging Face) holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS_Q, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mlp = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return torch.cat([qkv, mlp], dim=-1)


class Engine(nn.Module):
    """Fused projections, as an inference engine (vLLM) holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, HEADS_Q + 2 * KV, bias=False)
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        gate, up = self.gate_up_proj(x).split(FFN, dim=-1)
        return torch.cat([self.qkv_proj(x), nn.functional.silu(gate) * up], dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into its slice of a fused parameter, or into its own one."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:  # views of shared memory: copied, never kept
                *parents, piece, leaf = name.split(".")
                if piece in STACKED:
                    fused, shard = STACKED[piece]
                    start, length = SHARDS[shard]
                    target = params[".".join([*parents, fused, leaf])]
                    target[start : start + length].copy_(tensor)
                else:
                    params[name].copy_(tensor)


async def main() -> None:
    torch.manual_seed(0)
    trainer, engine = Trainer(), Engine()
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    config = SenderConfig(buffer_bytes=1 << 16, num_buffers=2, timeout=10)
    probe = torch.randn(4, HIDDEN)
    async with (
        WeightReceiver(CallbackSink(engine.load_weights)) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        for step in range(3):
            loss = trainer(torch.randn(8, HIDDEN)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await sender.send(trainer, version=step)
            with torch.no_grad():
                # weights bit-exact; outputs up to GEMM rounding (fused shapes differ)
                same = torch.allclose(trainer(probe), engine(probe), rtol=1e-5, atol=1e-6)
                same = same and torch.equal(
                    engine.qkv_proj.weight,
                    torch.cat(
                        [trainer.q_proj.weight, trainer.k_proj.weight, trainer.v_proj.weight]
                    ),
                )
                same = same and torch.equal(
                    engine.gate_up_proj.weight,
                    torch.cat([trainer.gate_proj.weight, trainer.up_proj.weight]),
                )
            print(f"version {receiver.current_version}: fused engine matches trainer: {same}")
            if not same:
                raise SystemExit("the fused engine differs from the trainer")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run(main)
