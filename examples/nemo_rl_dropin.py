"""NeMo-RL's `stream_weights_via_ipc_zmq_impl`, called the blocking way, to an aiosync engine.

    python examples/nemo_rl_dropin.py

The trainer side is plain synchronous code with a REQ socket, as in NeMo-RL's policy
worker; the engine is an aiosync receiver running in a background thread's event loop.
"""

from __future__ import annotations

import threading

import anyio
import torch
import zmq

from aiosync import ModuleSink, WeightReceiver
from aiosync.compat.nemo_rl import stream_weights_via_ipc_zmq_impl
from aiosync.runtime import run


def main() -> None:
    policy = torch.nn.Linear(512, 512)
    engine_model = torch.nn.Linear(512, 512)
    ready = threading.Event()
    stop = threading.Event()
    endpoint: list[str] = []

    async def engine() -> None:
        async with WeightReceiver(ModuleSink(engine_model)) as receiver:
            endpoint.append(receiver.endpoint)
            ready.set()
            await anyio.to_thread.run_sync(stop.wait)  # serve until main() is done

    thread = threading.Thread(target=run, args=(engine,))
    thread.start()
    try:
        if not ready.wait(timeout=30):
            raise SystemExit("engine did not start")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.connect(endpoint[0])
        try:
            stream_weights_via_ipc_zmq_impl(
                policy.named_parameters(), 1 << 20, sock, rank=0, worker_name="policy"
            )
        finally:
            sock.close(linger=0)
            ctx.term()
    finally:
        stop.set()
        thread.join(timeout=30)
    if not torch.equal(policy.weight, engine_model.weight):
        raise SystemExit("engine weights differ")
    print("engine received the policy's weights bit-exact")


if __name__ == "__main__":
    main()
