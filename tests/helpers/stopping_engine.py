"""An engine process that stops itself before one message of each version.

``python -m tests.helpers.stopping_engine`` serves twelve float32[4096] tensors through a staged
sink and prints JSON lines: ``ready`` (with its endpoint); ``stopping`` just before the
engine takes message ``v`` of version ``v`` (1: the begin, then each bucket, the completion
and the commit), as it sends itself SIGSTOP, for every version but 0 (the test sends
SIGCONT); and ``outcome`` once such a version's stream ended, ``live`` saying whether the
engine made it live.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import anyio
import torch

from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
from aiosync.core.engine_actions import Action, Peer
from aiosync.core.engine_session import EngineSession
from aiosync.core.wire import Begin, Bucket, Commit, Complete, Message
from aiosync.runtime import run

_printing = threading.Lock()  # on_commit runs in a worker thread


def emit(event: str, **fields: object) -> None:
    with _printing:
        print(json.dumps({"event": event, **fields}), flush=True)


def stop_before_each_message() -> None:
    """Make the engine's machine stop the process before message ``v`` of version ``v``."""
    receive = EngineSession.receive
    counts: dict[int, int] = {}

    def stopping(self: EngineSession, peer: Peer, message: Message, now: float) -> list[Action]:
        if isinstance(message, Begin | Bucket | Complete | Commit) and message.version > 0:
            count = counts[message.version] = counts.get(message.version, 0) + 1
            if count == message.version:
                emit("stopping", version=message.version, message=count)
                os.kill(os.getpid(), signal.SIGSTOP)
        return receive(self, peer, message, now)

    EngineSession.receive = stopping  # type: ignore[method-assign]


async def main() -> None:
    stop_before_each_message()
    model = {f"w{i}": torch.zeros(4096) for i in range(12)}
    told: set[int] = set()

    def outcome(version: int | None, live: bool) -> None:
        if version is not None and version > 0 and version not in told:
            told.add(version)
            emit("outcome", version=version, live=live)

    def committed(version: int) -> None:
        outcome(version, True)

    config = ReceiverConfig(stream_timeout=1.0, session_timeout=30.0, swap_timeout=0.5)
    sink = ModuleSink(model, staged=True)
    async with WeightReceiver(sink, config=config, on_commit=committed) as receiver:
        emit("ready", endpoint=receiver.endpoint)
        while True:
            for failure in receiver.failures:
                outcome(failure.version, False)
            await anyio.sleep(0.02)


if __name__ == "__main__":
    run(main)
