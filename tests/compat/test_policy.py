from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from aiosync import AiosyncError
from aiosync.compat import policy

# --------------------------------------------------------------------------------------
# resolve_policy_worker_cls
# --------------------------------------------------------------------------------------

DEFAULT = "pkg.workers.DTensorPolicyWorker"


@pytest.mark.parametrize("config", [{}, {"quant_cfg": None}, {"quant_cfg": {}}, {"other": 1}])
def test_worker_cls_unchanged_without_quant_cfg(config: dict[str, Any]) -> None:
    assert policy.resolve_policy_worker_cls(DEFAULT, config) == DEFAULT


def test_worker_cls_without_a_registered_counterpart_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"pkg\.workers\.DTensorPolicyWorker.*OVERRIDES") as info:
        policy.resolve_policy_worker_cls(DEFAULT, {"quant_cfg": {"algorithm": "fp8"}})
    assert isinstance(info.value, AiosyncError)


def test_nemo_rl_workers_map_to_their_quantized_workers() -> None:
    megatron = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
    got = policy.resolve_policy_worker_cls(megatron, {"quant_cfg": {"algorithm": "fp8"}})
    assert got.startswith("nemo_rl.modelopt.")
    assert got.endswith("MegatronQuantPolicyWorker")


def test_worker_cls_override_registry_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policy.POLICY_WORKER_OVERRIDES, DEFAULT, "pkg.workers.QDTensorWorker")
    cfg = {"quant_cfg": "fp8"}
    assert policy.resolve_policy_worker_cls(DEFAULT, cfg) == "pkg.workers.QDTensorWorker"
    # Other workers are unaffected by the new entry.
    with pytest.raises(ValueError, match=r"pkg\.workers\.Other"):
        policy.resolve_policy_worker_cls("pkg.workers.Other", cfg)
    # Without quant_cfg the override is ignored.
    assert policy.resolve_policy_worker_cls(DEFAULT, {"quant_cfg": None}) == DEFAULT


def test_worker_cls_never_imports_quantization_libraries() -> None:
    megatron = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
    before = set(sys.modules)
    policy.resolve_policy_worker_cls(megatron, {"quant_cfg": {"algorithm": "fp8"}})
    policy.resolve_policy_worker_cls(DEFAULT, {"quant_cfg": None})
    new = set(sys.modules) - before
    assert not any(name.split(".")[0] in {"modelopt", "nvidia_modelopt"} for name in new)
    assert "modelopt" not in sys.modules
    assert new == set()


# --------------------------------------------------------------------------------------
# resolve_model_class
# --------------------------------------------------------------------------------------


class _Config:
    def __init__(self, model_type: Any) -> None:
        self.model_type = model_type


def _fake_transformers(
    model_type: Any, *, with_image_text: bool = True, with_vision2seq: bool = False
) -> tuple[types.ModuleType, list[str]]:
    mod = types.ModuleType("transformers")
    calls: list[str] = []

    class AutoConfig:
        @staticmethod
        def from_pretrained(name: str) -> _Config:
            calls.append(name)
            return _Config(model_type)

    class AutoModelForCausalLM:
        pass

    mod.AutoConfig = AutoConfig  # type: ignore[attr-defined]
    mod.AutoModelForCausalLM = AutoModelForCausalLM  # type: ignore[attr-defined]
    if with_image_text:
        mod.AutoModelForImageTextToText = type("AutoModelForImageTextToText", (), {})  # type: ignore[attr-defined]
    if with_vision2seq:
        mod.AutoModelForVision2Seq = type("AutoModelForVision2Seq", (), {})  # type: ignore[attr-defined]
    return mod, calls


@pytest.mark.parametrize("model_type", ["llama", "LLaMA", "qwen2", "Mistral"])
def test_model_class_text_models(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    fake, calls = _fake_transformers(model_type)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    assert policy.resolve_model_class("org/some-model") is fake.AutoModelForCausalLM
    assert calls == ["org/some-model"]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "Qwen2_5_VL", "llava", "gemma3"])
def test_model_class_vision_language(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    fake, _ = _fake_transformers(model_type)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    cls = policy.resolve_model_class("org/vlm")
    assert cls is fake.AutoModelForImageTextToText
    assert cls is not fake.AutoModelForCausalLM


def test_model_class_vision_falls_back_to_vision2seq(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_transformers("qwen2_vl", with_image_text=False, with_vision2seq=True)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    assert policy.resolve_model_class("org/vlm") is fake.AutoModelForVision2Seq


def test_model_class_missing_auto_class_falls_back_to_causal_lm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake, _ = _fake_transformers("llava", with_image_text=False, with_vision2seq=False)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    assert policy.resolve_model_class("org/vlm") is fake.AutoModelForCausalLM


@pytest.mark.parametrize("model_type", ["some_new_arch", "", None])
def test_model_class_unknown_falls_back(monkeypatch: pytest.MonkeyPatch, model_type: Any) -> None:
    fake, _ = _fake_transformers(model_type)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    assert policy.resolve_model_class("org/x") is fake.AutoModelForCausalLM


def test_model_class_factory_is_extensible(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_transformers("my_arch")
    custom = type("MyAutoClass", (), {})
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setitem(policy.AUTOMODEL_FACTORY, "my_arch", custom)
    assert policy.resolve_model_class("org/x") is custom


def test_model_class_factory_values_are_names() -> None:
    assert policy.AUTOMODEL_FACTORY["llama"] == "AutoModelForCausalLM"
    assert policy.AUTOMODEL_FACTORY["qwen2_vl"] == "AutoModelForImageTextToText"
    assert all(k == k.lower() for k in policy.AUTOMODEL_FACTORY)


def test_model_class_local_path_is_passed_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    fake, calls = _fake_transformers("llama")
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    policy.resolve_model_class(str(tmp_path / "ckpt"))
    policy.resolve_model_class("~/ckpt")
    policy.resolve_model_class("~/not-there")
    assert calls == [str(tmp_path / "ckpt"), str(tmp_path / "ckpt"), "~/not-there"]


def test_model_class_config_loader_is_injectable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, calls = _fake_transformers("llama")
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setattr(policy, "_load_hf_config", lambda name: _Config("Qwen2_VL"))
    assert policy.resolve_model_class("anything") is fake.AutoModelForImageTextToText
    assert calls == []


def test_model_class_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes ``import transformers`` raise ImportError.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'aiosync\[hf\]'") as info:
        policy.resolve_model_class("org/x")
    assert isinstance(info.value.__cause__, ImportError)
    assert isinstance(info.value, AiosyncError)


# --------------------------------------------------------------------------------------
# is_vllm_v1_engine_enabled
# --------------------------------------------------------------------------------------


@pytest.fixture
def clean_vllm_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("NRL_VLLM_USE_V1", raising=False)
    monkeypatch.delenv("VLLM_USE_V1", raising=False)
    return monkeypatch


def test_vllm_v1_default_true(clean_vllm_env: pytest.MonkeyPatch) -> None:
    assert policy.is_vllm_v1_engine_enabled() is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", False),
        (" 0 ", False),
        ("false", False),
        ("OFF", False),
        ("1", True),
        ("true", True),
        ("", True),
        ("   ", True),
    ],
)
def test_vllm_v1_primary_var(
    clean_vllm_env: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    clean_vllm_env.setenv("NRL_VLLM_USE_V1", value)
    assert policy.is_vllm_v1_engine_enabled() is expected


def test_vllm_v1_fallback_var(clean_vllm_env: pytest.MonkeyPatch) -> None:
    clean_vllm_env.setenv("VLLM_USE_V1", "0")
    assert policy.is_vllm_v1_engine_enabled() is False
    # A blank primary value counts as unset, so the fallback still decides.
    clean_vllm_env.setenv("NRL_VLLM_USE_V1", " ")
    assert policy.is_vllm_v1_engine_enabled() is False


def test_vllm_v1_primary_wins_over_fallback(clean_vllm_env: pytest.MonkeyPatch) -> None:
    clean_vllm_env.setenv("VLLM_USE_V1", "0")
    clean_vllm_env.setenv("NRL_VLLM_USE_V1", "1")
    assert policy.is_vllm_v1_engine_enabled() is True
    clean_vllm_env.setenv("VLLM_USE_V1", "1")
    clean_vllm_env.setenv("NRL_VLLM_USE_V1", "0")
    assert policy.is_vllm_v1_engine_enabled() is False


# --------------------------------------------------------------------------------------
# get_gpu_info
# --------------------------------------------------------------------------------------

MEMORY_KEYS = ("memory_total_bytes", "memory_allocated_bytes", "memory_reserved_bytes")


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_gpu_info_cpu_without_dist(rank_env: pytest.MonkeyPatch) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    rank_env.setenv("RANK", "3")
    rank_env.setenv("LOCAL_RANK", "1")
    rank_env.setenv("WORLD_SIZE", "8")
    rank_env.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    info = policy.get_gpu_info(torch.nn.Linear(2, 2))
    assert info["device"] == "cpu"
    assert info["device_type"] == "cpu"
    assert (info["rank"], info["local_rank"], info["world_size"]) == (3, 1, 8)
    assert info["dist_initialized"] is False
    assert info["dist_rank"] is None
    assert info["dist_world_size"] is None
    assert info["cuda_visible_devices"] == "4,5"
    assert info["device_name"] is None
    assert info["device_index"] is None
    for key in MEMORY_KEYS:
        assert info[key] is None


def test_gpu_info_env_missing_or_invalid(rank_env: pytest.MonkeyPatch) -> None:
    rank_env.setenv("RANK", "not-a-number")
    rank_env.setenv("WORLD_SIZE", "  ")
    info = policy.get_gpu_info(torch.nn.Linear(1, 1))
    assert info["rank"] is None
    assert info["local_rank"] is None
    assert info["world_size"] is None
    assert info["cuda_visible_devices"] is None


def test_gpu_info_model_without_parameters(rank_env: pytest.MonkeyPatch) -> None:
    info = policy.get_gpu_info(torch.nn.ReLU())
    assert info["device"] == "cpu"
    for key in MEMORY_KEYS:
        assert info[key] is None


def test_gpu_info_meta_device_has_no_memory_stats(rank_env: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2, device="meta")
    info = policy.get_gpu_info(model)
    assert info["device"] == "meta"
    assert info["device_name"] is None


@pytest.fixture
def single_rank_group(tmp_path: Any) -> Iterator[None]:
    init_method = f"file://{tmp_path / 'pg_store'}"
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gpu_info_with_initialized_dist(
    rank_env: pytest.MonkeyPatch, single_rank_group: None
) -> None:
    info = policy.get_gpu_info(torch.nn.Linear(2, 2))
    assert info["dist_initialized"] is True
    assert info["dist_rank"] == 0
    assert info["dist_world_size"] == 1


class _FakeParam:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class _FakeCudaModel(torch.nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        yield _FakeParam(self._device)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    props = types.SimpleNamespace(total_memory=80 * 2**30)

    def name(index: int) -> str:
        seen.append(index)
        return f"FakeGPU-{index}"

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 1024 * (index + 1))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 4096 * (index + 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    return seen


def test_gpu_info_cuda_branch(rank_env: pytest.MonkeyPatch, fake_cuda: list[int]) -> None:
    info = policy.get_gpu_info(_FakeCudaModel(torch.device("cuda", 1)))
    assert info["device"] == "cuda:1"
    assert info["device_type"] == "cuda"
    assert info["device_index"] == 1
    assert info["device_name"] == "FakeGPU-1"
    assert info["memory_total_bytes"] == 80 * 2**30
    assert info["memory_allocated_bytes"] == 2048
    assert info["memory_reserved_bytes"] == 8192
    assert fake_cuda == [1]


def test_gpu_info_cuda_without_index_uses_current_device(
    rank_env: pytest.MonkeyPatch, fake_cuda: list[int]
) -> None:
    info = policy.get_gpu_info(_FakeCudaModel(torch.device("cuda")))
    assert info["device_index"] == 2
    assert info["device_name"] == "FakeGPU-2"
    assert info["memory_allocated_bytes"] == 3072


# --------------------------------------------------------------------------------------
# configure_dynamo_cache
# --------------------------------------------------------------------------------------


def test_configure_dynamo_cache_disables_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "autotune_local_cache", True)
    policy.configure_dynamo_cache()
    assert inductor_config.autotune_local_cache is False


class _NoSuchSetting(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{name} does not exist")


def test_configure_dynamo_cache_missing_attribute(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch._inductor.config", _NoSuchSetting("cfg"))
    with caplog.at_level(logging.DEBUG, logger="aiosync.compat.policy"):
        policy.configure_dynamo_cache()
    assert any("autotune_local_cache" in r.getMessage() for r in caplog.records)
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_configure_dynamo_cache_missing_module(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch._inductor.config", None)
    with caplog.at_level(logging.DEBUG, logger="aiosync.compat.policy"):
        policy.configure_dynamo_cache()
    assert any("autotune_local_cache" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------
# get_runtime_env_for_policy_worker
# --------------------------------------------------------------------------------------


@pytest.fixture
def nsys_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("NRL_NSYS_WORKER_PATTERNS", raising=False)
    monkeypatch.delenv("NRL_NSYS_PROFILE_STEP_RANGE", raising=False)
    return monkeypatch


def test_runtime_env_without_patterns(nsys_env: pytest.MonkeyPatch) -> None:
    nsys_env.setenv("NRL_NSYS_PROFILE_STEP_RANGE", "2:4")
    assert policy.get_runtime_env_for_policy_worker("lm_policy-0") == {"env_vars": {}}


def test_runtime_env_pattern_no_match(nsys_env: pytest.MonkeyPatch) -> None:
    nsys_env.setenv("NRL_NSYS_WORKER_PATTERNS", "reference_*,critic-?")
    nsys_env.setenv("NRL_NSYS_PROFILE_STEP_RANGE", "2:4")
    env = policy.get_runtime_env_for_policy_worker("lm_policy-0")
    assert env == {"env_vars": {}}
    assert "nsight" not in env


def test_runtime_env_pattern_match_with_step_range(nsys_env: pytest.MonkeyPatch) -> None:
    nsys_env.setenv("NRL_NSYS_WORKER_PATTERNS", " reference_* , lm_policy-*")
    nsys_env.setenv("NRL_NSYS_PROFILE_STEP_RANGE", "2:4")
    env = policy.get_runtime_env_for_policy_worker("lm_policy-0")
    assert env["env_vars"] == {"NRL_NSYS_PROFILE_STEP_RANGE": "2:4"}
    nsight = env["nsight"]
    assert nsight["capture-range"] == "cudaProfilerApi"
    assert "lm_policy-0" in nsight["o"]
    assert "nvtx" in nsight["t"]


def test_runtime_env_pattern_match_without_step_range(nsys_env: pytest.MonkeyPatch) -> None:
    nsys_env.setenv("NRL_NSYS_WORKER_PATTERNS", "lm_policy-*")
    nsys_env.setenv("NRL_NSYS_PROFILE_STEP_RANGE", "   ")
    env = policy.get_runtime_env_for_policy_worker("lm_policy-3")
    assert env["env_vars"] == {}
    assert "capture-range" not in env["nsight"]


def test_runtime_env_pattern_is_case_sensitive_and_blank_entries_ignored(
    nsys_env: pytest.MonkeyPatch,
) -> None:
    nsys_env.setenv("NRL_NSYS_WORKER_PATTERNS", ", ,LM_POLICY-*,")
    assert "nsight" not in policy.get_runtime_env_for_policy_worker("lm_policy-0")
    assert "nsight" in policy.get_runtime_env_for_policy_worker("LM_POLICY-0")


def test_runtime_env_output_name_is_sanitised(nsys_env: pytest.MonkeyPatch) -> None:
    nsys_env.setenv("NRL_NSYS_WORKER_PATTERNS", "*")
    env = policy.get_runtime_env_for_policy_worker("pkg.Worker/rank 0")
    assert "/" not in env["nsight"]["o"]
    assert " " not in env["nsight"]["o"]


def test_runtime_env_returns_fresh_dicts(nsys_env: pytest.MonkeyPatch) -> None:
    first = policy.get_runtime_env_for_policy_worker("w")
    first["env_vars"]["X"] = "1"
    assert policy.get_runtime_env_for_policy_worker("w") == {"env_vars": {}}


# --------------------------------------------------------------------------------------
# get_megatron_checkpoint_dir
# --------------------------------------------------------------------------------------


@pytest.fixture
def ckpt_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> pytest.MonkeyPatch:
    monkeypatch.delenv("NRL_MEGATRON_CHECKPOINT_DIR", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_megatron_dir_explicit(ckpt_env: pytest.MonkeyPatch) -> None:
    ckpt_env.setenv("HF_HOME", "/mnt/hf")
    ckpt_env.setenv("NRL_MEGATRON_CHECKPOINT_DIR", "/shared/mcore")
    assert policy.get_megatron_checkpoint_dir() == "/shared/mcore"


def test_megatron_dir_hf_home(ckpt_env: pytest.MonkeyPatch) -> None:
    ckpt_env.setenv("HF_HOME", "/mnt/hf")
    assert policy.get_megatron_checkpoint_dir() == os.path.join("/mnt/hf", "nemo_rl")


def test_megatron_dir_default(ckpt_env: pytest.MonkeyPatch, tmp_path: Any) -> None:
    expected = os.path.join(str(tmp_path / "home"), ".cache", "huggingface", "nemo_rl")
    assert policy.get_megatron_checkpoint_dir() == expected
    assert "~" not in policy.get_megatron_checkpoint_dir()


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_megatron_dir_blank_values_count_as_unset(
    ckpt_env: pytest.MonkeyPatch, tmp_path: Any, blank: str
) -> None:
    ckpt_env.setenv("NRL_MEGATRON_CHECKPOINT_DIR", blank)
    ckpt_env.setenv("HF_HOME", "/mnt/hf")
    assert policy.get_megatron_checkpoint_dir() == os.path.join("/mnt/hf", "nemo_rl")
    ckpt_env.setenv("HF_HOME", blank)
    expected = os.path.join(str(tmp_path / "home"), ".cache", "huggingface", "nemo_rl")
    assert policy.get_megatron_checkpoint_dir() == expected


def test_megatron_dir_expands_user(ckpt_env: pytest.MonkeyPatch, tmp_path: Any) -> None:
    ckpt_env.setenv("HF_HOME", "~/hf")
    assert policy.get_megatron_checkpoint_dir() == os.path.join(
        str(tmp_path / "home"), "hf", "nemo_rl"
    )
    ckpt_env.setenv("NRL_MEGATRON_CHECKPOINT_DIR", " ~/mcore ")
    assert policy.get_megatron_checkpoint_dir() == str(tmp_path / "home" / "mcore")


def test_megatron_dir_is_announced_as_nemo_rl_does(
    ckpt_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt_env.setenv("NRL_MEGATRON_CHECKPOINT_DIR", "/shared/mcore")
    assert policy.get_megatron_checkpoint_dir() == "/shared/mcore"
    assert capsys.readouterr().out == "Using default megatron checkpoint dir: /shared/mcore\n"
