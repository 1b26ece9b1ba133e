"""The cost model picks delta or dense per engine from measured rates (aiosync.delta.cost)."""

from __future__ import annotations

import math

import pytest
import torch

from aiosync.delta import Rates, Step, choose, choose_per_engine, encode_delta
from aiosync.delta.cost import dense_seconds, estimated_delta_bytes
from tests.helpers.deltas import changed_copy, random_tensor

GIB_FP32_3PCT = Step(dense_bytes=1 << 30, itemsize=4, density=0.03)
SHARED_MEMORY = Rates(link_gbps=10.0, encode_gbps=6.0, decode_gbps=8.0)
"""One host: a copy into shared memory at memcpy speed; the encoder reads both versions
from the same memory, so it cannot go faster than the copy."""
TCP_10G = Rates(link_gbps=1.25, encode_gbps=6.0, decode_gbps=8.0)
"""The same host's encoder and engine's decoder, over a 10 Gb/s link."""


def test_shared_memory_on_one_host_sends_dense_at_realistic_densities() -> None:
    for density in (1e-4, 0.01, 0.03, 0.1, 0.3):
        choice = choose(Step(1 << 30, 4, density), SHARED_MEMORY)
        assert choice.kind == "dense", density
        assert choice.dense_s == pytest.approx((1 << 30) / 10e9)


def test_a_10_gbps_link_at_3_percent_sends_a_delta() -> None:
    choice = choose(GIB_FP32_3PCT, TCP_10G)
    assert choice.kind == "delta"
    assert choice.delta_bytes < 0.07 * choice.dense_bytes  # 8 bytes per change or 1/32 + 3%
    assert choice.delta_s == pytest.approx((1 << 30) / 6e9)  # the encoder is the slowest stage
    assert choice.dense_s == pytest.approx((1 << 30) / 1.25e9)


def test_a_version_where_everything_changed_goes_dense() -> None:
    assert choose(Step(1 << 30, 2, 1.0), TCP_10G).kind == "dense"
    slow = Rates(link_gbps=0.01, encode_gbps=100.0, decode_gbps=100.0)
    assert choose(Step(1 << 30, 2, 1.0), slow).kind == "dense"  # equal bytes: dense


def test_an_encoder_no_faster_than_the_link_never_pays() -> None:
    for link in (0.5, 5.0, 50.0, 2000.0):
        for density in (0.0, 1e-3, 0.04, 0.5):
            rates = Rates(link_gbps=link, encode_gbps=link, decode_gbps=10 * link)
            assert choose(Step(1 << 28, 2, density), rates).kind == "dense"


def test_without_overlap_the_stages_add_up() -> None:
    serial = Rates(link_gbps=1.25, encode_gbps=6.0, decode_gbps=8.0, overlapped=False)
    choice = choose(GIB_FP32_3PCT, serial)
    n, d = 1 << 30, choice.delta_bytes
    assert choice.delta_s == pytest.approx(n / 6e9 + d / 1.25e9 + n / 8e9)
    assert choice.kind == "delta"
    # a fast link where the overlapped delta would win no longer does once stages add up
    fast = Rates(link_gbps=6.0, encode_gbps=12.0, decode_gbps=12.0)
    assert choose(GIB_FP32_3PCT, fast).kind == "delta"
    assert choose(GIB_FP32_3PCT, Rates(6.0, 12.0, 12.0, overlapped=False)).kind == "dense"


def test_the_engines_apply_and_message_costs_count() -> None:
    slow_apply = Rates(link_gbps=10.0, encode_gbps=40.0, decode_gbps=40.0, apply_gbps=2.0)
    assert choose(GIB_FP32_3PCT, slow_apply).kind == "delta"  # dense is bound by the apply
    per_message = Rates(1.25, 6.0, 8.0, message_s=0.01, message_bytes=1 << 20)
    assert dense_seconds(GIB_FP32_3PCT, per_message) == pytest.approx(
        (1 << 30) / 1.25e9 + 1024 * 0.01
    )


def test_each_engine_is_judged_by_its_own_path() -> None:
    choices = choose_per_engine(GIB_FP32_3PCT, {"local": SHARED_MEMORY, "remote": TCP_10G})
    assert {engine: c.kind for engine, c in choices.items()} == {
        "local": "dense",
        "remote": "delta",
    }


def test_a_measured_delta_size_replaces_the_estimate() -> None:
    clustered = Step(1 << 30, 4, density=0.03, delta_bytes=1 << 29)  # half the bytes
    assert estimated_delta_bytes(clustered) == 1 << 29
    assert choose(clustered, TCP_10G).delta_bytes == 1 << 29
    tiny = Step(1 << 30, 4, density=0.03, delta_bytes=0)
    assert choose(tiny, Rates(1.25, math.inf, math.inf)).delta_s == 0.0


@pytest.mark.parametrize("density", [0.0, 1e-3, 0.02, 0.04, 0.3, 1.0])
def test_the_estimate_matches_what_the_encoder_writes_for_evenly_spread_changes(
    density: float,
) -> None:
    base = random_tensor((1 << 21,), torch.bfloat16, seed=1)  # 4 MiB: four 1 MiB chunks
    new, _ = changed_copy(base, density, seed=2)
    written = encode_delta(new, base).nbytes
    estimate = estimated_delta_bytes(Step(base.numel() * 2, 2, density))
    assert abs(estimate - written) <= 0.03 * written + 64
