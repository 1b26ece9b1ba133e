"""NeMo-RL's own call pattern: the policy worker binds its REQ socket, the engine connects.

The policy worker (``tests.helpers.nemo_rl_bind_worker.PolicyWorker``) makes a plain
``zmq.Context().socket(zmq.REQ)``, binds it and calls the drop-in; the vLLM-shaped worker
is a :class:`~aiosync.BackgroundReceiver` made with ``connect=``. Two sockets bound on one
``ipc://`` path are refused at once, naming the path, whichever side binds second.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch
import zmq

from aiosync import AiosyncError, BackgroundReceiver, ModuleSink, UsageError, WeightReceiver
from aiosync.channels import unix_listeners
from aiosync.channels.unix_listeners import UnixListener, displaced, parse_diag
from aiosync.compat import nemo_rl
from tests.conftest import requires_cuda
from tests.helpers.nemo_rl_bind_worker import PolicyWorker, empty_model, weights
from tests.helpers.peer_processes import first, process

WAIT = 60.0  # seconds any step of these tests may take before it counts as hung

needs_unix_diag = pytest.mark.skipif(
    unix_listeners.listening_unix_sockets() is None,
    reason="the kernel does not list unix sockets (no unix_diag)",
)


@pytest.fixture
def address() -> Iterator[str]:
    """An ``ipc://`` address in a fresh short directory (unix socket paths are short)."""
    directory = tempfile.mkdtemp(prefix="nrl-", dir="/tmp")
    try:
        yield f"ipc://{directory}/0.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def bit_exact(model: dict[str, torch.Tensor], step: int) -> bool:
    """Whether the engine's tensors are exactly the policy's after ``step``."""
    sent = weights(step)
    return model.keys() == sent.keys() and all(torch.equal(model[n].cpu(), sent[n]) for n in sent)


class PolicyThread:
    """A policy worker streaming from a thread; its error is kept for the test to raise."""

    def __init__(self, worker: PolicyWorker, steps: range) -> None:
        self.worker, self.steps = worker, steps
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="policy-worker")

    def _run(self) -> None:
        try:
            for step in self.steps:
                self.worker.stream_weights_via_ipc_zmq(step)
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the policy worker hung"
        if self.error is not None:
            raise self.error


# --- the pattern as NeMo-RL writes it ----------------------------------------------------


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]
)
def test_a_bound_policy_socket_streams_to_a_connecting_vllm_worker_in_two_processes(
    address: str, device: str
) -> None:
    model = {name: tensor.to(device) for name, tensor in empty_model().items()}
    with BackgroundReceiver(model, connect=address) as vllm_worker:  # before the bind
        assert vllm_worker.endpoint == address
        with process("tests.helpers.nemo_rl_bind_worker", address, "2", device) as policy:
            assert first(policy, "bound")["address"] == address
            assert vllm_worker.wait_for_version(1, timeout=WAIT) == 1
            done = first(policy, "done")
            assert done["event"] == "done"
            assert policy.wait(timeout=WAIT) == 0
        assert bit_exact(model, 1)
        assert vllm_worker.failures == []


@pytest.mark.parametrize("order", ["engine connects first", "policy binds first"])
@pytest.mark.parametrize("kind", ["REQ", "DEALER"])
def test_the_engine_may_connect_before_or_after_the_policy_binds(
    address: str, order: str, kind: str
) -> None:
    model = empty_model()
    worker = PolicyWorker(address, getattr(zmq, kind))
    policy = PolicyThread(worker, range(3))
    try:
        if order == "policy binds first":
            worker.maybe_init_zmq()
            policy.thread.start()  # its hello waits for an engine to connect
        with BackgroundReceiver(model, connect=address) as vllm_worker:
            if order == "engine connects first":
                policy.thread.start()
            policy.join()
            assert vllm_worker.current_version == 2
            assert bit_exact(model, 2)
    finally:
        worker.shutdown()


def test_a_restarted_policy_worker_binds_again_and_the_engine_follows(address: str) -> None:
    model = empty_model()
    with BackgroundReceiver(model, connect=address) as vllm_worker:
        for steps in (range(2), range(2, 4)):  # the second worker is a fresh process's
            worker = PolicyWorker(address)
            try:
                policy = PolicyThread(worker, steps)
                policy.thread.start()
                policy.join()
            finally:
                worker.shutdown()
            assert bit_exact(model, steps[-1])
        assert vllm_worker.current_version == 3  # a new sender goes on from the engine's


async def test_an_async_weight_receiver_connects_too(address: str) -> None:
    model = empty_model()
    worker = PolicyWorker(address)
    try:
        async with WeightReceiver(ModuleSink(model), connect=address) as receiver:
            assert receiver.endpoint == address
            await anyio.to_thread.run_sync(worker.stream_weights_via_ipc_zmq, 0)
            assert receiver.current_version == 0
            assert bit_exact(model, 0)
        assert Path(address.removeprefix("ipc://")).exists()  # the policy's file is left
    finally:
        worker.shutdown()


def test_bind_and_connect_together_are_refused(address: str) -> None:
    with pytest.raises(UsageError, match="or connect to"):
        WeightReceiver(ModuleSink(empty_model()), address, connect=address)


def test_a_bound_socket_nobody_connects_to_says_the_engine_must_connect(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nemo_rl.TIMEOUT_ENV, "1")
    worker = PolicyWorker(address)
    try:
        with pytest.raises(TimeoutError, match=r"no engine reached.*connect=") as info:
            worker.stream_weights_via_ipc_zmq(0)
        assert isinstance(info.value, AiosyncError)
        assert address in str(info.value)
    finally:
        worker.shutdown()


# --- two sides binding one path ------------------------------------------------------------


@needs_unix_diag
def test_a_policy_bind_over_a_bound_engine_is_refused_at_once_naming_the_path(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nemo_rl.TIMEOUT_ENV, "30")  # a wait for the engine would end in 30 s
    model = empty_model()
    with BackgroundReceiver(model, address) as engine:  # the engine binds the path
        worker = PolicyWorker(address)
        try:
            worker.maybe_init_zmq()  # ZMQ lets the second bind take the path over
            with pytest.raises(RuntimeError, match="bound twice") as info:
                worker.stream_weights_via_ipc_zmq(0)
            assert isinstance(info.value, AiosyncError)
            assert address in str(info.value)
            assert "connect=" in str(info.value)
        finally:
            worker.shutdown()
        assert engine.current_version is None
    assert bit_exact(model, 0) is False


def test_an_engine_binding_the_policy_workers_path_is_refused_naming_it(address: str) -> None:
    worker = PolicyWorker(address)
    try:
        worker.maybe_init_zmq()
        refused = BackgroundReceiver(empty_model(), address)
        with pytest.raises(AiosyncError, match="address in use") as info, refused:
            pass
        assert address in str(info.value)
        assert "connect=" in str(info.value)
    finally:
        worker.shutdown()


@needs_unix_diag
async def test_an_engine_connecting_to_a_path_bound_twice_is_refused(address: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    first_bound, second_bound = ctx.socket(zmq.ROUTER), ctx.socket(zmq.REQ)
    try:
        first_bound.bind(address)
        second_bound.bind(address)
        with pytest.raises(AiosyncError, match="bound twice") as info:
            async with WeightReceiver(ModuleSink(empty_model()), connect=address):
                pass
        assert address in str(info.value)
    finally:
        for sock in (first_bound, second_bound):
            sock.close(linger=0)
        ctx.term()


@needs_unix_diag
def test_one_bind_and_one_connect_pass_the_check(address: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    bound, connected = ctx.socket(zmq.ROUTER), ctx.socket(zmq.REQ)
    try:
        bound.bind(address)
        connected.connect(address)
        unix_listeners.refuse_double_bind(address)  # nothing raised
    finally:
        for sock in (bound, connected):
            sock.close(linger=0)
        ctx.term()


# --- the kernel's answer, parsed -----------------------------------------------------------


def _attr(kind: int, value: bytes) -> bytes:
    size = 4 + len(value)
    return struct.pack("=HH", size, kind) + value + b"\0" * (-size % 4)


def _message(kind: int, body: bytes) -> bytes:
    size = 16 + len(body)
    return struct.pack("=IHHII", size, kind, 2, 1, 0) + body + b"\0" * (-size % 4)


def _listener(inode: int, name: bytes, ino: int, major: int, minor: int) -> bytes:
    head = struct.pack("=BBBBIII", socket.AF_UNIX, socket.SOCK_STREAM, 10, 0, inode, 0, 0)
    vfs = struct.pack("=II", ino, major << 20 | minor)
    return _message(20, head + _attr(0, name) + _attr(1, vfs))


def test_parse_diag_reads_names_files_and_the_end_of_the_dump() -> None:
    data = (
        _listener(7, b"/tmp/a.sock\0", 99, 254, 3)
        + _listener(8, b"\0abstract", 0, 0, 0)
        + _message(3, struct.pack("=i", 0))
    )
    listeners, done = parse_diag(data)
    assert done
    assert listeners[0] == UnixListener(7, b"/tmp/a.sock", (os.makedev(254, 3), 99))
    assert listeners[1].name == b"\0abstract"
    assert parse_diag(_listener(7, b"/x\0", 1, 0, 1))[1] is False  # more to come


def test_parse_diag_raises_the_kernels_error() -> None:
    with pytest.raises(OSError, match="sock_diag") as info:
        parse_diag(_message(2, struct.pack("=i", -2) + b"\0" * 16))
    assert info.value.errno == 2


def _stat(dev: int, ino: int) -> os.stat_result:
    return os.stat_result((0o140755, ino, dev, 1, 0, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("listeners", "expected"),
    [
        ([UnixListener(1, b"/p", (5, 10))], []),  # the one that holds the file
        ([UnixListener(1, b"/p", (5, 10)), UnixListener(2, b"/p", (5, 9))], [2]),  # displaced
        ([UnixListener(1, b"/p", (5, 10)), UnixListener(2, b"/p", (6, 9))], []),  # elsewhere
        ([UnixListener(1, b"/q", (5, 9))], []),  # another path
        ([UnixListener(1, b"/p", None)], []),  # no file known
    ],
)
def test_displaced_means_same_name_same_filesystem_another_file(
    listeners: list[UnixListener], expected: list[int]
) -> None:
    assert displaced(listeners, "/p", _stat(5, 10)) == expected


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5555", "ipc://relative.sock", "ipc:///nowhere/at/all.sock"]
)
def test_refuse_double_bind_passes_what_it_cannot_judge(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []
    never: Callable[[], None] = lambda: asked.append(True)  # noqa: E731
    monkeypatch.setattr(unix_listeners, "listening_unix_sockets", never)
    unix_listeners.refuse_double_bind(endpoint)
    assert asked == []
