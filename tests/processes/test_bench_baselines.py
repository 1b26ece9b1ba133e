from __future__ import annotations

import glob
from collections.abc import Iterator

import pytest
import torch

from aiosync.bench import baseline_engine, baselines
from aiosync.bench.baselines import measure_safetensors_shm, measure_torch_save_zmq
from aiosync.bench.floors import measure_memcpy
from aiosync.bench.model import llama_shapes, synthetic_state_dict, tensor_digest

SIZE = 8 << 20
SHM_GLOB = "/dev/shm/aiosync-bench-*"


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


@pytest.fixture
def no_shm_leftovers() -> Iterator[None]:
    before = set(glob.glob(SHM_GLOB))
    yield
    assert set(glob.glob(SHM_GLOB)) - before == set()


@pytest.fixture(scope="module")
def sd() -> dict[str, torch.Tensor]:
    return synthetic_state_dict(SIZE, seed=3)


# --------------------------------------------------------------------------------------
# synthetic model
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [4 << 20, 8 << 20, 64 << 20, 1 << 30, 8 << 30])
def test_llama_shapes_size_within_tolerance(size: int) -> None:
    shapes = llama_shapes(size)
    total = sum(4 * torch.Size(s).numel() for _, s in shapes)
    assert abs(total - size) / size < 0.1


def test_llama_shapes_bf16_halves_element_count() -> None:
    size = 64 << 20
    total = sum(2 * torch.Size(s).numel() for _, s in llama_shapes(size, torch.bfloat16))
    assert abs(total - size) / size < 0.1


def test_llama_shapes_are_llama_like() -> None:
    shapes = dict(llama_shapes(64 << 20))
    assert "model.embed_tokens.weight" in shapes
    assert "lm_head.weight" in shapes
    assert "model.norm.weight" in shapes
    vocab, hidden = shapes["model.embed_tokens.weight"]
    assert shapes["lm_head.weight"] == (vocab, hidden)
    n_layers = sum(1 for n in shapes if n.endswith("self_attn.q_proj.weight"))
    assert n_layers >= 2
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for part in ("q", "k", "v", "o"):
            assert p + f"self_attn.{part}_proj.weight" in shapes
        inter = shapes[p + "mlp.gate_proj.weight"][0]
        assert shapes[p + "mlp.up_proj.weight"] == (inter, hidden)
        assert shapes[p + "mlp.down_proj.weight"] == (hidden, inter)
        assert shapes[p + "input_layernorm.weight"] == (hidden,)
        assert shapes[p + "post_attention_layernorm.weight"] == (hidden,)
    assert len(shapes) == 3 + 9 * n_layers


def test_llama_shapes_rejects_nonpositive() -> None:
    with pytest.raises(ValueError, match="positive"):
        llama_shapes(0)


def test_synthetic_state_dict_size_and_shapes(sd: dict[str, torch.Tensor]) -> None:
    assert abs(_nbytes(sd) - SIZE) / SIZE < 0.1
    assert [(n, tuple(t.shape)) for n, t in sd.items()] == llama_shapes(SIZE)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in sd.values())
    norm = sd["model.norm.weight"]
    assert bool(((norm >= 0.9) & (norm <= 1.1)).all())
    emb = sd["model.embed_tokens.weight"]
    assert 0.01 < float(emb.std()) < 0.03


def test_synthetic_state_dict_deterministic(sd: dict[str, torch.Tensor]) -> None:
    again = synthetic_state_dict(SIZE, seed=3)
    assert sd.keys() == again.keys()
    assert all(torch.equal(sd[n], again[n]) for n in sd)
    assert tensor_digest(sd) == tensor_digest(again)
    other = synthetic_state_dict(SIZE, seed=4)
    assert tensor_digest(sd) != tensor_digest(other)


def test_synthetic_state_dict_bf16() -> None:
    sd16 = synthetic_state_dict(SIZE, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd16.values())
    assert abs(_nbytes(sd16) - SIZE) / SIZE < 0.1


def test_tensor_digest_is_bit_exact(sd: dict[str, torch.Tensor]) -> None:
    copy = {n: t.clone() for n, t in sd.items()}
    assert tensor_digest(copy) == tensor_digest(sd)
    name = "model.norm.weight"
    copy[name].view(torch.int32)[0] ^= 1  # flip one mantissa bit
    assert tensor_digest(copy) != tensor_digest(sd)


# --------------------------------------------------------------------------------------
# floor
# --------------------------------------------------------------------------------------


def test_measure_memcpy_positive_and_restores_threads() -> None:
    threads = torch.get_num_threads()
    gbps = measure_memcpy(SIZE, repeats=3)
    assert isinstance(gbps, float)
    assert gbps > 0
    assert torch.get_num_threads() == threads


# --------------------------------------------------------------------------------------
# baselines end to end
# --------------------------------------------------------------------------------------

KEYS = {"seconds", "trainer_seconds", "engine_seconds", "GBps"}


def _check_result(res: dict[str, object], sd: dict[str, torch.Tensor], repeats: int) -> None:
    assert res.keys() >= KEYS
    for key in KEYS:
        value = res[key]
        assert isinstance(value, float)
        assert value > 0
    assert res["bytes"] == _nbytes(sd)
    assert res["repeats"] == repeats
    assert res["verified"] is True


@pytest.mark.usefixtures("no_shm_leftovers")
@pytest.mark.parametrize("by_size", [True, False], ids=["llama_shapes", "layout_msg"])
@pytest.mark.parametrize("measure", [measure_torch_save_zmq, measure_safetensors_shm])
def test_baseline_end_to_end(measure: object, by_size: bool, sd: dict[str, torch.Tensor]) -> None:
    threads = torch.get_num_threads()
    assert callable(measure)
    res = measure(sd, repeats=2, total_bytes=SIZE if by_size else None, timeout_s=60.0)
    _check_result(res, sd, 2)
    assert torch.get_num_threads() == threads


@pytest.mark.usefixtures("no_shm_leftovers")
@pytest.mark.parametrize("measure", [measure_torch_save_zmq, measure_safetensors_shm])
def test_baseline_detects_corruption(
    measure: object, sd: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent compares the engine's digest against a digest of something else: the
    # comparison must then fail, proving `verified` is not vacuous.
    real = baselines.tensor_digest
    monkeypatch.setattr(baselines, "tensor_digest", lambda t: real(t) + "x")
    assert callable(measure)
    res = measure(sd, repeats=1, timeout_s=60.0)
    assert res["verified"] is False


@pytest.mark.usefixtures("no_shm_leftovers")
def test_total_bytes_must_match_layout(sd: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="shaped"):
        measure_torch_save_zmq(sd, repeats=1, total_bytes=SIZE * 2, timeout_s=30.0)


@pytest.mark.usefixtures("no_shm_leftovers")
def test_engine_failure_is_reported_not_hung() -> None:
    # A state dict whose layout the engine accepts but whose payload lacks a tensor: the
    # engine replies an error, the parent raises, the child is reaped, no file is left.
    small = synthetic_state_dict(1 << 20)
    partial = dict(small)
    partial.popitem()
    with pytest.raises(RuntimeError, match="engine failed"):
        _load_partial_file(small, partial)


def _load_partial_file(full: dict[str, torch.Tensor], partial: dict[str, torch.Tensor]) -> None:
    engine = baselines._Engine("safetensors", full, None, 30.0)
    path = baselines.SHM_DIR / f"{baselines.SHM_PREFIX}test-partial.safetensors"
    try:
        from safetensors.torch import save_file

        save_file(partial, str(path))
        engine.send_json({"type": "load_file", "seq": 0, "path": str(path)})
        engine.recv_json()
    finally:
        path.unlink(missing_ok=True)
        engine.close()


def test_engine_main_rejects_bad_args() -> None:
    with pytest.raises(SystemExit):
        baseline_engine.main(["--mode", "nope", "--endpoint", "tcp://127.0.0.1:1"])
