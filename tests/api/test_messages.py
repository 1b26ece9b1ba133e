"""Messages that say what to do (issue 25, item 8): each failure names its remedy.

A floating dtype mismatch names ``cast=True``; an unknown name names the nearest names the
engine has and ``rename=``; an endpoint without a scheme, or on ``inproc://``, is refused
when the receiver or sender is made, saying what to write instead; the CLI names its own
flags, not the Python API; a sink of an older shape is refused at the receiver's start,
naming what it lacks; a group released on a clean close is not reported broken at exit;
and a :class:`CollectiveSender` reaches engines living in the trainer's own process.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from datetime import timedelta

import pytest
import torch
from torch import nn

from aiosync import (
    CallbackSink,
    MismatchError,
    ModuleSink,
    RejectedError,
    SenderConfig,
    UsageError,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.inproc import InprocListener
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.cli import main
from aiosync.collectives import (
    destroy_side_group,
    host_store,
    init_process_group,
    new_token,
    token_store,
)
from aiosync.collectives import executor as executor_module
from aiosync.collectives.executor import GroupExecutor
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.planes.collective import CollectiveOptions
from aiosync.trainer.collective import CollectiveSender
from tests.helpers.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=30)
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


async def refusal(sink: ModuleSink | CallbackSink, weights: dict[str, torch.Tensor]) -> str:
    """What the engine answers a version of ``weights`` (it must refuse it)."""
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        with pytest.raises(RejectedError) as info:
            await sender.send(weights, version=0)
        assert receiver.current_version is None
    return str(info.value)


# --- 1. a floating dtype mismatch names cast=True --------------------------------------------


async def test_a_floating_dtype_mismatch_says_to_pass_cast() -> None:
    engine = {"w": torch.zeros(4, 4), "steps": torch.zeros((), dtype=torch.int64)}
    said = await refusal(ModuleSink(engine), {"w": torch.ones(4, 4, dtype=torch.bfloat16)})
    assert "sent bfloat16[4, 4], model has float32[4, 4]" in said
    assert "pass cast=True" in said
    # no cast would make another shape, or an integer, fit: no such hint there
    wrong_shape = await refusal(ModuleSink(engine), {"w": torch.ones(2, 8, dtype=torch.bfloat16)})
    assert "cast=True" not in wrong_shape
    to_int = await refusal(ModuleSink(engine), {"steps": torch.zeros((), dtype=torch.float32)})
    assert "cast=True" not in to_int


# --- 2. an unknown name names the nearest names and rename= ----------------------------------


async def test_an_unknown_name_says_the_nearest_names_and_rename() -> None:
    engine = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    prefixed = {f"model.{name}": t.detach().clone() for name, t in engine.state_dict().items()}
    said = await refusal(ModuleSink(engine), prefixed)
    assert "no such parameter or buffer in the model" in said
    assert "nearest: '0.weight'" in said or "nearest: '0.bias'" in said
    assert "pass rename=" in said


def test_a_renamed_name_that_still_misses_says_what_it_became_and_the_nearest() -> None:
    expected = {"layers.0.weight": (torch.float32, (2,)), "layers.1.weight": (torch.float32, (2,))}
    sink = CallbackSink(lambda pairs: None, expected=expected, rename={"x": "y"})
    found = sink.expectations()
    assert isinstance(found, Expectations)
    with pytest.raises(MismatchError) as info:
        found.check(TensorSpec("layers.0.wieght", "float32", (2,), 0, 8))
    text = str(info.value)
    assert "renamed to 'layers.0.wieght'" in text
    assert "nearest: 'layers.0.weight'" in text
    assert "check rename=" in text


# --- 3. an endpoint without a scheme ---------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["localhost:5555", "127.0.0.1:5555"])
def test_an_endpoint_without_a_scheme_says_which_schemes(endpoint: str) -> None:
    remedy = f"tcp://{endpoint} or ipc://PATH"
    with pytest.raises(UsageError, match="needs a scheme") as made:
        WeightReceiver(ModuleSink({"w": torch.zeros(2)}), endpoint)
    assert remedy in str(made.value)
    with pytest.raises(UsageError, match="needs a scheme") as made:
        WeightSender(endpoint)
    assert remedy in str(made.value)
    with pytest.raises(UsageError, match="needs a scheme"):
        ZmqChannel.connect(endpoint)
    with pytest.raises(UsageError, match="needs a scheme"):
        ZmqListener(endpoint)


# --- 4. the CLI names its flags ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["trainer", "--endpoint", "tcp://10.1.2.3:5555"], ["--keypair", "--server-key"]),
        (["engine", "--endpoint", "tcp://0.0.0.0:5555"], ["--keypair", "--allow"]),
        (
            ["engine", "--endpoint", "tcp://0.0.0.0:5555", "--insecure-loopback"],
            ["not a loopback address", "--keypair", "--allow"],
        ),
        (["serve", "--publish", "tcp://10.1.2.3:0"], ["--publish", "--keypair", "--allow"]),
        (["engine", "--endpoint", "inproc://engine"], ["--endpoint", "ipc://"]),
    ],
)
def test_the_cli_names_its_key_flags_not_the_python_api(
    argv: list[str], flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    for flag in flags:
        assert flag in error, error
    for api in ("ChannelAuth", "auth=", "insecure_loopback", "InprocListener"):
        assert api not in error, error


# --- 5. inproc:// is refused, with the in-process way named ----------------------------------


async def test_inproc_is_refused_and_the_in_process_listener_works_instead() -> None:
    engine = {"w": torch.zeros(8)}
    with pytest.raises(UsageError, match="no sender can reach it") as made:
        WeightReceiver(ModuleSink(engine), "inproc://engine")
    assert "InprocListener" in str(made.value)
    with pytest.raises(UsageError, match="no receiver can be reached"):
        WeightSender("inproc://engine")
    with pytest.raises(UsageError, match="no sender can reach it"):
        ZmqListener("inproc://engine")
    listener = InprocListener("engine")
    async with (
        WeightReceiver(ModuleSink(engine), listener) as receiver,
        WeightSender(listener.connect(), config=SMALL) as sender,
    ):
        await sender.send({"w": torch.arange(8.0)}, version=0)
        assert receiver.current_version == 0
    assert torch.equal(engine["w"], torch.arange(8.0))


# --- 6. a sink of an older shape is refused at start, naming what it lacks -------------------


class OlderSink:
    """A sink written before ``staged`` and ``expectations()`` were asked of every sink."""

    device = torch.device("cpu")

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Take the bucket (never reached)."""

    def commit(self, version: int) -> None:
        """Nothing to make visible."""

    def abort(self) -> None:
        """Nothing to forget."""


def test_a_sink_of_an_older_shape_is_refused_at_start_naming_what_it_lacks() -> None:
    with pytest.raises(UsageError) as made:
        WeightReceiver(OlderSink())  # type: ignore[arg-type]
    text = str(made.value)
    assert "OlderSink" in text
    assert "staged, expectations()" in text
    assert "apply_bucket()" not in text  # it has that


# --- 7. a clean close is not a broken group at exit ------------------------------------------


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> torch.distributed.ProcessGroup:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    hosted = host_store(timeout=timedelta(seconds=30))
    group = init_process_group(
        "gloo", store=token_store(hosted.store, new_token()), world_size=1, rank=0,
        group_name=f"messages-{uuid.uuid4().hex}",
    )  # fmt: skip
    return group


def _at_exit_alone(monkeypatch: pytest.MonkeyPatch, executor: GroupExecutor) -> None:
    """Run the exit hook over ``executor`` only (not other tests' groups), without grace."""
    monkeypatch.setattr(executor_module, "_running", weakref.WeakSet([executor]))
    monkeypatch.setattr(executor_module, "EXIT_GRACE", 0.0)
    executor_module._join_at_exit()


def test_a_group_still_releasing_after_a_clean_close_is_not_called_broken_at_exit(
    one_rank_group: torch.distributed.ProcessGroup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    releasing, go_on = threading.Event(), threading.Event()
    destroy = destroy_side_group

    def slow_destroy(group: torch.distributed.ProcessGroup | None) -> None:
        releasing.set()
        go_on.wait(30)
        destroy(group)

    monkeypatch.setattr(executor_module, "destroy_side_group", slow_destroy)
    executor = GroupExecutor("clean-close", group=one_rank_group, join_timeout=0.05)
    executor.start()
    executor.close(wait=False)  # as a plane's close does; the process exits meanwhile
    assert releasing.wait(30)
    try:
        with caplog.at_level(logging.DEBUG, logger="aiosync.collectives.executor"):
            _at_exit_alone(monkeypatch, executor)
    finally:
        go_on.set()
        executor._thread.join(30)
    assert executor.broken is None
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    assert any("release is still running at exit" in r.getMessage() for r in caplog.records)


def test_a_collective_still_running_at_exit_is_still_a_warning(
    one_rank_group: torch.distributed.ProcessGroup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    running, go_on = threading.Event(), threading.Event()
    executor = GroupExecutor("busy-at-exit", group=one_rank_group, join_timeout=0.05)
    executor.start()

    def blocked() -> None:
        running.set()
        go_on.wait(30)

    executor.submit(blocked)
    assert running.wait(30)
    try:
        with caplog.at_level(logging.WARNING, logger="aiosync.collectives.executor"):
            _at_exit_alone(monkeypatch, executor)
    finally:
        go_on.set()
        executor._thread.join(30)
    assert executor.broken is not None
    assert any("busy-at-exit broken" in r.getMessage() for r in caplog.records)


# --- 8. a CollectiveSender reaches engines in the trainer's own process ----------------------


@only_asyncio
@pytest.mark.parametrize("per_tensor", [False, True], ids=["packed", "per-tensor"])
async def test_a_collective_sender_reaches_engines_in_its_own_process(
    per_tensor: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    sent = mixed_weights(seed=3)
    models = [zeros_like(sent), zeros_like(sent)]
    options = CollectiveOptions(engines=2, per_tensor=per_tensor, timeout=30)
    async with (
        WeightReceiver(ModuleSink(models[0])) as first,
        WeightReceiver(ModuleSink(models[1])) as second,
        CollectiveSender(
            [first.endpoint, second.endpoint], collective=options, config=SMALL
        ) as sender,
    ):
        report = await sender.send(sent, version=0)
        assert sorted(report.committed) == sorted([first.endpoint, second.endpoint])
        assert first.current_version == second.current_version == 0
    for model in models:
        assert_same(model, sent)
