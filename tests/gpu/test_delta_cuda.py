"""Deltas and digests on CUDA: the same bytes as on the CPU, bit for bit (aiosync.delta).

CPU twins: tests/unit/test_delta_codec.py, test_delta_hostile.py, test_delta_digest.py and
test_delta_base.py.
"""

from __future__ import annotations

import pytest
import torch

from aiosync.core.errors import AiosyncError
from aiosync.delta import BaseStore, apply_delta, encode_delta, encode_tensors, version_digest
from aiosync.delta.digest import COLUMNS, ROW_BYTES, first_stage_matrix, fmix64, fmix64_
from aiosync.delta.format import max_payload_bytes
from aiosync.delta.ops import flat_bits
from tests.conftest import requires_cuda
from tests.helpers.deltas import KNOWN_DIGEST, changed_copy, known_version, random_tensor

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8]
DENSITIES = [0.0, 1e-4, 0.03, 0.3, 1.0]
CHUNK = 4096


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(flat_bits(a.cpu()), flat_bits(b.cpu()))


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_cuda_delta_is_the_cpu_delta_and_applies_bit_for_bit(
    dtype: torch.dtype, density: float
) -> None:
    base = random_tensor((3, 70_001), dtype, seed=1)
    new, _ = changed_copy(base, density, seed=2)
    on_cpu = encode_delta(new, base, chunk_bytes=CHUNK)
    on_gpu = encode_delta(new.cuda(), base.cuda(), chunk_bytes=CHUNK)
    assert on_gpu.payload.is_cuda
    assert on_gpu.header.to_bytes() == on_cpu.header.to_bytes()
    assert torch.equal(on_gpu.payload.cpu(), on_cpu.payload)
    target = base.cuda()
    apply_delta(target, on_gpu.header.to_bytes(), on_gpu.payload, tensor="w", version=1)
    assert same_bits(target, new)
    from_host = base.cuda()
    apply_delta(from_host, on_cpu.header, on_cpu.payload)  # payload copied over
    assert same_bits(from_host, new)


def test_a_base_in_host_memory_is_diffed_on_the_device() -> None:
    base = random_tensor((1 << 20,), torch.bfloat16, seed=3)
    new, _ = changed_copy(base, 0.04, seed=4)
    delta = encode_delta(new.cuda(), base.pin_memory())
    assert torch.equal(delta.payload.cpu(), encode_delta(new, base).payload)


def test_encoding_ahead_on_the_device_gives_the_same_deltas() -> None:
    pairs = []
    for i, shape in enumerate([(4096, 1024), (7,), (0,), (3, 100_003), (1 << 22,)]):
        base = random_tensor(shape, torch.bfloat16, seed=10 + i)
        pairs.append((changed_copy(base, 0.04, seed=20 + i)[0].cuda(), base.cuda()))
    outs = [
        torch.empty(max_payload_bytes(b.numel(), b.dtype), dtype=torch.uint8, device="cuda")
        for _, b in pairs
    ]
    for (new, base), delta in zip(pairs, encode_tensors(pairs, outs), strict=True):
        one = encode_delta(new.cpu(), base.cpu())
        assert delta.header.to_bytes() == one.header.to_bytes()
        assert torch.equal(delta.payload.cpu(), one.payload)
        target = base.clone()
        apply_delta(target, delta.header, delta.payload)
        assert same_bits(target, new)


def test_refused_deltas_leave_a_cuda_base_untouched() -> None:
    base = torch.zeros(300, dtype=torch.float32)
    new = base.clone()
    new[[3, 70, 71, 200, 290]] = 1.0
    delta = encode_delta(new, base, chunk_bytes=256)
    at, n = delta.header.sections.positions
    cases = []
    for positions in ([64, 6, 7, 8, 34], [3, 7, 6, 8, 34], [3, 6, 6, 8, 34], [3, 6, 7, 8, 44]):
        bad = delta.payload.clone()
        bad[at : at + 4 * n].view(torch.int32).copy_(torch.tensor(positions))
        cases.append((delta.header.to_bytes(), bad))
    cases.append((delta.header.to_bytes(), delta.payload[:-1]))
    cases.append((delta.header.to_bytes()[:-1], delta.payload))
    for header, payload in cases:
        target = base.cuda()
        with pytest.raises(AiosyncError):
            apply_delta(target, header, payload.cuda(), tensor="w", version=2)
        assert not target.any()


def test_the_digest_on_cuda_is_the_digest_on_the_cpu() -> None:
    assert version_digest([t.cuda() for t in known_version()]) == KNOWN_DIGEST
    gen = torch.Generator().manual_seed(0)
    version = [torch.randn(n, generator=gen) for n in (1, 100, 1024 * 17 - 1, 1 << 22)]
    version += [torch.randn(5, generator=gen) for _ in range(1500)]
    version.append(random_tensor((4096, 4096), torch.bfloat16, seed=5))
    assert version_digest([t.cuda() for t in version]) == version_digest(version)


def test_the_finaliser_and_the_int8_products_on_cuda_are_exact() -> None:
    values = torch.randint(-(2**63), 2**63 - 1, (100_000,), dtype=torch.int64)
    on_gpu = fmix64_(values.cuda()).cpu()
    assert [v % 2**64 for v in on_gpu.tolist()[:2000]] == [
        fmix64(v) for v in values.tolist()[:2000]
    ]
    assert torch.equal(on_gpu, fmix64_(values.clone()))
    rows = torch.randint(-128, 128, (4096, ROW_BYTES), dtype=torch.int8)
    matrix_t = first_stage_matrix(0).t()
    out = torch.empty(4096, COLUMNS, dtype=torch.int32, device="cuda")
    torch._int_mm(rows.cuda(), matrix_t.cuda(), out=out)  # the fast path runs here, no fallback
    assert torch.equal(out.cpu(), (rows.double() @ matrix_t.double()).to(torch.int32))


@pytest.mark.parametrize("keep", ["device", "host"])
def test_a_base_store_keeps_cuda_versions_on_the_device_or_in_pinned_memory(keep: str) -> None:
    tensors = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
    store = BaseStore(keep, versions=1)  # type: ignore[arg-type]
    store.reserve(tensors)
    kept = store.keep(1, tensors)
    copy = kept.tensors["w"]
    assert copy.is_cuda == (keep == "device")
    assert copy.is_cuda or copy.is_pinned()
    assert kept.digest == version_digest([t.cpu() for t in tensors.values()])
    torch.cuda.synchronize()
    assert torch.equal(copy.cpu(), tensors["w"].cpu())
