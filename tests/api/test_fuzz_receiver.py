"""A live receiver under random, mutated, oversized and hostile frames (issue 8's fuzz test).

The engine runs in a thread of its own, as a rollout server would; frames arrive from raw
DEALER sockets, a fresh one per example. Afterwards the engine is still up, still at its
version, what it keeps per peer is bounded (nothing for a peer without a session), and a
real trainer's next version commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.wire import (
    PROTOCOL,
    Abort,
    Begin,
    Bucket,
    Commit,
    Complete,
    CudaPlaneSpec,
    Goodbye,
    Hello,
    Ping,
    ShmHandle,
    ShmPlaneSpec,
    Slot,
    encode,
)
from aiosync.planes.shm import ShmSenderPlane
from aiosync.runtime import run

LIMITS = Limits(max_message_bytes=1 << 20, max_failures=50, max_bucket_tensors=1000)
MODEL = {"w": torch.zeros(8), "b": torch.zeros(2)}

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
names = st.text(max_size=20)
specs = st.builds(
    TensorSpec,
    names,
    st.sampled_from(["float32", "int8", "nope"]),
    st.tuples(ints),
    ints,
    ints,
    ints,
)
hostile = st.one_of(
    st.builds(
        Hello,
        ints,
        ints,
        names,
        names,
        st.one_of(
            st.builds(ShmPlaneSpec, st.lists(st.builds(ShmHandle, names, ints), max_size=3)),
            st.builds(
                CudaPlaneSpec,
                ints,
                ints,
                st.lists(st.binary(max_size=8), max_size=2),
                st.lists(st.binary(max_size=8), max_size=2),
            ),
        ),
    ),
    st.builds(
        Begin,
        ints,
        st.one_of(
            st.none(),
            st.lists(
                st.builds(
                    TensorMeta, names, st.sampled_from(["float32", "bad"]), st.tuples(ints), ints
                ),
                max_size=4,
            ),
        ),
    ),
    st.builds(
        Bucket,
        ints,
        ints,
        ints,
        ints,
        st.lists(st.builds(Slot, ints, ints, ints, ints), max_size=4),
        st.lists(specs, max_size=4),
    ),
    st.builds(Complete, ints, ints, ints, ints),
    st.builds(Commit, ints, ints),
    st.builds(Abort, names, st.one_of(st.none(), ints)),
    st.builds(Goodbye, names),
    st.builds(Ping, names),
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "mutated", "hostile", "oversized", "empty"]))
    if kind == "random":
        return draw(st.binary(max_size=256))
    if kind == "empty":
        return b""
    if kind == "oversized":
        return b"\x91" * (LIMITS.max_message_bytes + draw(st.integers(1, 4096)))
    payload = encode(draw(hostile))
    if kind == "mutated" and payload:
        data = bytearray(payload)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    return payload


class LiveEngine:
    """A WeightReceiver serving in a thread's event loop until stopped."""

    def __init__(self) -> None:
        self.receiver: WeightReceiver | None = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="fuzzed-engine")

    def _main(self) -> None:
        async def serve() -> None:
            config = ReceiverConfig(limits=LIMITS, session_timeout=30)
            async with WeightReceiver(ModuleSink(MODEL), config=config) as receiver:
                self.receiver = receiver
                self.ready.set()
                await anyio.to_thread.run_sync(self.stop.wait)

        try:
            run(serve)
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.ready.set()


@pytest.fixture
def live_engine() -> Iterator[LiveEngine]:
    engine = LiveEngine()
    engine.thread.start()
    assert engine.ready.wait(30)
    try:
        yield engine
    finally:
        engine.stop.set()
        engine.thread.join(30)


def send_version(endpoint: str, version: int, value: float) -> None:
    weights = {name: torch.full_like(t, value) for name, t in MODEL.items()}

    async def main() -> None:
        async with WeightSender(endpoint, config=SenderConfig(timeout=30)) as sender:
            await sender.send(weights, version=version)

    run(main)


def test_a_fuzzed_engine_stays_up_at_its_version_and_serves_a_real_trainer(
    live_engine: LiveEngine,
) -> None:
    receiver = live_engine.receiver
    assert receiver is not None
    endpoint = receiver.endpoint
    send_version(endpoint, 5, 1.0)
    assert receiver.current_version == 5
    ctx = zmq.Context()
    plane = ShmSenderPlane(2, 1 << 16)  # a real plane, so hostile streams get past hello
    real_hello = encode(Hello(PROTOCOL, PROTOCOL, "s", "fuzz", plane.spec))

    @settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.booleans(), st.lists(frames(), min_size=1, max_size=12))
    def attack(opened: bool, batch: list[bytes]) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            for frame in [real_hello, *batch] if opened else batch:
                sock.send(frame)
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:  # read some replies; never required
                if sock.poll(10):
                    msgspec.msgpack.decode(sock.recv())  # replies are always well formed
        finally:
            sock.close(0)
        assert live_engine.thread.is_alive(), live_engine.error
        assert receiver.current_version == 5
        assert len(receiver.failures) <= LIMITS.max_failures
        assert receiver.sessions <= LIMITS.max_sessions

    try:
        attack()
    finally:
        ctx.term()
        plane.close()
    # what the engine holds for peers is bounded: nothing for the ones without a session
    assert len(receiver._channels) <= receiver.sessions + 1
    assert receiver.sessions <= LIMITS.max_sessions
    send_version(endpoint, 6, 2.0)
    assert receiver.current_version == 6
    assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in MODEL.values())
