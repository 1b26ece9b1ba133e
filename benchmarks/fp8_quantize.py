"""FP8 quantize of Llama-3-8B against its floor: ``python -m benchmarks.fp8_quantize``.

Every tensor of Llama-3-8B's 291 (bf16, 16.06 GB; on a host without CUDA, a synthetic
Llama of ``--total-bytes``) is quantized into one preallocated e4m3 output and scales per
tensor, the whole model a turn: 2-D tensors in ``--format`` (128 x 128 blocks by default),
1-D ones per tensor (MX: all MX). Medians of ``--repeats`` turns after one warm-up, each in
one run of the same process:

- ``fast_ms``: :func:`~aiosync.transforms.fp8.quantize_into` as the packer calls it
  (``kernel="auto"``: the Triton kernel where it runs; ``kernel`` says which ran);
- ``torch_ms``: the same with ``kernel="torch"``;
- ``naive_ms``: blocks only, the obvious torch code (pad, widen to fp32, ``abs().amax``,
  divide, cast), allocating its temporaries and output;
- ``floor_ms``: the bandwidth floor, a device copy of the same bytes (``out.copy_(x)``: reads
  the bf16 and writes one byte an element, per tensor, with the same launches).

``fast_bit_exact`` says the fast and torch outputs were equal byte for byte. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from aiosync.bench.model import LLAMA3_8B, llama_layout, llama_shapes
from aiosync.transforms.fp8 import Kernel, quantize_into
from aiosync.transforms.fp8_formats import BLOCK_SIDE, E4M3_MAX, MIN_SCALE, Fp8Format, scale_shape
from aiosync.transforms.fp8_triton import triton_can_run

CPU_BYTES = 64 << 20


class Model:
    """The source tensors and, for each, its format and destination views."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], fmt: Fp8Format, device: str):
        gen = torch.Generator(device=device).manual_seed(0)
        self.sources = [
            torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
            for _, shape in shapes
        ]
        self.formats = [
            fmt if fmt is Fp8Format.MX or len(shape) == 2 else Fp8Format.TENSOR
            for _, shape in shapes
        ]
        self.outs = [torch.empty_like(s, dtype=torch.float8_e4m3fn) for s in self.sources]
        self.scales = [
            torch.empty(
                scale_shape(f, tuple(s.shape)),
                dtype=torch.uint8 if f is Fp8Format.MX else torch.float32,
                device=device,
            )
            for f, s in zip(self.formats, self.sources, strict=True)
        ]

    def quantize(self, kernel: Kernel) -> None:
        """Quantize every tensor into its destination."""
        for source, fmt, out, scales in zip(
            self.sources, self.formats, self.outs, self.scales, strict=True
        ):
            quantize_into(source, fmt, out, scales, kernel=kernel)

    def copy(self) -> None:
        """The floor: each source cast into its e4m3 output, no scaling."""
        for source, out in zip(self.sources, self.outs, strict=True):
            out.copy_(source)

    def naive(self) -> None:
        """Blocks the obvious way, 1-D tensors left out (a few MB)."""
        for source in self.sources:
            if source.dim() == 2:
                naive_block_quantize(source)

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every output's bytes and scales."""
        return [t.view(torch.uint8).clone() for t in self.outs] + [s.clone() for s in self.scales]

    def equals(self, snapshot: list[torch.Tensor]) -> bool:
        """Whether the outputs are byte for byte ``snapshot`` (NaN scales matching NaN)."""
        now = [t.view(torch.uint8) for t in self.outs] + self.scales
        return all(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))
            for a, b in zip(now, snapshot, strict=True)
        )


def naive_block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 block e4m3 as plain torch code would: padded fp32 copy, temporaries."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, -cols % BLOCK_SIDE, 0, -rows % BLOCK_SIDE))
    blocks = padded.view(padded.shape[0] // BLOCK_SIDE, BLOCK_SIDE, -1, BLOCK_SIDE)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = (amax / E4M3_MAX).clamp(min=MIN_SCALE).masked_fill(amax == 0, 1.0)
    quantized = (blocks / scale).to(torch.float8_e4m3fn).view(padded.shape)[:rows, :cols]
    return quantized, scale.view(scale.shape[0], scale.shape[2])


def _median_ms(turn: Callable[[], None], repeats: int, device: str) -> float:
    turn()  # warm-up: kernels compiled, allocator primed
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            turn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            began = time.perf_counter()
            turn()
            times.append((time.perf_counter() - began) * 1e3)
    return round(float(statistics.median(times)), 3)


def measure(fmt: Fp8Format, repeats: int, total_bytes: int | None = None) -> dict[str, Any]:
    """Quantize times against the floor (see the module docstring); one JSON-ready dict."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and total_bytes is None:
        shapes = llama_layout(*LLAMA3_8B)
    else:
        shapes = llama_shapes(total_bytes or CPU_BYTES, torch.bfloat16)
    model = Model(shapes, fmt, device)
    read = sum(s.numel() * s.element_size() for s in model.sources)
    written = sum(o.numel() for o in model.outs) + sum(
        s.numel() * s.element_size() for s in model.scales
    )
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "format": fmt.value,
        "tensors": len(shapes),
        "bytes_read": read,
        "bytes_written": written,
        "kernel": "triton"
        if triton_can_run(model.sources[0]) and fmt is Fp8Format.BLOCK
        else "torch",
    }
    out["floor_ms"] = _median_ms(model.copy, repeats, device)
    out["torch_ms"] = _median_ms(lambda: model.quantize("torch"), repeats, device)
    reference = model.snapshot()
    out["fast_ms"] = _median_ms(lambda: model.quantize("auto"), repeats, device)
    out["fast_bit_exact"] = model.equals(reference)
    del reference
    if fmt is Fp8Format.BLOCK:
        out["naive_ms"] = _median_ms(model.naive, repeats, device)
        out["naive_over_floor"] = round(out["naive_ms"] / out["floor_ms"], 2)
    out["fast_over_floor"] = round(out["fast_ms"] / out["floor_ms"], 2)
    out["torch_over_floor"] = round(out["torch_ms"] / out["floor_ms"], 2)
    out["floor_gb_per_s"] = round((read + written) / out["floor_ms"] / 1e6, 1)
    return out


def main() -> None:
    """Parse the command line, measure, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--format", choices=[f.value for f in Fp8Format], default="block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--total-bytes", type=int, default=None, help="a synthetic Llama instead")
    args = parser.parse_args()
    print(json.dumps(measure(Fp8Format(args.format), args.repeats, args.total_bytes)), flush=True)


if __name__ == "__main__":
    main()
