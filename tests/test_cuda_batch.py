"""A stream's copies queued with one ``cudaMemcpyBatchAsync`` (issue 10, performance).

The grouping by stream and the fallback to one call a copy run everywhere (the runtime's
calls replaced by recorders); the GPU tests (marked, skipped without CUDA) check that
batched copies are bit-exact and stream-ordered, on a stream of the caller's and on the
legacy default stream, which the runtime refuses batches on.
"""

from __future__ import annotations

import logging

import pytest
import torch

from aiosync.core.errors import AiosyncError
from aiosync.planes import cuda_batch, cuda_copies
from aiosync.planes.cuda_copies import SPREAD_MIN_BYTES, DeviceCopies, deal, split_lanes
from tests.conftest import requires_cuda

MiB = 1 << 20


def test_split_lanes_groups_the_copies_by_stream_in_order() -> None:
    jobs = [(k, 100 + k, size) for k, size in enumerate([9, 1, 1, 5, 2])]
    lanes = deal([size for _, _, size in jobs], 2)
    assert split_lanes(jobs, lanes) == [
        [jobs[0]],
        [jobs[1], jobs[2], jobs[3], jobs[4]],
    ]
    assert split_lanes(jobs[:2], [1, 1]) == [[jobs[0], jobs[1]]]  # an empty stream: no group
    assert split_lanes([], []) == []


class Runtime:
    """The two copy calls, recorded; the batch call refuses while ``refuse`` is set."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.batches: list[tuple[list[int], list[int], list[int], int]] = []
        self.singles: list[tuple[int, int, int, int]] = []

    def batch(self, dsts: tuple[int], srcs: tuple[int], sizes: tuple[int], stream: int) -> None:
        if self.refuse:
            raise AiosyncError("cudaMemcpyBatchAsync of 3 copies failed: not supported")
        self.batches.append((list(dsts), list(srcs), list(sizes), stream))

    def single(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.singles.append((dst, src, nbytes, stream))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    runtime = Runtime()
    monkeypatch.setattr(cuda_copies, "memcpy_batch_async", runtime.batch)
    monkeypatch.setattr(cuda_copies, "memcpy_async", runtime.single)
    return runtime


JOBS = [(1000, 10, 4), (2000, 20, 5), (3000, 30, 6)]


def test_a_streams_copies_go_in_one_batch_call(fake: Runtime) -> None:
    copies = DeviceCopies(0)
    copies._copy(JOBS, 77, batched=True)
    assert fake.batches == [([1000, 2000, 3000], [10, 20, 30], [4, 5, 6], 77)]
    assert fake.singles == []


@pytest.mark.parametrize(
    ("jobs", "handle", "batched"),
    [
        (JOBS, 0, True),  # the legacy default stream takes no batch
        (JOBS[:2], 77, True),  # too few copies to be worth the arrays
        (JOBS, 77, False),  # batches off
    ],
)
def test_copies_go_one_by_one_where_a_batch_is_not_taken(
    fake: Runtime, jobs: list[tuple[int, int, int]], handle: int, batched: bool
) -> None:
    DeviceCopies(0)._copy(jobs, handle, batched)
    assert fake.batches == []
    assert fake.singles == [(*job, handle) for job in jobs]


def test_a_refused_batch_goes_one_by_one_and_batches_stay_off(
    fake: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    fake.refuse = True
    copies = DeviceCopies(0)
    with caplog.at_level(logging.WARNING, logger="aiosync.planes.cuda_copies"):
        copies._copy(JOBS, 77, batched=True)
    assert fake.singles == [(*job, 77) for job in JOBS]
    assert copies.batched is False
    assert "go one by one" in caplog.text
    assert "not supported" in caplog.text


def test_a_batch_refused_where_single_copies_fail_too_raises_and_keeps_batches(
    fake: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error left by earlier work (the runtime reports it at any call) is not the batch's."""
    fake.refuse = True

    def broken(*_: object) -> None:
        raise AiosyncError("cudaMemcpyAsync failed: an illegal memory access")

    monkeypatch.setattr(cuda_copies, "memcpy_async", broken)
    copies = DeviceCopies(0)
    with pytest.raises(AiosyncError, match="illegal memory access"):
        copies._copy(JOBS, 77, batched=True)
    assert copies.batched is True


@pytest.mark.gpu
@requires_cuda
def test_the_runtime_torch_loaded_has_the_batch_call_from_cuda_12_8() -> None:
    version = torch.version.cuda or "0.0"
    major, minor = (int(part) for part in version.split(".")[:2])
    assert cuda_batch.batch_available() is ((major, minor) >= (12, 8))


@pytest.mark.gpu
@requires_cuda
def test_a_batch_copies_every_range_bit_exact() -> None:
    if not cuda_batch.batch_available():
        pytest.skip("the CUDA runtime has no cudaMemcpyBatchAsync")
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    sizes = [1, 17, 4096, 3 * MiB + 5, 512]
    sources = [
        torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0", generator=gen)
        for n in sizes
    ]
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda:0") for n in sizes]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_batch.memcpy_batch_async(
            [t.data_ptr() for t in targets],
            [s.data_ptr() for s in sources],
            sizes,
            stream.cuda_stream,
        )
    stream.synchronize()
    for src, dst in zip(sources, targets, strict=True):
        assert torch.equal(src, dst)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("spread", [False, True])
def test_batched_copies_on_the_default_stream_run_in_its_order(
    spread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the legacy default stream the batches run on side streams, forked and joined."""
    if not cuda_batch.batch_available():
        pytest.skip("the CUDA runtime has no cudaMemcpyBatchAsync")
    handles: list[int] = []
    batch = cuda_batch.memcpy_batch_async

    def recorded(dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> None:
        handles.append(stream)
        batch(dsts, srcs, sizes, stream)

    monkeypatch.setattr(cuda_copies, "memcpy_batch_async", recorded)
    size = (SPREAD_MIN_BYTES if spread else MiB) // 8
    sources = [torch.full((size,), k, dtype=torch.uint8, device="cuda:0") for k in range(8)]
    targets = [torch.zeros_like(s) for s in sources]
    jobs = [(d.data_ptr(), s.data_ptr(), size) for d, s in zip(targets, sources, strict=True)]
    copies = DeviceCopies(0)
    stream = torch.cuda.default_stream()
    assert stream.cuda_stream == 0
    with torch.cuda.stream(stream):
        for round_ in range(3):
            torch.cuda._sleep(2_000_000)  # the copies must wait for this
            for src in sources:
                src.add_(1)  # queued before the copies on the default stream
            copies.queue(jobs, stream)
            sums = torch.stack([t.sum(dtype=torch.int64) for t in targets])  # after them
            expected = torch.stack([s.sum(dtype=torch.int64) for s in sources])
            assert torch.equal(sums.cpu(), expected.cpu()), round_
    assert 0 not in handles
    assert len(handles) == 3 * (2 if spread else 1)
    assert copies.batched
