"""``aiosync bench --serving``: every mode runs under a request load and reports its figures.

Only the shape of the report and the facts that do not depend on the machine are checked
(every version verified, memory held, requests served); no time is asserted.
"""

from __future__ import annotations

import json

import pytest
import torch

from aiosync.bench import serving
from aiosync.cli import main


def small_model() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(64, 64, generator=generator) for i in range(6)}


LOAD = serving.Load(requests=2, request_s=0.001, versions=2, buffer_bytes=32 << 10, timeout=30)


def test_every_mode_serves_requests_and_reports_time_to_live_waits_and_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "llama_300", small_model)  # keep CI quick
    said: list[str] = []
    out = serving.measure(small_model, LOAD, said.append)
    cases = out["modes"]
    assert [c["mode"] for c in cases] == [m.name for m in serving.MODES]
    for case in cases:
        assert case["verified"], case["mode"]
        assert case["versions"] == LOAD.versions
        assert case["requests"] > 0
        assert case["bytes"] == 6 * 64 * 64 * 4
        assert case["extra_ratio"] == (1.0 if case["staged"] else 0.0)  # one staged copy
        assert case["bucket_apply_ms"]["max"] > 0
        live, sent = case["send_to_live_ms"], case["send_ms"]
        assert 0 < live["median"] <= live["max"]
        assert sent["median"] > 0
        step = case["commit_step_ms"]["median"]
        assert step >= case["swap_wait_ms"]["median"] >= 0
        assert case["commit_less_wait_ms"]["median"] >= 0
    assert [c["ack_at"] for c in cases] == ["live", "live", "live", "staged"]
    assert [c["swap"] for c in cases] == [None, "copy", "pointer", "pointer"]
    assert [c["swap"] for c in out["tensors_300"]] == ["copy", "pointer"]
    assert len(said) == len(cases) + 2


def test_the_300_tensor_model_has_300_tensors() -> None:
    model = serving.llama_300()
    assert len(model) == 300
    assert sum(t.nbytes for t in model.values()) == 278_204_928
    del model


def test_bench_serving_prints_one_json_object(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serving, "llama_300", small_model)  # keep CI quick
    argv = ["bench", "--serving", "--device", "cpu", "--size-mb", "1", "--repeats", "1"]
    argv += ["--buffer-mb", "0.25", "--requests", "2", "--request-ms", "1", "--json", "--quiet"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["requests"] == 2
    assert out["request_ms"] == 1.0
    assert all(case["verified"] for case in out["modes"] + out["tensors_300"])
