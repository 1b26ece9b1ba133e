"""An engine process for the handle tests: ``python -m tests.helpers.handle_engine [options]``.

It holds ``mixed_weights`` shapes (zeros at start), one staged ModuleSink per rank
(``--ranks``), in an :class:`AiosyncEngine` served over a private ipc:// control channel,
and prints JSON lines: ``ready`` (with the endpoint), ``applying`` (rank, names) before
each bucket is applied, ``committed`` (rank, version, per-tensor digests) after each
commit, ``answered`` (success, message) after each bucket. ``--hang-in-apply`` blocks the
first apply (a stuck engine, for the test to kill or freeze). It exits when its stdin
closes. ``--device cuda:N`` holds the weights on that GPU (then use NCCL).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

import anyio
import anyio.to_thread
import torch

from aiosync import ModuleSink
from aiosync.channels.zmq import ZmqListener
from aiosync.core.layout import TensorSpec
from aiosync.handles import ObjectHandle, serve_engine
from aiosync.handles.engine import AiosyncEngine
from aiosync.runtime import run
from tests.helpers.models import digest, mixed_weights

_out = threading.Lock()


def emit(event: str, **fields: object) -> None:
    line = json.dumps({"event": event, **fields}) + "\n"
    with _out:  # one line at a time: every rank's thread reports
        sys.stdout.write(line)
        sys.stdout.flush()


class ReportingSink(ModuleSink):
    """A staged module sink that reports each bucket and commit (with digests)."""

    def __init__(self, rank: int, hang: bool, device: str = "cpu") -> None:
        self.model = {
            name: torch.zeros(t.shape, dtype=t.dtype, device=device)
            for name, t in mixed_weights().items()
        }
        super().__init__(self.model, staged=True)
        self.rank = rank
        self.hang = hang

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        emit("applying", rank=self.rank, names=[spec.name for spec in specs])
        if self.hang:
            threading.Event().wait()  # stuck for good: the test kills or freezes us
        super().apply_bucket(bucket, specs)

    def commit(self, version: int) -> None:
        super().commit(version)
        digests = {name: digest(t) for name, t in self.model.items()}
        emit("committed", rank=self.rank, version=version, digests=digests)


class ReportingEngine(AiosyncEngine):
    """Reports each bucket's answer (``answered``: success, message)."""

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        success, message = super().update_weights_from_distributed(*args, **kwargs)
        emit("answered", success=success, message=message)
        return success, message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--name", default="engine")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--hang-in-apply", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sinks = [ReportingSink(rank, args.hang_in_apply, args.device) for rank in range(args.ranks)]
    engine = ReportingEngine(sinks, name=args.name, timeout=args.timeout)

    async def serve() -> None:
        listener = ZmqListener.open()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_engine, listener, ObjectHandle(engine, name=args.name))
                emit("ready", endpoint=listener.endpoint)
                await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
                tg.cancel_scope.cancel()
        finally:
            await listener.aclose()
            engine.close()

    run(serve)


if __name__ == "__main__":
    main()
