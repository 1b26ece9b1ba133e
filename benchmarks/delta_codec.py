"""The delta codec on a Llama-3-8B-shaped bf16 version, beside its floor: one JSON object.

    python -m benchmarks.delta_codec [--device cuda] [--density 0.04] [--repeats 5]
                                     [--layers 32] [--vocab 128256] [--chunk-mb 1]

A base version (291 tensors, 16.06 GB in bf16 with the defaults; ``--layers`` and
``--vocab`` shrink it for a CPU) and a step that flips the lowest bit of ``--density`` of
its elements, chosen at random. Measured in one run, medians over ``--repeats`` after one
warm-up: the floor (a device copy of both versions, 2 x the dense bytes, tensor by tensor),
``aiosync.delta``'s encode (``encode_tensors``: compare, count, then write each chunk's
encoding) and decode (``apply_delta`` onto a copy of the base, checks included), a naive
torch encode for reference (compare, ``nonzero``, gather: int32 positions and values), and
the version's digest. Every decoded tensor is compared with the new version bit for bit.
``encode_flat_s`` and ``decode_flat_s`` treat the same bytes as one flat tensor cut in
spans of 1 GiB (16 chunk tables and waits instead of 291): against the per-tensor figures
they show the host's share.
``cost_model`` is what :func:`aiosync.delta.cost.choose` makes of the measured rates over
a device copy at the floor's rate and over a 10 Gb/s link. GB are 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout
from aiosync.delta import (
    Rates,
    Step,
    apply_delta,
    choose,
    encode_delta,
    encode_tensors,
    version_digest,
)
from aiosync.delta.encode import EncodedDelta
from aiosync.delta.ops import flat_bits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Result = TypeVar("Result")


def _timed(run: Callable[[], Result], device: torch.device, repeats: int) -> tuple[float, Result]:
    """The median seconds of ``repeats`` runs after a warm-up, and the last run's result."""
    result = run()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _versions(
    shapes: list[tuple[str, tuple[int, ...]]], density: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Both versions as flat buffers and as the model's tensors (views of them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(math.prod(shape) for _, shape in shapes)
    flat_base = torch.empty(total, dtype=torch.bfloat16, device=device)
    flat_new = torch.empty_like(flat_base)
    base, new = [], []
    at = 0
    for _, shape in shapes:
        n = math.prod(shape)
        b = flat_base[at : at + n].view(shape).normal_(0, 0.02, generator=gen)
        t = flat_new[at : at + n].view(shape)
        t.copy_(b)
        bits = flat_bits(t)
        flip = torch.rand(bits.shape, generator=gen, device=device) < density
        bits ^= flip.to(bits.dtype)
        del flip
        base.append(b)
        new.append(t)
        at += n
    return flat_base, flat_new, base, new


def _naive_encode(
    new: list[torch.Tensor], base: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for n, b in zip(new, base, strict=True):
        nb, bb = flat_bits(n), flat_bits(b)
        where = (nb != bb).nonzero().view(-1)
        out.append((where.to(torch.int32), nb[where]))
    return out


def _flat_case(
    flat_new: torch.Tensor, flat_base: torch.Tensor, chunk_bytes: int, repeats: int
) -> tuple[float, float, bool]:
    """Encode and decode times of the version as one flat tensor, and whether it is exact.

    The tensor is cut in spans of 1 GiB (whole chunks).
    """
    device, numel = flat_new.device, flat_new.numel()
    span = (1 << 30) // chunk_bytes * chunk_bytes // flat_new.element_size()
    starts = range(0, numel, span)

    def encode() -> list[EncodedDelta]:
        return [
            encode_delta(
                flat_new, flat_base, start=at, count=min(span, numel - at), chunk_bytes=chunk_bytes
            )
            for at in starts
        ]

    encode_s, spans = _timed(encode, device, repeats)
    work = flat_base.clone()

    def decode() -> None:  # applied again and again: the same bytes each time
        for delta in spans:
            apply_delta(work, delta.header, delta.payload)

    decode_s, _ = _timed(decode, device, repeats)
    return encode_s, decode_s, torch.equal(flat_bits(work), flat_bits(flat_new))


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--density", type=float, default=0.04)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=LLAMA3_8B[4])
    parser.add_argument("--vocab", type=int, default=LLAMA3_8B[3])
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    hidden, kv_dim, inter, _, _ = LLAMA3_8B
    shapes = llama_layout(hidden, kv_dim, inter, args.vocab, args.layers)
    flat_base, flat_new, base, new = _versions(shapes, args.density, device)
    dense = sum(t.nbytes for t in new)
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    biggest = max(new, key=lambda t: t.nbytes)
    scratch = torch.empty_like(biggest)

    def copy_both() -> None:
        for version in (base, new):
            for t in version:
                scratch.view(-1)[: t.numel()].copy_(t.view(-1))

    def encode() -> list[EncodedDelta]:
        return list(encode_tensors(zip(new, base, strict=True), chunk_bytes=chunk_bytes))

    floor_s, _ = _timed(copy_both, device, args.repeats)
    encode_s, deltas = _timed(encode, device, args.repeats)
    naive_s, naive = _timed(lambda: _naive_encode(new, base), device, args.repeats)
    naive_bytes = sum(p.nbytes + v.nbytes for p, v in naive)
    del naive
    flat_s, flat_decode_s, flat_exact = _flat_case(flat_new, flat_base, chunk_bytes, args.repeats)
    work = [b.clone() for b in base]
    decode_times = []
    for _ in range(args.repeats + 1):
        for w, b in zip(work, base, strict=True):
            w.copy_(b)
        _sync(device)
        start = time.perf_counter()
        for i, (w, d) in enumerate(zip(work, deltas, strict=True)):
            apply_delta(w, d.header, d.payload, tensor=shapes[i][0], version=1)
        _sync(device)
        decode_times.append(time.perf_counter() - start)
    decode_s = statistics.median(decode_times[1:])
    exact = flat_exact and all(
        torch.equal(flat_bits(w), flat_bits(n)) for w, n in zip(work, new, strict=True)
    )
    del work
    digest_s, _ = _timed(lambda: version_digest(new), device, args.repeats)
    delta_bytes = sum(d.nbytes for d in deltas)
    changed = sum(d.changed for d in deltas)
    kinds: dict[str, int] = {}
    for d in deltas:
        for kind, n in d.chunks_by_kind().items():
            kinds[kind] = kinds.get(kind, 0) + n
    step = Step(dense, 2, changed / (dense // 2), delta_bytes=delta_bytes)
    encode_gbps, decode_gbps = dense / encode_s / 1e9, dense / decode_s / 1e9
    links = {"device_copy": dense / (floor_s / 2) / 1e9, "tcp_10Gbps": 1.25}
    cost_model = {}
    for link, rate in links.items():
        choice = choose(step, Rates(rate, encode_gbps, decode_gbps))
        cost_model[link] = {
            "link_GBps": round(rate, 2),
            "choice": choice.kind,
            "delta_s": round(choice.delta_s, 5),
            "dense_s": round(choice.dense_s, 5),
        }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tensors": len(new),
        "dense_bytes": dense,
        "density": round(changed / (dense // 2), 5),
        "delta_bytes": delta_bytes,
        "delta_over_dense": round(delta_bytes / dense, 4),
        "naive_bytes": naive_bytes,
        "chunks": kinds,
        "floor_copy_both_s": round(floor_s, 5),
        "encode_s": round(encode_s, 5),
        "encode_over_floor": round(encode_s / floor_s, 2),
        "naive_encode_s": round(naive_s, 5),
        "encode_flat_s": round(flat_s, 5),
        "decode_s": round(decode_s, 5),
        "decode_flat_s": round(flat_decode_s, 5),
        "digest_s": round(digest_s, 5),
        "digest_GBps": round(dense / digest_s / 1e9, 1),
        "bit_exact": exact,
        "cost_model": cost_model,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
