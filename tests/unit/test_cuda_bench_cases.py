"""``aiosync bench --device cuda``'s CUDA cases: each allocator's child, its figures or error."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from aiosync.bench import cuda_cases

FIGURES = {
    "dropin_median_s": 0.03,
    "dropin_first_s": 0.1,
    "native_median_s": 0.03,
    "lockstep_median_s": 0.027,
    "one_copy_s": 0.0076,
    "two_copies_s": 0.0195,
    "dropin_over_native": 1.0,
    "bit_exact": True,
}


def test_each_allocator_runs_in_its_own_child_and_a_failure_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, str]] = []

    def fake_run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        env = kwargs["env"]
        seen.append(env)
        if env.get("PYTORCH_CUDA_ALLOC_CONF"):
            return subprocess.CompletedProcess(argv, 1, "", "CUDA error: out of memory")
        return subprocess.CompletedProcess(argv, 0, "noise\n" + json.dumps(FIGURES), "")

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    monkeypatch.setattr(subprocess, "run", fake_run)
    said: list[str] = []
    out = cuda_cases.measure(16, 8.0, 2, said.append)
    assert out["default"] == FIGURES
    assert "out of memory" in out["expandable_segments"]["error"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen[0]  # the default allocator, not the caller's
    assert seen[1]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert any("drop-in 30.0 ms" in line for line in said)
    assert any("failed" in line for line in said)
