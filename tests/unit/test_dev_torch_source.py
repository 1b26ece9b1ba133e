"""Where `python3 dev.py` takes torch from (issue 25, item 11); nothing is downloaded here."""

from __future__ import annotations

import sys

import pytest

import dev
from dev import CPU_INDEX, TORCH_VERSION, TorchSource, torch_source

PLAIN = f"torch=={TORCH_VERSION}"
CPU = f"torch=={TORCH_VERSION}+cpu"


def choose(
    override: str | None = None,
    *,
    platform: str = "linux",
    gpu: bool = False,
    index: bool | None = True,
) -> tuple[TorchSource, int]:
    asked: list[int] = []

    def probe() -> bool:
        asked.append(1)
        if index is None:
            raise AssertionError("the CPU index must not be asked here")
        return index

    return torch_source(override, platform=platform, gpu=gpu, cpu_index_answers=probe), len(asked)


def test_linux_without_a_gpu_takes_the_cpu_build_with_pypi_to_fall_back_on() -> None:
    source, asked = choose()
    assert asked == 1
    assert source.pip_args() == ["--extra-index-url", CPU_INDEX, CPU]
    assert "CPU build" in source.why
    assert source.fallback is not None
    assert source.fallback.pip_args() == [PLAIN]
    assert source.fallback.fallback is None


def test_an_unreachable_cpu_index_falls_back_at_once_with_a_note() -> None:
    source, asked = choose(index=False)
    assert asked == 1
    assert source.pip_args() == [PLAIN]
    assert CPU_INDEX in source.why
    assert "does not answer" in source.why
    assert source.fallback is None


def test_a_gpu_machine_takes_pypi_without_asking_the_cpu_index() -> None:
    source, asked = choose(gpu=True, index=None)
    assert asked == 0
    assert source.pip_args() == [PLAIN]
    assert "NVIDIA GPU" in source.why


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_other_platforms_take_pypi_whose_build_is_cpu_there(platform: str) -> None:
    source, asked = choose(platform=platform, index=None)
    assert asked == 0
    assert source.pip_args() == [PLAIN]


@pytest.mark.parametrize("gpu", [False, True])
def test_a_requirement_in_aiosync_torch_overrides_everything(gpu: bool) -> None:
    source, asked = choose(" torch==2.11.0 ", gpu=gpu, index=None)
    assert asked == 0
    assert source == TorchSource("torch==2.11.0", "AIOSYNC_TORCH=torch==2.11.0")
    assert source.pip_args() == ["torch==2.11.0"]


@pytest.mark.parametrize("gpu", [False, True])
def test_aiosync_torch_cpu_forces_the_cpu_build(gpu: bool) -> None:
    source, asked = choose("CPU", gpu=gpu, index=None)
    assert asked == 0
    assert source.pip_args() == ["--extra-index-url", CPU_INDEX, CPU]
    assert source.fallback is None  # asked for: a failure is reported, not replaced


def test_an_empty_aiosync_torch_is_unset() -> None:
    assert choose("")[0] == choose(None)[0]


def test_a_failed_cpu_install_falls_back_and_a_failed_fallback_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, ...]] = []
    statuses = iter([1, 0])

    def call(*cmd: object) -> int:
        calls.append(tuple(map(str, cmd)))
        return next(statuses)

    monkeypatch.delenv("AIOSYNC_TORCH", raising=False)
    monkeypatch.setattr(dev, "call", call)
    monkeypatch.setattr(dev, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(dev, "answers", lambda url: True)
    monkeypatch.setattr(sys, "platform", "linux")
    dev.install_torch(["pip", "install"])
    assert calls == [
        ("pip", "install", "--extra-index-url", CPU_INDEX, CPU),
        ("pip", "install", PLAIN),
    ]

    statuses = iter([1, 3])
    calls.clear()
    with pytest.raises(SystemExit) as exit_:
        dev.install_torch(["pip", "install"])
    assert exit_.value.code == 3
    assert len(calls) == 2


def test_the_cpu_index_probe_is_false_for_an_address_that_cannot_answer() -> None:
    assert dev.answers("http://127.0.0.1:9/", timeout=2) is False
    assert dev.answers("not a url") is False
