from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiosync.compat import teacher
from aiosync.compat.teacher import (
    SHM_HANDLE_TAG,
    aggregate_per_sample_handles,
    ensure_teacher_ipc_buffer,
    open_teacher_ipc_buffer,
    release_teacher_ipc_buffer,
)
from aiosync.core.errors import AiosyncError
from aiosync.runtime import child_env

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
CPU = torch.device("cpu")
OWN_PREFIX = f"aiosync-{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}-"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def own_segments() -> set[str]:
    """Segments in /dev/shm created by this test process."""
    return {p.name for p in SHM.glob(OWN_PREFIX + "*")}


def pid_segments(pid: int) -> set[str]:
    return {p.name for p in SHM.glob(f"aiosync-*-{pid}-*")}


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test releases what it allocates: no new aiosync-<our pid>-* names survive it."""
    before = own_segments()
    yield
    teacher.release_all_teacher_ipc_buffers()
    leaked = own_segments() - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def buffers() -> Iterator[list[torch.Tensor]]:
    """Storages to release at the end of a test that checks names directly."""
    held: list[torch.Tensor] = []
    yield held
    for storage in held:
        release_teacher_ipc_buffer(storage)


def ensure(
    storage: torch.Tensor | None,
    handle: tuple[Any, ...] | None,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    return ensure_teacher_ipc_buffer(storage, handle, *shape, dtype, device)


# --------------------------------------------------------------------------------------
# ensure_teacher_ipc_buffer (CPU / shared memory)
# --------------------------------------------------------------------------------------


def test_lazy_alloc(buffers: list[torch.Tensor]) -> None:
    before = own_segments()
    storage, handle = ensure(None, None, (2, 3, 4, 5))
    buffers.append(storage)
    assert storage.shape == (2, 3, 4, 5)
    assert storage.dtype == torch.float32
    assert storage.device.type == "cpu"
    assert own_segments() - before == {handle[1]}


def test_same_object_within_bounds(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (2, 3, 4, 5))
    buffers.append(storage)
    for shape in [(2, 3, 4, 5), (1, 1, 1, 1), (2, 1, 4, 3)]:
        again, again_handle = ensure(storage, handle, shape)
        assert again is storage
        assert again_handle is handle


def test_missing_handle_is_reexported_without_realloc(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (2, 3, 4, 5))
    buffers.append(storage)
    again, again_handle = ensure(storage, None, (1, 3, 4, 5))
    assert again is storage
    assert again_handle == handle


@pytest.mark.parametrize("dim", range(4))
def test_grow_each_dim(dim: int, buffers: list[torch.Tensor]) -> None:
    base = (2, 3, 4, 5)
    storage, handle = ensure(None, None, base)
    bigger = list(base)
    bigger[dim] += 3
    grown, grown_handle = ensure(storage, handle, (bigger[0], bigger[1], bigger[2], bigger[3]))
    buffers.append(grown)
    assert grown is not storage
    assert tuple(grown.shape) == tuple(bigger)
    assert grown_handle != handle
    assert grown_handle[4] == tuple(bigger)


def test_never_shrinks(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (4, 3, 8, 5))
    # Grows V, asks for less on every other dim: the others keep their old size.
    grown, grown_handle = ensure(storage, handle, (1, 1, 2, 9))
    buffers.append(grown)
    assert tuple(grown.shape) == (4, 3, 8, 9)
    assert grown_handle[4] == (4, 3, 8, 9)
    again, _ = ensure(grown, grown_handle, (1, 1, 1, 1))
    assert again is grown


def test_dtype_change_reallocates(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (2, 3, 4, 5), torch.float32)
    other, other_handle = ensure(storage, handle, (1, 1, 1, 1), torch.bfloat16)
    buffers.append(other)
    assert other is not storage
    assert other.dtype == torch.bfloat16
    assert tuple(other.shape) == (2, 3, 4, 5)  # never shrinks, across dtypes too
    assert other_handle[3] == "bfloat16"
    assert other_handle[2] == 2 * 3 * 4 * 5 * 2
    assert not (SHM / handle[1]).exists()


def test_foreign_cpu_tensor_is_replaced_by_shared_one(buffers: list[torch.Tensor]) -> None:
    plain = torch.zeros(2, 3, 4, 5)
    storage, handle = ensure(plain, None, (2, 3, 4, 5))
    buffers.append(storage)
    assert storage is not plain
    assert handle[0] == SHM_HANDLE_TAG
    assert not release_teacher_ipc_buffer(plain)


def test_old_segment_unlinked_after_growth() -> None:
    listing0 = own_segments()
    storage, handle = ensure(None, None, (1, 2, 3, 4))
    listing1 = own_segments()
    assert listing1 - listing0 == {handle[1]}
    storage[...] = 7.0

    grown, grown_handle = ensure(storage, handle, (1, 2, 3, 8))
    listing2 = own_segments()
    assert handle[1] not in listing2
    assert grown_handle[1] in listing2
    assert listing2 - listing0 == {grown_handle[1]}
    # The old tensor's mapping stays valid after its name is gone.
    assert torch.all(storage == 7.0)
    with pytest.raises(AiosyncError, match="does not exist"):
        open_teacher_ipc_buffer(handle)

    assert release_teacher_ipc_buffer(grown)
    assert own_segments() == listing0
    assert not release_teacher_ipc_buffer(grown)  # idempotent


def test_release_through_a_view() -> None:
    storage, handle = ensure(None, None, (2, 2, 2, 2))
    assert release_teacher_ipc_buffer(storage[1])
    assert not (SHM / handle[1]).exists()


def test_handle_is_plain_data(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (2, 3, 4, 5), torch.bfloat16)
    buffers.append(storage)

    def check(value: object) -> None:
        assert type(value) in (str, int, tuple), f"{value!r} is {type(value)}"
        if isinstance(value, tuple):
            for item in value:
                check(item)

    check(handle)
    tag, name, size, dtype_name, shape = handle
    assert tag == SHM_HANDLE_TAG
    assert name.startswith(OWN_PREFIX)
    assert size == storage.numel() * storage.element_size()
    assert dtype_name == "bfloat16"
    assert shape == (2, 3, 4, 5)
    # A JSON round trip (tuples become lists) still opens.
    reopened = open_teacher_ipc_buffer(json.loads(json.dumps(handle)))
    storage[1, 2, 3, 4] = 3.5
    assert reopened.dtype == torch.bfloat16
    assert reopened.shape == storage.shape
    assert reopened[1, 2, 3, 4].item() == 3.5


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: ("other-kind", *h[1:]),
        lambda h: (*h[:2], h[2] + 4, *h[3:]),
        lambda h: (*h[:3], "not_a_dtype", h[4]),
        lambda h: (*h[:4], (1, 2)),
        lambda h: (h[0], "../../etc/passwd", *h[2:]),
        lambda h: h[:3],
    ],
)
def test_open_rejects_malformed_handles(mutate: Any, buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (1, 2, 3, 4))
    buffers.append(storage)
    with pytest.raises(AiosyncError):
        open_teacher_ipc_buffer(mutate(handle))


def test_rejects_bad_dims_and_devices() -> None:
    with pytest.raises(ValueError, match="positive") as info:
        ensure(None, None, (0, 1, 1, 1))
    assert isinstance(info.value, AiosyncError)
    with pytest.raises(ValueError, match="cuda or cpu") as info:
        ensure(None, None, (1, 1, 1, 1), device=torch.device("meta"))
    assert isinstance(info.value, AiosyncError)


CHILD_CPU = """
import json, sys
import torch
from aiosync.compat.teacher import open_teacher_ipc_buffer
buf = open_teacher_ipc_buffer(json.loads(sys.argv[1]))
assert buf.shape == (2, 3, 4, 5) and buf.dtype == torch.float32, (buf.shape, buf.dtype)
want = torch.arange(3 * 4 * 5, dtype=torch.float32).view(3, 4, 5)
if not torch.equal(buf[0], want):
    sys.exit("child: parent-written values not seen")
buf[1] = -want
print("child ok")
"""


def test_cross_process_cpu(buffers: list[torch.Tensor]) -> None:
    storage, handle = ensure(None, None, (2, 3, 4, 5))
    buffers.append(storage)
    want = torch.arange(3 * 4 * 5, dtype=torch.float32).view(3, 4, 5)
    storage[0] = want
    storage[1] = 0.0
    proc = run_child(CHILD_CPU, json.dumps(handle))
    assert proc.returncode == 0, proc.stderr
    assert "child ok" in proc.stdout
    assert torch.equal(storage[1], -want)
    assert torch.equal(storage[0], want)


# --------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_alloc_reuse_grow() -> None:
    dev = torch.device("cuda", 0)
    storage, handle = ensure(None, None, (2, 3, 4, 5), device=dev)
    assert storage.is_cuda
    assert tuple(storage.shape) == (2, 3, 4, 5)
    assert handle[0] != SHM_HANDLE_TAG
    again, again_handle = ensure(storage, handle, (1, 3, 2, 5), device=torch.device("cuda"))
    assert again is storage
    assert again_handle is handle
    grown, grown_handle = ensure(storage, handle, (1, 1, 1, 9), device=dev)
    assert grown is not storage
    assert tuple(grown.shape) == (2, 3, 4, 9)
    assert grown_handle is not handle
    other, _ = ensure(grown, grown_handle, (1, 1, 1, 1), torch.float16, device=dev)
    assert other.dtype == torch.float16
    assert tuple(other.shape) == (2, 3, 4, 9)
    moved, moved_handle = ensure(other, None, (1, 1, 1, 1), torch.float16, device=CPU)
    assert moved.device.type == "cpu"
    assert tuple(moved.shape) == (2, 3, 4, 9)
    assert moved_handle[0] == SHM_HANDLE_TAG
    assert release_teacher_ipc_buffer(moved)


CHILD_CUDA = """
import json, sys
import torch
from aiosync.planes.cuda_handles import ipc_handle_from_plain
from aiosync.compat.teacher import open_teacher_ipc_buffer
handle = ipc_handle_from_plain(json.loads(sys.argv[1]))
buf = open_teacher_ipc_buffer(handle, device_id=0)
assert buf.is_cuda and buf.shape == (2, 3, 4, 5), (buf.device, buf.shape)
want = torch.arange(3 * 4 * 5, dtype=torch.float32, device=buf.device).view(3, 4, 5)
if not torch.equal(buf[0], want):
    sys.exit("child: parent-written values not seen")
buf[1] = -want
torch.cuda.synchronize()
print("child ok")
"""


@pytest.mark.gpu
@needs_cuda
def test_cross_process_cuda_ipc() -> None:
    from aiosync.planes.cuda_handles import ipc_handle_to_plain

    dev = torch.device("cuda", 0)
    storage, handle = ensure(None, None, (2, 3, 4, 5), device=dev)
    want = torch.arange(3 * 4 * 5, dtype=torch.float32, device=dev).view(3, 4, 5)
    storage[0] = want
    storage[1] = 0.0
    torch.cuda.synchronize()
    payload = json.dumps(ipc_handle_to_plain(handle))
    proc = run_child(CHILD_CUDA, payload)
    assert proc.returncode == 0, proc.stderr
    assert "child ok" in proc.stdout
    torch.cuda.synchronize()
    assert torch.equal(storage[1], -want)
    # The child is gone: free the exported block now rather than at interpreter exit.
    del storage, handle
    torch.cuda.ipc_collect()


# --------------------------------------------------------------------------------------
# aggregate_per_sample_handles
# --------------------------------------------------------------------------------------

GBS = 8
REPLICAS = ("tp0", "tp1", "cp1")


def worker_results(dp: int, *, reverse_ranks: bool = False) -> list[dict[str, Any]]:
    """Results of a DP=dp x 3-replica teacher for one global batch of GBS samples."""
    per_rank = GBS // dp
    ranks = range(dp - 1, -1, -1) if reverse_ranks else range(dp)
    results = []
    for rank in ranks:
        samples = range(rank * per_rank, (rank + 1) * per_rank)
        for replica in REPLICAS:
            handles = [f"s{s}-{replica}" for s in samples]
            results.append({"dp_rank": rank, "per_sample_handles": handles})
    return results


EXPECTED = [{"teacher_shards": [f"s{s}-{r}" for r in REPLICAS]} for s in range(GBS)]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("reverse_ranks", [False, True])
def test_aggregate_independent_of_dp(dp: int, reverse_ranks: bool) -> None:
    assert aggregate_per_sample_handles(worker_results(dp, reverse_ranks=reverse_ranks)) == (
        EXPECTED
    )


def test_aggregate_interleaved_ranks() -> None:
    results = worker_results(4)
    # Ranks interleaved, replicas of each rank still in tp0, tp1, cp1 order.
    interleaved = [
        r for rep in REPLICAS for r in results if r["per_sample_handles"][0].endswith(rep)
    ]
    assert [r["dp_rank"] for r in interleaved[:4]] == [0, 1, 2, 3]
    assert aggregate_per_sample_handles(interleaved) == EXPECTED


def test_aggregate_replica_order_follows_worker_results() -> None:
    results = [
        {"dp_rank": 0, "per_sample_handles": ["a-cp1", "b-cp1"]},
        {"dp_rank": 0, "per_sample_handles": ["a-tp0", "b-tp0"]},
    ]
    assert aggregate_per_sample_handles(results) == [
        {"teacher_shards": ["a-cp1", "a-tp0"]},
        {"teacher_shards": ["b-cp1", "b-tp0"]},
    ]


def test_aggregate_empty() -> None:
    assert aggregate_per_sample_handles([]) == []


def test_aggregate_length_mismatch_is_an_assertion_naming_the_rank() -> None:
    """NeMo-RL asserts that replicas agree; the error is also an AiosyncError."""
    results = worker_results(2)
    results[-1]["per_sample_handles"] = results[-1]["per_sample_handles"][:-1]
    with pytest.raises(AssertionError, match="dp_rank 1") as info:
        aggregate_per_sample_handles(results)
    assert isinstance(info.value, AiosyncError)


def test_aggregate_replica_count_mismatch_is_an_assertion_naming_the_rank() -> None:
    results = worker_results(2)[:-1]  # rank 1 lost a replica
    with pytest.raises(AssertionError, match="dp_rank 1") as info:
        aggregate_per_sample_handles(results)
    assert isinstance(info.value, AiosyncError)


def test_aggregate_missing_key_is_a_key_error() -> None:
    with pytest.raises(KeyError) as info:
        aggregate_per_sample_handles([{"per_sample_handles": []}])
    assert isinstance(info.value, AiosyncError)
    assert str(info.value) == "worker result 0 lacks 'dp_rank'"  # plain text, not quoted
    with pytest.raises(KeyError, match="per_sample_handles"):
        aggregate_per_sample_handles([{"dp_rank": 0, "per_sample_handles": []}, {"dp_rank": 1}])


def test_aggregate_wrong_types_are_type_errors() -> None:
    with pytest.raises(TypeError, match="non-integer") as info:
        aggregate_per_sample_handles([{"dp_rank": "0", "per_sample_handles": []}])
    assert isinstance(info.value, AiosyncError)
    with pytest.raises(TypeError, match="not a mapping") as info:
        aggregate_per_sample_handles([["dp_rank", 0]])  # type: ignore[list-item]
    assert isinstance(info.value, AiosyncError)


# --------------------------------------------------------------------------------------
# the example
# --------------------------------------------------------------------------------------


def test_example_runs() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "distillation_buffers.py")],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.strip().endswith("ok")
    assert not pid_segments(proc.pid), "example left shared-memory segments behind"


def test_no_leftover_segments_from_this_process() -> None:
    """Run last in file order: nothing this test process created is still in /dev/shm."""
    teacher.release_all_teacher_ipc_buffers()
    assert not own_segments()
