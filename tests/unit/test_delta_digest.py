"""A version's digest: fixed by its definition, sensitive to every byte, order and boundary."""

from __future__ import annotations

import random

import pytest
import torch

from aiosync.delta import VersionDigest, version_digest
from aiosync.delta import digest as digest_module
from aiosync.delta.digest import ROW_BYTES, fmix64, fmix64_
from tests.helpers.deltas import KNOWN_DIGEST, known_version


def test_the_digest_of_a_known_version_is_fixed() -> None:
    assert version_digest(known_version()) == KNOWN_DIGEST
    assert version_digest(known_version(), key=1) == "c5f7f09b508ae09d"
    assert version_digest([]) == "6393d51c06c618dc"


def test_the_tensor_finaliser_is_the_integer_one() -> None:
    values = torch.randint(-(2**63), 2**63 - 1, (5000,), dtype=torch.int64)
    mixed = fmix64_(values.clone())
    assert [v % 2**64 for v in mixed.tolist()] == [fmix64(v) for v in values.tolist()]


def test_the_digest_is_of_bytes_whatever_their_dtype_or_strides() -> None:
    t = torch.randn(257, 129)
    assert version_digest([t]) == version_digest([t.view(torch.int32)])
    assert version_digest([t]) == version_digest([t.view(torch.uint8)])
    assert version_digest([t.t()]) == version_digest([t.t().contiguous()])


def flipped(tensors: list[torch.Tensor], which: int, byte: int, bit: int) -> list[torch.Tensor]:
    out = [t.clone() for t in tensors]
    raw = out[which].reshape(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit
    return out


def test_every_single_bit_flip_changes_the_digest() -> None:
    version = [torch.randn(64 * 1024), torch.randn(3), torch.randn(5000, 3)]  # rows, a tail
    reference = version_digest(version)
    rng = random.Random(5)
    sizes = [t.numel() * t.element_size() for t in version]
    places = [(0, 0), (0, ROW_BYTES - 1), (0, sizes[0] - 1), (1, 0), (1, 11), (2, sizes[2] - 1)]
    places += [(i, rng.randrange(sizes[i])) for i in rng.choices(range(3), k=150)]
    for which, byte in places:
        for bit in (0, 7) if byte % 2 else (rng.randrange(8),):
            assert version_digest(flipped(version, which, byte, bit)) != reference, (which, byte)


def test_order_and_boundaries_are_part_of_the_digest() -> None:
    a, b = torch.randn(40 * 1024), torch.randn(10 * 1024)
    assert version_digest([a, b]) != version_digest([b, a])
    rows = a.view(-1, ROW_BYTES // 4)
    swapped = rows[[1, 0, *range(2, len(rows))]]
    assert version_digest([rows]) != version_digest([swapped])
    joined = torch.cat([a, b])
    assert version_digest([joined]) != version_digest([a, b])
    assert version_digest([a[:1000], a[1000:]]) != version_digest([a[:1001], a[1001:]])
    assert version_digest([]) != version_digest([torch.empty(0)])
    assert version_digest([torch.empty(0)]) != version_digest([torch.empty(0), torch.empty(0)])


def test_a_key_gives_another_digest() -> None:
    version = [torch.randn(1000)]
    assert len({version_digest(version, key=k) for k in range(4)}) == 4


def test_the_digest_does_not_depend_on_how_its_work_is_cut() -> None:
    version = [torch.randn(n) for n in (100, 50_000, 3, 1024 * 18, 1024 * 17 - 1, 1)] * 3
    version += [torch.randn(5) for _ in range(1500)]  # more short rows than one staging block
    reference = version_digest(version)
    for block in (1, 40, 100, 1 << 12):
        digest = VersionDigest(block_rows=block)
        for t in version:
            digest.update(t)
        assert digest.hexdigest() == reference, block


def test_an_incremental_digest_reads_the_prefix_fed_so_far() -> None:
    version = [torch.randn(3000), torch.randn(70_000)]
    digest = VersionDigest()
    digest.update(version[0])
    assert digest.hexdigest() == version_digest(version[:1])
    digest.update(version[1])
    assert digest.hexdigest() == version_digest(version)


def test_the_exact_float_products_give_the_int8_products_digest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    version = known_version()

    def no_int_mm(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no int8 products here")

    monkeypatch.setattr(digest_module.torch, "_int_mm", no_int_mm)
    assert version_digest(version) == KNOWN_DIGEST
