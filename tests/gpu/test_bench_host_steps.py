"""``python -m benchmarks.host_steps``: every host step of a direct read is measured."""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda


@pytest.mark.gpu
@requires_cuda
def test_host_steps_measures_each_step_of_a_kept_direct_read() -> None:
    from benchmarks.host_steps import measure

    out = measure(5)
    assert out["tensors"] == 291
    steps = ["read_us", "matches_us", "unique_storage_us", "marker_us"]
    hops = ["to_thread_idle_us", "to_thread_idle_p90_us", "to_thread_busy_us"]
    assert all(out[key] > 0 for key in steps + hops)
    assert out["matches_us"] < out["read_us"]  # a part of the read
    assert out["to_thread_idle_us"] <= out["to_thread_idle_p90_us"]
