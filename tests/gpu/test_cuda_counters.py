"""The trainer's counter (aiosync.planes.cuda_counters) on a GPU; skipped without one.

A stream that waits on a counter value runs nothing queued behind it until the value is
written; a written value lets it go; the counter compares modulo 2**32. An engine whose
session ends with its stream still waiting lets it go when it closes the plane (two
processes: CUDA cannot open a process's own IPC handles).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from aiosync.planes.cuda import CudaSenderPlane
from aiosync.planes.cuda_counters import reached, wait_value, write_now, write_value
from tests.conftest import requires_cuda
from tests.helpers.peer_processes import first
from tests.helpers.peer_processes import process as peer_process

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_a_stream_waits_for_the_value_and_goes_on_once_it_is_written() -> None:
    word = torch.zeros(128, dtype=torch.int32, device="cuda:0")
    address = word.data_ptr()
    waiting, writer = torch.cuda.Stream(), torch.cuda.Stream()
    target = torch.zeros(4, device="cuda:0")
    source = torch.arange(4.0, device="cuda:0")
    torch.cuda.synchronize()
    wait_value(waiting.cuda_stream, address, 3)
    with torch.cuda.stream(waiting):
        target.copy_(source)
        done = torch.cuda.Event()
        done.record(waiting)
    write_value(writer.cuda_stream, address, 2)  # not yet: 2 < 3
    writer.synchronize()
    assert not done.query()  # (no device-wide wait here: it would wait for ``waiting``)
    assert not reached(word, 3)
    assert reached(word, 2)
    write_value(writer.cuda_stream, address, 3)
    done.synchronize()
    assert torch.equal(target, source)


def test_the_counter_compares_across_its_wrap() -> None:
    word = torch.zeros(128, dtype=torch.int32, device="cuda:0")
    write_now(0, word.data_ptr(), 0xFFFFFFFF)
    assert reached(word, 0xFFFFFFFE)
    assert not reached(word, 0x1_0000_0000 + 1)  # 1 after the wrap: still ahead
    write_now(0, word.data_ptr(), 0x1_0000_0002)  # written as 2
    assert reached(word, 0x1_0000_0001)
    stream = torch.cuda.Stream()
    wait_value(stream.cuda_stream, word.data_ptr(), 0x1_0000_0001)
    stream.synchronize()  # 2 reaches 1 past the wrap: no wait


def test_an_engine_closing_its_plane_lets_go_of_its_own_stream_and_no_other() -> None:
    plane = CudaSenderPlane(torch.device("cuda:0"), 1, 4096)
    try:
        plane._buffers[0].tensor.fill_(7)
        torch.cuda.synchronize()
        _, first_word = plane.spec_for_link()  # another engine's session
        spec, word = plane.spec_for_link()
        assert (first_word, word) == (0, 1)
        hexed = msgspec.msgpack.encode(spec).hex()
        with peer_process("tests.helpers.cuda_peers", "waiting_engine", "--spec", hexed) as engine:
            assert first(engine, "waiting")["pending"] is True  # the trainer never set 1
            closed = first(engine, "closed")  # the close let the copy go
            assert closed["copied"] == [7] * 16
            assert engine.wait(timeout=60) == 0
        assert plane._counter is not None
        counters = plane._counter.tensor
        assert reached(counters[4:8], 1)  # the engine set its own word
        assert not reached(counters[0:4], 1)  # and not the other engine's
    finally:
        plane.close()


def test_arm_pack_and_disarm_set_the_engines_words_once_each() -> None:
    from aiosync.core.errors import AiosyncError
    from aiosync.core.layout import plan_buckets

    plane = CudaSenderPlane(torch.device("cuda:0"), 2, 1 << 20)
    try:
        assert plane._counter is not None
        counters = plane._counter.tensor
        words = [plane.spec_for_link()[1], plane.spec_for_link()[1]]
        assert words == [0, 1]
        tensors = {"a": torch.ones(1000, device="cuda:0")}
        (plan,) = plan_buckets(tensors.items(), 1 << 20)
        plane.begin_version()
        with pytest.raises(AiosyncError, match="not all handed out"):
            plane.arm(0, [0, 2])
        assert plane.arm(0, [0, 1]) == 1
        with pytest.raises(AiosyncError, match="still to be packed"):
            plane.arm(0, [0, 1])
        plane.pack(1, plan)  # another buffer: not the one armed
        torch.cuda.synchronize()
        assert not reached(counters[0:4], 1)
        plane.pack(0, plan)
        torch.cuda.synchronize()
        assert reached(counters[0:4], 1)
        assert reached(counters[4:8], 1)
        assert plane.arm(0, [1]) == 2
        plane.disarm()  # no pack came: set on the packing stream
        torch.cuda.synchronize()
        assert reached(counters[4:8], 2)
        assert not reached(counters[0:4], 2)  # not armed for this engine
        plane.disarm()  # nothing armed: nothing to do
        torch.cuda.synchronize()
        assert not reached(counters[4:8], 3)
    finally:
        plane.close()
