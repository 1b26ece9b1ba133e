"""A NeMo-RL-shaped policy worker: binds its REQ socket and streams through the drop-in.

``python -m tests.helpers.nemo_rl_bind_worker ADDRESS STEPS [DEVICE]`` binds a REQ socket at
``ADDRESS`` as
NeMo-RL's policy worker does (``zmq.Context().socket(zmq.REQ)``, its timeouts, ``bind``),
streams :func:`weights` of steps ``0 .. STEPS-1`` with ``stream_weights_via_ipc_zmq_impl``
and prints one JSON event a line: ``bound``, ``streamed`` (per step), then ``done`` or
``error``. The engine, a vLLM-shaped worker, connects to ``ADDRESS``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import torch
import zmq

from aiosync.compat.nemo_rl import release_ipc_zmq_streams, stream_weights_via_ipc_zmq_impl

BUFFER_BYTES = 1 << 16
SHAPES = {"embed.weight": (32, 8), "layer.weight": (8, 8), "layer.bias": (8,), "head": (3, 8)}


def weights(step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The policy's weights after ``step``: seeded, so either process can make them."""
    generator = torch.Generator().manual_seed(1000 + step)
    made = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    return {name: tensor.to(device) for name, tensor in made.items()}


def empty_model() -> dict[str, torch.Tensor]:
    """The engine's tensors before any version (zeros of the same shapes)."""
    return {name: torch.zeros(shape) for name, shape in SHAPES.items()}


class PolicyWorker:
    """What NeMo-RL's policy worker does with its socket, minus Ray."""

    def __init__(self, address: str, socket_type: int = zmq.REQ, device: str = "cpu") -> None:
        self.address = address
        self.socket_type = socket_type
        self.device = device
        self.zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.zmq_socket: zmq.Socket[bytes] | None = None

    def maybe_init_zmq(self) -> zmq.Socket[bytes]:
        """Create the socket once and bind it, as NeMo-RL does."""
        if self.zmq_socket is None:
            self.zmq_context = zmq.Context()
            self.zmq_socket = self.zmq_context.socket(self.socket_type)
            self.zmq_socket.setsockopt(zmq.SNDTIMEO, 120000)
            self.zmq_socket.setsockopt(zmq.RCVTIMEO, 120000)
            self.zmq_socket.setsockopt(zmq.LINGER, 0)
            self.zmq_socket.bind(self.address)
        return self.zmq_socket

    def stream_weights_via_ipc_zmq(self, step: int) -> None:
        """Stream one step's weights as a generator, as NeMo-RL passes them."""
        socket = self.maybe_init_zmq()
        params: Iterator[tuple[str, torch.Tensor]] = iter(weights(step, self.device).items())
        with contextlib.redirect_stdout(sys.stderr):  # rank 0 prints; stdout carries events
            stream_weights_via_ipc_zmq_impl(params, BUFFER_BYTES, socket, 0, "policy")

    def shutdown(self) -> None:
        """Release the drop-in's sender and close the socket."""
        if self.zmq_socket is not None:
            release_ipc_zmq_streams(self.zmq_socket)
            self.zmq_socket.close(linger=0)
        if self.zmq_context is not None:
            self.zmq_context.term()
        self.zmq_socket = self.zmq_context = None


def _say(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main(address: str, steps: int, device: str = "cpu") -> int:
    """Bind, stream ``steps`` versions, report each; 1 on an error."""
    worker = PolicyWorker(address, device=device)
    try:
        worker.maybe_init_zmq()
        _say("bound", address=address)
        for step in range(steps):
            worker.stream_weights_via_ipc_zmq(step)
            _say("streamed", step=step)
    except Exception as exc:
        _say("error", type=type(exc).__name__, message=str(exc))
        return 1
    finally:
        worker.shutdown()
    _say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4]))
