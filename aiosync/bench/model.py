"""The synthetic Llama-shaped model that ``aiosync demo`` and ``aiosync bench`` stream.

Shapes follow Hugging Face Llama names and proportions, scaled to a byte budget; values
are deterministic for a seed, so two processes build the same model without talking.
:func:`tensor_digest` checks two copies bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
from collections.abc import Mapping

import torch

from aiosync.core.layout import dtype_name

# Largest vocabulary used; smaller models get ``32 * hidden`` so the embedding does not swamp
# the layers (a 1 GiB fp32 model is TinyLlama-sized: hidden ~1k, 16 layers, vocab 32k).
_MAX_VOCAB = 32000
_SIZE_TOLERANCE = 0.03


def _llama_config(n_params: int) -> tuple[int, int, int, int, int]:
    """Pick ``(hidden, kv_dim, intermediate, vocab, layers)`` totalling about ``n_params``.

    Among configurations within 3% of the target, the one whose depth is closest to
    ``hidden / 64`` (a Llama-like aspect ratio) wins; if none is that close (tiny targets),
    the closest one does.
    """
    best: tuple[float, int, int, int, int, int] | None = None
    closest: tuple[float, int, int, int, int, int] | None = None
    for hidden in range(16, 16384 + 1, 16):
        vocab = min(_MAX_VOCAB, 32 * hidden)
        kv_dim = hidden // 4
        inter = (7 * hidden // 2 + 15) // 16 * 16
        fixed = 2 * vocab * hidden + hidden
        per_layer = 2 * hidden * hidden + 2 * kv_dim * hidden + 3 * inter * hidden + 2 * hidden
        layers = min(256, max(1, round((n_params - fixed) / per_layer)))
        err = abs(fixed + layers * per_layer - n_params) / n_params
        cand = (err, hidden, kv_dim, inter, vocab, layers)
        if closest is None or err < closest[0]:
            closest = cand
        if err <= _SIZE_TOLERANCE:
            aspect = abs(math.log2(layers / (hidden / 64)))
            if best is None or aspect < best[0]:
                best = (aspect, hidden, kv_dim, inter, vocab, layers)
    chosen = best if best is not None else closest
    assert chosen is not None
    return chosen[1], chosen[2], chosen[3], chosen[4], chosen[5]


def llama_shapes(
    total_bytes: int, dtype: torch.dtype = torch.float32
) -> list[tuple[str, tuple[int, ...]]]:
    """Names (Hugging Face Llama naming) and shapes of a synthetic model of ~``total_bytes``.

    The model has an embedding, per layer q/k/v/o projections (grouped-query: k/v are a
    quarter of the width), gate/up/down MLP projections and two RMSNorm weights, a final norm
    and an untied ``lm_head``. The size is within ~3% of ``total_bytes`` for anything from a
    few MiB up (below ~1 MiB the smallest configuration is returned). Pure function of its
    arguments, so an engine process can allocate the same model without any data.
    """
    if total_bytes <= 0:
        raise ValueError(f"total_bytes must be positive, got {total_bytes}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return llama_layout(*_llama_config(max(1, total_bytes // itemsize)))


LLAMA3_8B = (4096, 1024, 14336, 128256, 32)
"""Llama-3-8B's ``(hidden, kv_dim, inter, vocab, layers)``: 291 tensors, 16.06 GB in bf16."""


def llama_layout(
    hidden: int, kv_dim: int, inter: int, vocab: int, layers: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Names (Hugging Face Llama naming) and shapes of a Llama of exactly these dimensions.

    An embedding, per layer q/k/v/o projections (k/v ``kv_dim`` wide), gate/up/down MLP
    projections and two RMSNorm weights, a final norm and an untied ``lm_head``.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def synthetic_state_dict(
    total_bytes: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Build a Llama-shaped state dict of ~``total_bytes`` (see :func:`llama_shapes`).

    Matrices are ``N(0, 0.02)``, norm weights ``U(0.9, 1.1)``; deterministic for a given
    ``seed`` and device type (one ``torch.Generator`` on ``device``, filled in name order).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in llama_shapes(total_bytes, dtype):
        t = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) == 1:
            t.uniform_(0.9, 1.1, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def small_state_dict(
    count: int, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """``count`` one-element fp32 tensors (the per-tensor cost case), deterministic for ``seed``."""
    values = torch.arange(count, dtype=torch.float32, device=device) + seed
    return {f"layers.{i}.scale": values[i : i + 1].clone() for i in range(count)}


def bench_state_dict(
    total_bytes: int, tensors: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The model a run streams: ``tensors`` small tensors if given, else Llama shapes."""
    if tensors:
        return small_state_dict(tensors, device)
    return synthetic_state_dict(total_bytes, device=device)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (the tensor must outlive it)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_digest needs contiguous CPU tensors")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """BLAKE2b hex digest over names, dtypes, shapes and raw bytes, in sorted-name order.

    Bit-exact: equal digests mean every tensor has the same name, dtype, shape and bytes.
    Independent of thread counts (unlike floating-point sums).
    """
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        header = json.dumps([name, dtype_name(t.dtype), list(t.shape)])
        h.update(header.encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def total_nbytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes held by all tensors of ``state_dict``."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())
