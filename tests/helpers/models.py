"""Small models and tensor sets shared by the tests."""

from __future__ import annotations

import torch


def mixed_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, one non-contiguous tensor and one larger than a small buffer."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 257, generator=g)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.q.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layer.0.norm.weight": torch.randn(32, generator=g).to(torch.float16),
        "layer.0.t.weight": torch.randn(48, 16, generator=g).t(),  # non-contiguous
        "layer.0.steps": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        "layer.0.mask": torch.rand(7, generator=g) > 0.5,
        "lm_head.weight": big,  # 308 KB: chunked across 64 KiB buffers
    }


def zeros_like(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh contiguous zero tensors with the same names, dtypes and shapes."""
    return {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in weights.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two name -> tensor maps."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (any device, any dtype): equal digests mean bit-exact."""
    import hashlib

    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()
