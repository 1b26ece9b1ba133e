"""Baselines and the physical floor for ``aiosync bench``.

What people commonly do today to move weights from a trainer process to an engine process on
one host, measured the same way the aiosync path is measured:

* :func:`measure_torch_save_zmq`: ``torch.save`` into memory, bytes over a ZMQ socket,
  ``torch.load(weights_only=True)`` and a by-name ``copy_`` into preallocated tensors.
* :func:`measure_safetensors_shm`: ``safetensors.torch.save_file`` into ``/dev/shm``,
  ``safetensors.torch.load_file`` and the same by-name ``copy_``.

The floors they are judged against are in :mod:`aiosync.bench.floors`, the model they move
in :mod:`aiosync.bench.model`.

The engine side runs in a separate process (:mod:`aiosync.bench.baseline_engine`); control
messages are JSON, never anything else. Both processes use one torch thread, for fairness on
small (2-core) machines.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
import zmq

from aiosync.bench.floors import torch_threads
from aiosync.bench.model import llama_shapes, tensor_digest, total_nbytes
from aiosync.core.layout import dtype_name
from aiosync.runtime import child_env, stop_process

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SHM_DIR",
    "SHM_PREFIX",
    "measure_safetensors_shm",
    "measure_torch_save_zmq",
]

#: Per-receive timeout (seconds) of the baseline control loop; generous for 1 GiB on 2 cores.
DEFAULT_TIMEOUT_S = 300.0
#: Where the safetensors baseline writes its file, and the file name prefix it uses.
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aiosync-bench-"

# --------------------------------------------------------------------------------------
# engine child process
# --------------------------------------------------------------------------------------


class _Engine:
    """Parent-side handle of one ``aiosync.bench.baseline_engine`` child over a ZMQ PAIR."""

    def __init__(
        self,
        mode: str,
        state_dict: Mapping[str, torch.Tensor],
        total_bytes: int | None,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        try:
            self._start(mode, state_dict, total_bytes)
        except BaseException:
            self.close()
            raise

    def _start(
        self, mode: str, state_dict: Mapping[str, torch.Tensor], total_bytes: int | None
    ) -> None:
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        dtypes = {t.dtype for t in state_dict.values()}
        layout: list[tuple[str, tuple[int, ...]]] = [
            (name, tuple(t.shape)) for name, t in state_dict.items()
        ]
        argv = [
            sys.executable,
            "-m",
            "aiosync.bench.baseline_engine",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
            "--mode",
            mode,
            "--timeout",
            str(self.timeout_s),
        ]
        if total_bytes is not None:
            # The engine allocates from llama_shapes(total_bytes, dtype): check that it will
            # get exactly this state dict's layout.
            if len(dtypes) != 1:
                raise ValueError("total_bytes needs a state dict of a single dtype")
            (dtype,) = dtypes
            if sorted(llama_shapes(total_bytes, dtype)) != sorted(layout):
                raise ValueError(
                    f"state_dict is not synthetic_state_dict({total_bytes}, {dtype})-shaped"
                )
            argv += ["--total-bytes", str(total_bytes), "--dtype", dtype_name(dtype)]
        env = child_env()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr
        )
        if total_bytes is None:
            self.send_json(
                {
                    "type": "layout",
                    "tensors": [
                        [name, list(t.shape), dtype_name(t.dtype)] for name, t in state_dict.items()
                    ],
                }
            )
        ready = self.recv_json()
        if ready.get("type") != "ready":
            raise RuntimeError(f"engine did not get ready: {ready}")
        log.debug("engine %s ready (pid %d): %s", mode, self._proc.pid, ready)

    def _child_output(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-4000:].decode(errors="replace")

    def send_json(self, msg: dict[str, Any], payload: Any = None) -> None:
        head = json.dumps(msg).encode()
        if payload is None:
            self.sock.send(head)
        else:
            self.sock.send_multipart([head, payload], copy=False)

    def recv_json(self) -> dict[str, Any]:
        """Receive one JSON reply, polling so that a dead or stuck child fails, not hangs."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.sock.poll(100, zmq.POLLIN):
                reply: dict[str, Any] = json.loads(self.sock.recv(zmq.NOBLOCK))
                if reply.get("type") == "error":
                    raise RuntimeError(f"engine failed: {reply.get('error')}")
                return reply
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self._proc.returncode}:\n{self._child_output()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no reply from engine within {self.timeout_s}s:\n{self._child_output()}"
                )

    def close(self) -> None:
        proc = self._proc
        try:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.send(json.dumps({"type": "exit"}).encode(), zmq.NOBLOCK)
                stop_process(proc, grace=5)
        finally:
            self.sock.close(linger=0)
            self._ctx.term()
            if self._stderr is not None:
                self._stderr.close()


def _summarise(
    name: str,
    nbytes: int,
    totals: list[float],
    trainer: list[float],
    engine: list[float],
    verified: bool,
) -> dict[str, Any]:
    seconds = statistics.median(totals)
    result: dict[str, Any] = {
        "seconds": seconds,
        "trainer_seconds": statistics.median(trainer),
        "engine_seconds": statistics.median(engine),
        "GBps": nbytes / seconds / 1e9,
        "bytes": nbytes,
        "repeats": len(totals),
        "all_seconds": totals,
        "verified": verified,
    }
    log.info(
        "%s: %d bytes in %.3f s (trainer %.3f s, engine %.3f s) = %.3f GB/s, verified=%s",
        name,
        nbytes,
        seconds,
        result["trainer_seconds"],
        result["engine_seconds"],
        result["GBps"],
        verified,
    )
    return result


def _check(state_dict: Mapping[str, torch.Tensor], repeats: int) -> int:
    if repeats <= 0:
        raise ValueError("repeats must be positive")
    if not state_dict:
        raise ValueError("empty state_dict")
    for name, t in state_dict.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name}: baselines take contiguous CPU tensors")
    return total_nbytes(state_dict)


def _verify(engine: _Engine, state_dict: Mapping[str, torch.Tensor]) -> bool:
    engine.send_json({"type": "digest"})
    theirs = engine.recv_json()["digest"]
    ours = tensor_digest(state_dict)
    if theirs != ours:
        log.error("engine digest %s != trainer digest %s", theirs, ours)
    return bool(theirs == ours)


# --------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------


def measure_torch_save_zmq(
    state_dict: Mapping[str, torch.Tensor],
    repeats: int = 3,
    *,
    total_bytes: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Baseline: ``torch.save`` -> bytes over ZMQ (loopback TCP) -> ``torch.load`` + ``copy_``.

    Per transfer, the trainer serialises ``state_dict`` with ``torch.save`` into an
    ``io.BytesIO`` and sends its buffer (zero-copy on the sending side) to the engine child,
    which ``torch.load(..., weights_only=True)`` loads it and copies every tensor by name into
    its preallocated tensors, then replies. The engine is started and has allocated its
    destination before timing starts.

    ``total_bytes``: when given, the engine allocates from ``llama_shapes(total_bytes,
    dtype)`` (passed on its argv) and ``state_dict`` must have exactly that layout; otherwise
    the layout is sent to it as JSON.

    Returns medians over ``repeats``: ``seconds`` (end to end: serialise + send + engine
    load/copy + reply), ``trainer_seconds`` (serialise + handing the bytes to ZMQ),
    ``engine_seconds`` (deserialise + copy, measured in the engine), ``GBps``
    (``bytes / seconds / 1e9``); plus ``bytes``, ``repeats``, ``all_seconds`` and
    ``verified`` (the engine's tensors are bit-identical to ``state_dict`` afterwards).
    """
    nbytes = _check(state_dict, repeats)
    totals: list[float] = []
    trainer: list[float] = []
    engine_s: list[float] = []
    with torch_threads(1):
        engine = _Engine("torch_save", state_dict, total_bytes, timeout_s)
        try:
            for i in range(repeats):
                t0 = time.perf_counter()
                buf = io.BytesIO()
                torch.save(dict(state_dict), buf)
                engine.send_json({"type": "load", "seq": i}, payload=buf.getbuffer())
                t1 = time.perf_counter()
                reply = engine.recv_json()
                t2 = time.perf_counter()
                if reply.get("seq") != i:
                    raise RuntimeError(f"unexpected engine reply {reply}")
                totals.append(t2 - t0)
                trainer.append(t1 - t0)
                engine_s.append(float(reply["engine_seconds"]))
                # The ZMQ frame may still reference the buffer; let GC free it later.
                del buf
            verified = _verify(engine, state_dict)
        finally:
            engine.close()
    return _summarise("torch.save+zmq", nbytes, totals, trainer, engine_s, verified)


def measure_safetensors_shm(
    state_dict: Mapping[str, torch.Tensor],
    repeats: int = 3,
    *,
    total_bytes: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Baseline: ``safetensors.torch.save_file`` to ``/dev/shm`` -> ``load_file`` + ``copy_``.

    Per transfer, the trainer writes ``state_dict`` to a fresh ``/dev/shm/aiosync-bench-*``
    file, sends its path (JSON over ZMQ) to the engine child, which loads it with
    ``safetensors.torch.load_file``, copies every tensor by name into its preallocated
    tensors and replies. The file is removed after every transfer and on any error.

    ``total_bytes`` and the returned keys are as in :func:`measure_torch_save_zmq`;
    ``trainer_seconds`` is the ``save_file`` time, ``engine_seconds`` load + copy.
    """
    from safetensors.torch import save_file

    nbytes = _check(state_dict, repeats)
    totals: list[float] = []
    trainer: list[float] = []
    engine_s: list[float] = []
    path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"
    with torch_threads(1):
        engine = _Engine("safetensors", state_dict, total_bytes, timeout_s)
        try:
            tensors = dict(state_dict)
            for i in range(repeats):
                try:
                    t0 = time.perf_counter()
                    save_file(tensors, str(path))
                    engine.send_json({"type": "load_file", "seq": i, "path": str(path)})
                    t1 = time.perf_counter()
                    reply = engine.recv_json()
                    t2 = time.perf_counter()
                finally:
                    path.unlink(missing_ok=True)
                if reply.get("seq") != i:
                    raise RuntimeError(f"unexpected engine reply {reply}")
                totals.append(t2 - t0)
                trainer.append(t1 - t0)
                engine_s.append(float(reply["engine_seconds"]))
            verified = _verify(engine, state_dict)
        finally:
            path.unlink(missing_ok=True)
            engine.close()
    return _summarise("safetensors+/dev/shm", nbytes, totals, trainer, engine_s, verified)
