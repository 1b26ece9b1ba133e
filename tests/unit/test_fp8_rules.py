"""Per-tensor transform declarations: which tensors are quantized, what they become. Pure."""

from __future__ import annotations

import re

import pytest
import torch

from aiosync.bench.model import LLAMA3_8B, llama_layout
from aiosync.core.errors import MismatchError, UsageError
from aiosync.transforms import (
    Fp8Format,
    Fp8Transform,
    OutputNames,
    PlannedTensor,
    TransformRules,
)

BLOCK = Fp8Transform(Fp8Format.BLOCK)
PER_TENSOR = Fp8Transform(Fp8Format.TENSOR)
MX = Fp8Transform(Fp8Format.MX)


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def test_vllm_names_by_default() -> None:
    assert BLOCK.output_names("m.q_proj.weight") == ("m.q_proj.weight", "m.q_proj.weight_scale_inv")
    assert PER_TENSOR.output_names("m.q.weight") == ("m.q.weight", "m.q.weight_scale")
    assert MX.output_names("m.q.weight") == ("m.q.weight", "m.q.weight_scale")


def test_output_names_are_configurable_templates() -> None:
    names = OutputNames(weight="{module}.qweight", scale="{module}.{leaf}_s")
    transform = Fp8Transform(Fp8Format.BLOCK, names)
    assert transform.output_names("a.b.weight") == ("a.b.qweight", "a.b.weight_s")
    with pytest.raises(UsageError, match="template"):
        OutputNames(scale="{nme}_scale")


def test_first_matching_pattern_decides_and_unmatched_tensors_pass() -> None:
    rules = TransformRules(
        [("*.mlp.down_proj.weight", None), ("*.mlp.*", MX), (re.compile(r"\.q_proj\."), BLOCK)]
    )
    assert rules.transform_for("l.0.mlp.down_proj.weight", meta(8, 8)) is None
    assert rules.transform_for("l.0.mlp.up_proj.weight", meta(8, 8)) == MX
    assert rules.transform_for("l.0.self_attn.q_proj.weight", meta(8, 8)) == BLOCK
    assert rules.transform_for("l.0.self_attn.k_proj.weight", meta(8, 8)) is None


def test_high_precision_tensors_pass_unchanged_by_default() -> None:
    rules = TransformRules([("*", BLOCK)])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "l.0.input_layernorm.weight"):
        assert rules.transform_for(name, meta(64, 64)) is None, name
    assert rules.transform_for("l.0.q_proj.bias", meta(4, 4)) is None
    assert rules.transform_for("l.0.q_proj.scales", meta(64)) is None  # 1-D
    assert rules.transform_for("l.0.q_proj.weight", meta(64, 64, dtype=torch.int8)) is None
    assert rules.transform_for("l.0.q_proj.weight", meta(64, 64, dtype=torch.float64)) is None
    assert rules.transform_for("l.0.q_proj.weight", meta(64, 64)) == BLOCK


def test_the_keep_list_and_vectors_can_be_changed() -> None:
    rules = TransformRules([("*", PER_TENSOR)], keep=(), keep_vectors=False)
    assert rules.transform_for("model.norm.weight", meta(64)) == PER_TENSOR
    rules = TransformRules([("*", BLOCK)], keep=("*.v_proj.*",))
    assert rules.transform_for("l.v_proj.weight", meta(8, 8)) is None
    assert rules.transform_for("model.embed_tokens.weight", meta(8, 8)) == BLOCK


def test_a_callable_sees_the_name_and_the_tensor() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []

    def choose(name: str, tensor: torch.Tensor) -> Fp8Transform | None:
        seen.append((name, tuple(tensor.shape)))
        return BLOCK if tensor.shape[0] >= 256 else None

    rules = TransformRules(choose)
    assert rules.plan("a.weight", "bfloat16", (256, 128))[1].name == "a.weight_scale_inv"
    assert rules.plan("b.weight", "bfloat16", (128, 128)) == (
        PlannedTensor("b.weight", "bfloat16", (128, 128)),
    )
    assert rules.plan("model.norm.weight", "bfloat16", (512,))[0].dtype == "bfloat16"
    assert seen == [("a.weight", (256, 128)), ("b.weight", (128, 128))]  # the norm: kept first


def test_planned_specs_from_metadata_alone() -> None:
    rules = TransformRules([("*", BLOCK)])
    values, scales = rules.plan("x.weight", "float32", (300, 129))
    assert values == PlannedTensor("x.weight", "float8_e4m3fn", (300, 129))
    assert scales == PlannedTensor("x.weight_scale_inv", "float32", (3, 2))
    assert values.nbytes == 300 * 129
    assert scales.nbytes == 24
    _mx_values, mx_scales = TransformRules([("*", MX)]).plan("y.weight", "float16", (4, 2, 33))
    assert mx_scales == PlannedTensor("y.weight_scale", "uint8", (4, 2, 2))
    per = TransformRules([("*", PER_TENSOR)]).plan("z.weight", "bfloat16", (7, 9))
    assert per[1] == PlannedTensor("z.weight_scale", "float32", ())
    assert per[1].nbytes == 4
    assert per[1].meta(1 << 20).chunks == 1
    assert values.meta(10_000).chunks == 4  # 38700 bytes through 10000-byte buffers


def test_a_rule_that_cannot_apply_is_refused_naming_the_tensor() -> None:
    rules = TransformRules([("*", BLOCK)])
    with pytest.raises(MismatchError, match=r"2-D.*'conv\.weight'"):
        rules.plan("conv.weight", "bfloat16", (8, 3, 3, 3))


def test_an_output_name_taken_twice_is_refused() -> None:
    rules = TransformRules([("*.weight", BLOCK)])
    entries = [("a.weight", "bfloat16", (128, 128)), ("a.weight_scale_inv", "float32", (1, 1))]
    with pytest.raises(MismatchError, match=r"a\.weight_scale_inv"):
        rules.plan_all(entries)


def test_llama_3_8b_under_the_default_keep_list() -> None:
    layout = llama_layout(*LLAMA3_8B)
    rules = TransformRules([("*", BLOCK)])
    planned = rules.plan_all((name, "bfloat16", shape) for name, shape in layout)
    quantized = [p for p in planned if p.dtype == "float8_e4m3fn"]
    assert len(layout) == 291
    assert len(quantized) == 7 * 32
    assert len(planned) == 291 + 224
    kept = {p.name for p in planned if p.dtype == "bfloat16"}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= kept
    dense = sum(2 * torch.Size(shape).numel() for _, shape in layout)
    sent = sum(p.nbytes for p in planned)
    matrices = sum(p.nbytes for p in quantized)
    assert sent == dense - matrices + sum(p.nbytes for p in planned if p.dtype == "float32")
