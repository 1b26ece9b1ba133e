"""Engine side of the ``aiosync bench`` baselines: ``python -m aiosync.bench.baseline_engine``.

Connects a ZMQ PAIR socket to the trainer (``--endpoint``), preallocates destination tensors
(from ``llama_shapes(--total-bytes, --dtype)``, or from a JSON ``layout`` message when no size
is given), replies ``ready``, then serves JSON control messages:

* ``load`` (+ one payload frame of ``torch.save`` bytes): ``torch.load(weights_only=True)``,
  copy by name, reply ``done`` with ``engine_seconds``;
* ``load_file`` (``path``): ``safetensors.torch.load_file``, copy by name, reply ``done``;
* ``digest``: reply the :func:`~aiosync.bench.model.tensor_digest` of the destination;
* ``exit``: leave.

Any failure is replied as ``{"type": "error"}`` before exiting non-zero. Every receive has a
timeout (``--timeout``), so an orphaned engine does not hang around.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch
import zmq

from aiosync.bench.model import llama_shapes, tensor_digest
from aiosync.core.layout import dtype_from_name


def _recv(sock: zmq.Socket[bytes], timeout_s: float) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        raise TimeoutError(f"no message from the trainer within {timeout_s}s")
    return sock.recv_multipart()


def _copy_by_name(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> None:
    """``load_state_dict``-like strict copy: same names, same shapes, ``copy_`` each."""
    if dst.keys() != src.keys():
        missing = sorted(dst.keys() - src.keys())[:5]
        unexpected = sorted(src.keys() - dst.keys())[:5]
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, t in src.items():
            d = dst[name]
            if d.shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(d.shape)}")
            d.copy_(t)


def _allocate(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    # zeros, not empty: the pages are faulted in before any timing starts.
    return {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in layout}


def serve(endpoint: str, mode: str, timeout_s: float, dst_spec: Any) -> None:
    """Run the engine loop until ``exit`` (see the module docstring)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    try:
        try:
            if dst_spec is None:
                msg = json.loads(_recv(sock, timeout_s)[0])
                if msg.get("type") != "layout":
                    raise ValueError(f"expected a layout message, got {msg.get('type')!r}")
                layout = [
                    (str(n), tuple(int(s) for s in shape), dtype_from_name(dt))
                    for n, shape, dt in msg["tensors"]
                ]
            else:
                total_bytes, dtype = dst_spec
                layout = [(n, shape, dtype) for n, shape in llama_shapes(total_bytes, dtype)]
            t0 = time.perf_counter()
            dst = _allocate(layout)
            ready = {
                "type": "ready",
                "tensors": len(dst),
                "alloc_seconds": time.perf_counter() - t0,
            }
            sock.send(json.dumps(ready).encode())
            while True:
                frames = _recv(sock, timeout_s)
                msg = json.loads(frames[0])
                kind = msg.get("type")
                if kind == "exit":
                    return
                if kind == "digest":
                    sock.send(json.dumps({"type": "digest", "digest": tensor_digest(dst)}).encode())
                    continue
                t0 = time.perf_counter()
                if kind == "load" and mode == "torch_save":
                    if len(frames) != 2:
                        raise ValueError("load needs exactly one payload frame")
                    src = torch.load(io.BytesIO(frames[1]), map_location="cpu", weights_only=True)
                    del frames
                elif kind == "load_file" and mode == "safetensors":
                    from safetensors.torch import load_file

                    src = load_file(msg["path"], device="cpu")
                else:
                    raise ValueError(f"unexpected message {kind!r} in mode {mode!r}")
                _copy_by_name(dst, src)
                del src
                elapsed = time.perf_counter() - t0
                done = {"type": "done", "seq": msg.get("seq"), "engine_seconds": elapsed}
                sock.send(json.dumps(done).encode())
        except Exception as exc:
            err = {"type": "error", "error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(zmq.ZMQError):
                sock.send(json.dumps(err).encode(), zmq.NOBLOCK)
            raise
    finally:
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Parse argv and serve; return the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m aiosync.bench.baseline_engine")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--mode", choices=["torch_save", "safetensors"], required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--total-bytes", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = None if args.total_bytes is None else (args.total_bytes, dtype_from_name(args.dtype))
    try:
        serve(args.endpoint, args.mode, args.timeout, spec)
    except Exception:
        traceback.print_exc()
        print("baseline engine failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
