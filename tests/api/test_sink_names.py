"""Names and dtypes on the way into an engine: tied weights, renames and casting.

Tied weights move once (the sender drops a second name of one tensor) and are written
once (a sink skips a second name of a tensor it already wrote this version); a sink's
``rename`` maps the sender's names to the engine's; ``cast=True`` converts floating
tensors of another dtype on arrival, and without it a dtype mismatch is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from aiosync import (
    CallbackSink,
    ModuleSink,
    RejectedError,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)


class TinyGPT(nn.Module):
    """GPT-2's naming and tying: ``lm_head.weight`` is ``wte.weight``."""

    def __init__(self, seed: int, vocab: int = 300, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(vocab, width)  # 76.8 KB: more than one 64 KiB buffer
        self.h = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------
# tied weights
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
async def test_a_tied_state_dict_streams_once_and_commits(staged: bool) -> None:
    trainer, engine = TinyGPT(seed=1), TinyGPT(seed=2)
    state = trainer.state_dict()
    assert "lm_head.weight" in state
    assert "wte.weight" in state
    unique = {id(t): t for t in trainer.parameters()}.values()
    async with (
        WeightReceiver(ModuleSink(engine, staged=staged)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        report = await sender.send(state, version=0)  # a mapping: each tensor once
        assert report.bytes == nbytes(unique) < nbytes(state.values())
        assert report.tensors == len(state) - 1
        with torch.no_grad():
            trainer.wte.weight.add_(1)
        report = await sender.send(trainer.state_dict().items(), version=1)  # its items too
        assert report.bytes == nbytes(unique)
        assert receiver.current_version == 1
    assert same_weights(trainer, engine)
    assert engine.lm_head.weight is engine.wte.weight


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
async def test_both_names_sent_write_the_first_and_skip_the_second(staged: bool) -> None:
    engine = TinyGPT(seed=2)
    trainer = TinyGPT(seed=1)
    pairs = list(trainer.state_dict().items())  # a list is sent as it is: both names move
    head = torch.full_like(trainer.wte.weight, 7.0)  # a different value under the alias
    pairs = [(n, head if n == "lm_head.weight" else t.detach()) for n, t in pairs]
    writes: list[str] = []
    sink = ModuleSink(engine, staged=staged)
    apply = sink.apply_bucket
    sink.apply_bucket = lambda b, specs: (writes.extend(s.name for s in specs), apply(b, specs))[1]  # type: ignore[method-assign]
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        report = await sender.send(pairs, version=0)
        assert report.bytes == nbytes(t for _, t in pairs)  # both moved
        assert receiver.current_version == 0
        assert "lm_head.weight" in writes
        # the first name won: the alias's bytes were skipped, the tie holds
        assert torch.equal(engine.wte.weight, trainer.wte.weight)
        assert engine.lm_head.weight is engine.wte.weight
        # the next version writes again (skipping is per version)
        await sender.send([("lm_head.weight", head), *pairs[:-1]], version=1)
        assert torch.equal(engine.wte.weight, head)


async def test_the_alias_alone_covers_the_tied_tensor() -> None:
    trainer, engine = TinyGPT(seed=1), TinyGPT(seed=2)
    state = {k: v for k, v in trainer.state_dict().items() if k != "wte.weight"}
    async with (
        WeightReceiver(ModuleSink(engine)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(state, version=0)
        assert receiver.current_version == 0
    assert same_weights(trainer, engine)


# --------------------------------------------------------------------------------------
# renames
# --------------------------------------------------------------------------------------


def engine_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"layers": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))})


def trainer_names(module: nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", ["mapping", "function"])
async def test_rename_maps_sender_names_to_engine_names(kind: str) -> None:
    source, engine = engine_model(1), engine_model(2)
    weights = trainer_names(source)
    table = {f"model.{k}": k for k in source.state_dict()}
    rename = table if kind == "mapping" else (lambda name: name.removeprefix("model."))
    async with (
        WeightReceiver(ModuleSink(engine, rename=rename)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(weights, version=0)
        assert same_weights(source, engine)
        with pytest.raises(RejectedError, match="no such parameter") as info:
            await sender.send({**weights, "model.extra": torch.ones(2)}, version=1)
        assert info.value.tensor == "model.extra"  # errors name the tensor as sent
        partial = {k: v for k, v in weights.items() if k != "model.layers.1.bias"}
        with pytest.raises(RejectedError, match=r"misses 1 required tensors: layers\.1\.bias"):
            await sender.send(partial, version=1)
        assert receiver.current_version == 0


async def test_two_sent_names_renamed_to_one_target_are_written_once() -> None:
    source, engine = engine_model(1), engine_model(2)
    weights = trainer_names(source)
    weights["copy.bias"] = torch.full((4,), 5.0)
    table = {**{f"model.{k}": k for k in source.state_dict()}, "copy.bias": "layers.1.bias"}
    async with (
        WeightReceiver(ModuleSink(engine, rename=table, staged=True)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(weights, version=0)
    assert same_weights(source, engine)  # the first name sent wins


# --------------------------------------------------------------------------------------
# casting
# --------------------------------------------------------------------------------------


def casting_pair(src: torch.dtype, dst: torch.dtype) -> tuple[dict[str, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(0)
    sent = {
        "small": torch.randn(16, 16, generator=g).to(src),
        "big": torch.randn(200, 256, generator=g).to(src),  # chunked across 64 KiB buffers
        "steps": torch.tensor(3, dtype=torch.int64),  # never cast
    }
    targets = {
        n: torch.zeros(t.shape, dtype=dst if t.is_floating_point() else t.dtype)
        for n, t in sent.items()
    }
    return sent, targets


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["bf16-to-fp32", "fp32-to-bf16", "fp32-to-fp16"],
)
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
async def test_cast_converts_on_arrival_exactly_like_to(
    src: torch.dtype, dst: torch.dtype, staged: bool
) -> None:
    sent, targets = casting_pair(src, dst)
    async with (
        WeightReceiver(ModuleSink(targets, cast=True, staged=staged)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        report = await sender.send(sent, version=0)
        assert report.buckets > 2  # "big" came in chunks
        assert receiver.current_version == 0
    for name, tensor in sent.items():
        assert targets[name].dtype == (dst if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(targets[name], tensor.to(targets[name].dtype)), name
    if src == torch.bfloat16:
        assert torch.equal(targets["big"], sent["big"].float())


async def test_without_cast_a_dtype_mismatch_is_refused() -> None:
    sent, targets = casting_pair(torch.bfloat16, torch.float32)
    async with (
        WeightReceiver(ModuleSink(targets)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(RejectedError, match=r"sent bfloat16\[16, 16\], model has float32"):
            await sender.send(sent, version=0)
        assert receiver.current_version is None


async def test_cast_never_converts_between_integers_and_floats() -> None:
    targets = {"steps": torch.zeros((), dtype=torch.int64), "w": torch.zeros(3)}
    async with (
        WeightReceiver(ModuleSink(targets, cast=True)) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        bad = {"steps": torch.tensor(1.0), "w": torch.ones(3)}
        with pytest.raises(RejectedError, match="sent float32"):
            await sender.send(bad, version=0)
        bad = {"steps": torch.tensor(1), "w": torch.ones(3, dtype=torch.int32)}
        with pytest.raises(RejectedError, match="sent int32"):
            await sender.send(bad, version=0)


async def test_callback_sink_casts_to_the_expected_dtype() -> None:
    sent, targets = casting_pair(torch.bfloat16, torch.float32)
    got: dict[str, torch.Tensor] = {}

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            got[name] = tensor.clone()

    expected = {n: (t.dtype, tuple(t.shape)) for n, t in targets.items()}
    sink = CallbackSink(load_weights, expected=expected, cast=True)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send(sent, version=0)
    for name, tensor in sent.items():
        assert got[name].dtype == targets[name].dtype
        assert torch.equal(got[name], tensor.to(targets[name].dtype))


def test_callback_sink_cast_needs_expected_dtypes() -> None:
    with pytest.raises(ValueError, match="needs expected"):
        CallbackSink(lambda pairs: None, cast=True)


# --------------------------------------------------------------------------------------
# renames on a CallbackSink
# --------------------------------------------------------------------------------------


def callback_weights(seed: int) -> dict[str, torch.Tensor]:
    """Sender's names; ``model.embed`` (80 KB) is chunked across 64 KiB buckets."""
    torch.manual_seed(seed)
    return {"model.embed": torch.randn(100, 200), "model.norm": torch.randn(200)}


CALLBACK_EXPECTED = {"embed": (torch.float32, (100, 200)), "norm": (torch.float32, (200,))}


class Loaded:
    """A ``load_weights`` callback that keeps a copy of what it was handed, by name."""

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}
        self.calls = 0

    def __call__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        for name, tensor in pairs:
            self.got[name] = tensor.clone()


@pytest.mark.parametrize("kind", ["mapping", "function"])
async def test_callback_sink_renames_what_it_hands_on_and_checks_renamed_names(kind: str) -> None:
    loaded = Loaded()
    table = {"model.embed": "embed", "model.norm": "norm"}
    rename = table if kind == "mapping" else (lambda name: name.removeprefix("model."))
    sink = CallbackSink(loaded, expected=CALLBACK_EXPECTED, rename=rename)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        for version in (0, 1):  # the same names again in the next version
            sent = callback_weights(seed=version)
            await sender.send(sent, version=version)
            assert loaded.got.keys() == {"embed", "norm"}
            assert all(torch.equal(loaded.got[table[n]], t) for n, t in sent.items())
        calls = loaded.calls
        with pytest.raises(
            RejectedError, match=r"no such tensor in the engine \(renamed to '(model\.)?extra'\)"
        ) as info:
            await sender.send({**sent, "model.extra": torch.ones(2)}, version=2)
        assert info.value.tensor == "model.extra"  # named as sent
        partial = {"model.embed": sent["model.embed"]}
        with pytest.raises(RejectedError, match=r"misses 1 required tensors: norm"):
            await sender.send(partial, version=2)
        assert loaded.calls == calls  # refused before anything was handed on
        assert receiver.current_version == 1


async def test_callback_sink_refuses_two_names_renamed_to_one_before_any_byte_moves() -> None:
    loaded = Loaded()
    table = {"model.embed": "embed", "model.norm": "norm", "copy.norm": "norm"}
    sink = CallbackSink(loaded, expected=CALLBACK_EXPECTED, rename=table)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        sent = {**callback_weights(seed=0), "copy.norm": torch.zeros(200)}
        with pytest.raises(
            RejectedError, match=re.escape("'model.norm' and 'copy.norm' are renamed to 'norm'")
        ):
            await sender.send(sent, version=0)
        assert loaded.calls == 0
        assert receiver.current_version is None


async def test_callback_sink_without_expectations_refuses_a_second_name_when_it_arrives() -> None:
    loaded = Loaded()
    sink = CallbackSink(loaded, rename=lambda name: name.split(".")[-1])
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        await sender.send({"a.w": torch.ones(4), "b.v": torch.ones(4)}, version=0)
        assert loaded.got.keys() == {"w", "v"}
        with pytest.raises(
            RejectedError, match=re.escape("'a.w' and 'b.w' are renamed to 'w'")
        ) as info:
            await sender.send({"a.w": torch.ones(4), "b.w": torch.ones(4)}, version=1)
        assert info.value.tensor == "b.w"
        assert receiver.current_version == 0
        await sender.send({"a.w": torch.full((4,), 2.0)}, version=1)  # a fresh version is fine
        assert receiver.current_version == 1
        assert torch.equal(loaded.got["w"], torch.full((4,), 2.0))
