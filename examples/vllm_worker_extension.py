"""A synchronous vLLM-style worker receiving weights, as NeMo-RL's vLLM worker extension does.

    python examples/vllm_worker_extension.py

vLLM workers are plain synchronous objects: the engine calls their methods (through
``collective_rpc`` in NeMo-RL) and waits. The worker below keeps an aiosync receiver in a
background thread (:class:`aiosync.BackgroundReceiver`) that hands each bucket to the
model's ``load_weights(pairs)``; ``update_weights_from_ipc`` blocks until the trainer's
version has committed. The trainer is a thread calling NeMo-RL's blocking
``stream_weights_via_ipc_zmq_impl`` on a DEALER socket. No async code anywhere here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
import zmq

from aiosync import BackgroundReceiver
from aiosync.compat.nemo_rl import stream_weights_via_ipc_zmq_impl


class VllmModel(torch.nn.Module):
    """Stands in for the vLLM model: a ``load_weights`` that copies what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 256)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each tensor into the parameter of that name (the tensors are borrowed)."""
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class WorkerExtension:
    """The worker's weight-update methods, in the shape of NeMo-RL's vLLM worker extension."""

    def __init__(self, model: VllmModel) -> None:
        self.model = model
        self.receiver: BackgroundReceiver | None = None

    def init_weight_receiver(self) -> str:
        """Start receiving in the background; returns the address to give the trainer."""
        self.receiver = BackgroundReceiver(self.model.load_weights)
        self.receiver.__enter__()
        return self.receiver.endpoint

    def update_weights_from_ipc(self, version: int, timeout: float = 30.0) -> bool:
        """Block until ``version`` (or a later one) is loaded; True once it is."""
        assert self.receiver is not None, "call init_weight_receiver first"
        self.receiver.wait_for_version(version, timeout)
        return True

    def shutdown(self) -> None:
        """Stop the background receiver (raises if it had failed)."""
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            receiver.__exit__(None, None, None)


def train(policy: torch.nn.Module, endpoint: str, steps: int, errors: list[BaseException]) -> None:
    """The trainer thread: an optimizer step, then NeMo-RL's blocking stream, per version."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        for _ in range(steps):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            stream_weights_via_ipc_zmq_impl(
                policy.named_parameters(), 1 << 20, sock, rank=0, worker_name="policy"
            )
    except BaseException as exc:
        errors.append(exc)
    finally:
        sock.close(linger=0)
        ctx.term()


def main() -> None:
    """Two versions from a trainer thread into a synchronous worker; exit 1 if they differ."""
    torch.manual_seed(0)
    policy, engine_model = VllmModel(), VllmModel()
    worker = WorkerExtension(engine_model)
    endpoint = worker.init_weight_receiver()
    errors: list[BaseException] = []
    try:
        trainer = threading.Thread(target=train, args=(policy, endpoint, 2, errors))
        trainer.start()
        trainer.join(timeout=60)
        if errors or trainer.is_alive():
            raise SystemExit(f"trainer failed: {errors or 'still running'}")
        worker.update_weights_from_ipc(version=1, timeout=30)
    finally:
        worker.shutdown()
    for (name, sent), (_, got) in zip(
        policy.named_parameters(), engine_model.named_parameters(), strict=True
    ):
        if not torch.equal(sent, got):
            raise SystemExit(f"engine weights differ at {name}")
    print("worker received both versions bit-exact")


if __name__ == "__main__":
    main()
