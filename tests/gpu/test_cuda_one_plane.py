"""One CUDA plane (issue 27, item 3): ordered for WeightSender, unordered for the topologies.

The plain-data parts run on the CPU: what a colocated part names of a rank's CUDA buffer,
how the engine opens it, the wire form of parts, and the allocation's second try. The
planes themselves need a GPU (marked ``gpu``; a reading engine is a process of its own,
since CUDA cannot open a process's own IPC handles).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from aiosync.core.colocated_parts import RankPart, decode_part, encode_part
from aiosync.core.errors import AiosyncError, ProtocolError, UsageError
from aiosync.core.layout import TensorSpec, plan_buckets
from aiosync.core.wire import CudaPlaneSpec, CudaRegion, DirectPlaneSpec, ShmHandle, ShmPlaneSpec
from aiosync.engine.colocated import _one_buffer
from aiosync.planes import cuda
from aiosync.topology.send import _buffer_of
from tests.conftest import requires_cuda

HANDLE = bytes(range(64))


def test_a_colocated_part_names_a_cuda_buffer_by_its_legacy_handle() -> None:
    assert _buffer_of(CudaPlaneSpec(0, 8192, [HANDLE])) == CudaRegion(HANDLE, 8192)
    segment = ShmHandle("aiosync-1-2-0123456789abcdef", 4096)
    assert _buffer_of(ShmPlaneSpec([segment])) == segment
    with pytest.raises(UsageError, match="DirectPlaneSpec"):
        _buffer_of(DirectPlaneSpec(ShmPlaneSpec([segment]), 4096))


def test_the_engine_opens_a_parts_cuda_buffer_on_its_sinks_gpu_without_events() -> None:
    spec = _one_buffer(CudaRegion(HANDLE, 8192), torch.device("cuda", 3))
    assert spec == CudaPlaneSpec(3, 8192, [HANDLE])
    assert isinstance(spec, CudaPlaneSpec)
    assert (spec.events, spec.counter) == ([], b"")  # the trainer's pack already waited
    segment = ShmHandle("aiosync-1-2-0123456789abcdef", 4096)
    assert _one_buffer(segment, torch.device("cpu")) == ShmPlaneSpec([segment])


def test_a_part_carries_the_cuda_buffer_and_refuses_the_old_storage_handle() -> None:
    specs = [TensorSpec("w", "float32", (4,), 0, 16)]
    part = RankPart(1, 0, 3, buffer=CudaRegion(HANDLE, 8192), used=16, specs=specs)
    assert decode_part(encode_part(part)) == part
    old = msgspec.to_builtins(part)
    old["buffer"] = {"type": "cuda", "device": 0, "handle": b"h", "size": 8192}
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_part(msgspec.msgpack.encode(old))
    big = msgspec.structs.replace(part, used=8193)
    with pytest.raises(ProtocolError):
        decode_part(encode_part(big))  # used beyond the buffer's size


def test_own_memory_is_tried_again_once_torchs_cache_is_emptied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def allocate(size: int, device: int) -> object:
        calls.append(f"malloc {size} on {device}")
        if len(calls) == 1:
            raise AiosyncError("cudaMalloc failed: out of memory (CUDA error 2)")
        return "memory"

    monkeypatch.setattr(cuda.DeviceMemory, "allocate", staticmethod(allocate))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    assert cuda.allocate(4096, 1) == "memory"
    assert calls == ["malloc 4096 on 1", "empty", "malloc 4096 on 1"]
    calls.clear()

    def never(size: int, device: int) -> object:
        calls.append("malloc")
        raise AiosyncError("cudaMalloc failed: out of memory (CUDA error 2)")

    monkeypatch.setattr(cuda.DeviceMemory, "allocate", staticmethod(never))
    with pytest.raises(AiosyncError, match="out of memory"):
        cuda.allocate(4096, 1)
    assert calls == ["malloc", "empty", "malloc"]  # once more, not for ever


def test_the_old_names_still_import() -> None:
    from aiosync.core.wire import CudaLegacyPlaneSpec

    assert cuda.CudaLegacySenderPlane is cuda.CudaSenderPlane
    assert cuda.CudaLegacyReceiverPlane is cuda.CudaReceiverPlane
    assert CudaLegacyPlaneSpec is CudaPlaneSpec


# --------------------------------------------------------------------------------------
# on a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
def test_create_sender_plane_makes_the_one_cuda_plane_ordered_or_not() -> None:
    from aiosync.planes import create_sender_plane

    unordered = create_sender_plane(torch.device("cuda:0"), 2, 1 << 20)
    ordered = create_sender_plane(torch.device("cuda:0"), 2, 1 << 20, ordered=True)
    try:
        assert isinstance(unordered, cuda.CudaSenderPlane)
        assert isinstance(ordered, cuda.CudaSenderPlane)
        assert (unordered.ordered, ordered.ordered) == (False, True)
        spec = unordered.spec
        assert isinstance(spec, CudaPlaneSpec)
        assert (len(spec.handles), spec.events, spec.counter) == (2, [], b"")
        assert unordered.spec_for_link() == (spec, None)  # no counter word to hand out
        assert isinstance(ordered.spec, CudaPlaneSpec)
        assert [len(h) for h in ordered.spec.events] == [64, 64]
        assert len(ordered.spec.counter) == 64
        assert ordered.spec_for_link()[1] == 0
    finally:
        unordered.close()
        ordered.close()


@pytest.mark.gpu
@requires_cuda
def test_an_unordered_pack_returns_with_the_bytes_in_place() -> None:
    plane = cuda.CudaSenderPlane(torch.device("cuda:0"), 1, 64 << 20, ordered=False)
    try:
        tensors = {"a": torch.zeros(4 << 20, device="cuda:0")}
        (plan,) = plan_buckets(tensors.items(), 64 << 20)
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # queued before the pack
        tensors["a"].fill_(3.0)  # the weights' last write, behind the sleep
        plane.pack(0, plan)
        assert stream.query()  # nothing left queued: no wait before reading
        got = plane._buffers[0].tensor[: 16 << 20].view(torch.float32)
        assert torch.equal(got, tensors["a"])
    finally:
        plane.close()


@pytest.mark.gpu
@requires_cuda
def test_an_engine_process_reads_an_unordered_plane_at_once_bit_exact() -> None:
    from tests.helpers.models import digest
    from tests.helpers.peer_processes import first
    from tests.helpers.peer_processes import process as peer_process

    plane = cuda.CudaSenderPlane(torch.device("cuda:0"), 2, 1 << 20, ordered=False)
    try:
        gen = torch.Generator(device="cuda:0")
        gen.manual_seed(27)
        tensors = {"w": torch.randn(1000, 3, device="cuda:0", generator=gen)}
        (plan,) = plan_buckets(tensors.items(), 1 << 20)
        plane.pack(0, plan)
        hexed = msgspec.msgpack.encode(plane.spec).hex()
        argv = ("reader", "--spec", hexed, "--bytes", str(tensors["w"].nbytes))
        with peer_process("tests.helpers.cuda_peers", *argv) as engine:
            read = first(engine, "read")
            assert engine.wait(timeout=60) == 0
        assert read["events"] == []  # its ready says: the engine synchronised
        assert read["digest"] == digest(tensors["w"])
    finally:
        plane.close()
