"""A bucket's device copies spread over two streams (issue 10, performance).

The dealing and the split into copies by address are pure and run everywhere; the GPU
tests (marked, skipped without CUDA) check that spread copies are bit-exact and that, to
work queued later on the caller's stream, they ran on that stream.
"""

from __future__ import annotations

import pytest
import torch

from aiosync.core.layout import plan_buckets
from aiosync.planes.base import BucketContext
from aiosync.planes.cuda_copies import SPREAD_MIN_BYTES, DeviceCopies, deal, plain_jobs
from tests.conftest import requires_cuda

MiB = 1 << 20


def test_deal_gives_each_copy_to_the_least_loaded_stream_in_order() -> None:
    assert deal([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert deal([100, 1, 1, 1, 50], 2) == [0, 1, 1, 1, 1]
    assert deal([5, 5, 5], 1) == [0, 0, 0]
    lanes = deal([7, 3, 9, 1, 4, 4, 8], 3)
    loads = [
        sum(s for s, k in zip([7, 3, 9, 1, 4, 4, 8], lanes, strict=True) if k == w)
        for w in range(3)
    ]
    assert max(loads) - min(loads) <= 9  # never worse than the largest copy
    assert deal([], 2) == []


def test_plain_jobs_leaves_cpu_tensors_to_torch() -> None:
    tensors = {"a": torch.ones(10), "b": torch.arange(6).view(2, 3).t()}
    (plan,) = plan_buckets(tensors.items(), 1024)
    jobs, rest = plain_jobs(torch.empty(1024, dtype=torch.uint8), plan)
    assert jobs == []
    assert [spec.name for spec in rest.specs] == ["a", "b"]
    assert rest.used == plan.used


def test_plain_jobs_refuses_a_bucket_larger_than_the_buffer() -> None:
    (plan,) = plan_buckets([("a", torch.ones(100))], 1024)
    short = plan.used - 1
    with pytest.raises(ValueError, match=f"needs {plan.used} bytes but the buffer holds {short}"):
        plain_jobs(torch.empty(short, dtype=torch.uint8), plan)


@pytest.mark.gpu
@requires_cuda
def test_plain_jobs_are_the_plain_tensors_on_the_device_at_their_offsets() -> None:
    tensors = {
        "plain": torch.ones(100, device="cuda:0"),
        "strided": torch.ones(8, 4, device="cuda:0").t(),
        "cpu": torch.ones(5),
        "empty": torch.empty(0, device="cuda:0"),
    }
    (plan,) = plan_buckets(tensors.items(), 4096)
    buffer = torch.empty(4096, dtype=torch.uint8, device="cuda:0")
    jobs, rest = plain_jobs(buffer, plan)
    spec = plan.specs[0]
    assert jobs == [(buffer.data_ptr() + spec.offset, tensors["plain"].data_ptr(), 400)]
    assert sorted(s.name for s in rest.specs) == ["cpu", "strided"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("width", [1, 2, 3])
def test_spread_copies_are_bit_exact_and_ordered_on_the_callers_stream(width: int) -> None:
    gen = torch.Generator(device="cuda:0").manual_seed(7)
    sizes = [3 * MiB + 5, 17, 6 * MiB, 1, 2 * MiB + 1, 4096, 5 * MiB]
    assert sum(sizes) >= SPREAD_MIN_BYTES  # the spread path, not the one-stream one
    sources = [
        torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0", generator=gen)
        for n in sizes
    ]
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda:0") for n in sizes]
    copies = DeviceCopies(0, width)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for round_ in range(3):
            torch.cuda._sleep(2_000_000)  # the copies must wait for this, on every stream
            for src in sources:
                src.add_(1)  # queued on the caller's stream before the copies
            jobs = [
                (d.data_ptr(), s.data_ptr(), s.nbytes)
                for d, s in zip(targets, sources, strict=True)
            ]
            copies.queue(jobs, stream)
            sums = torch.stack([t.sum(dtype=torch.int64) for t in targets])  # after them
            expected = torch.stack([s.sum(dtype=torch.int64) for s in sources])
            assert torch.equal(sums.cpu(), expected.cpu()), round_
    stream.synchronize()
    for src, dst in zip(sources, targets, strict=True):
        assert torch.equal(src, dst)


@pytest.mark.gpu
@requires_cuda
def test_small_batches_stay_on_the_callers_stream() -> None:
    src = torch.arange(1000, dtype=torch.int32, device="cuda:0")
    dst = torch.zeros_like(src)
    copies = DeviceCopies(0)
    copies.queue([(dst.data_ptr(), src.data_ptr(), 2000)], torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.equal(dst[:500], src[:500])
    assert not dst[500:].any()
    assert copies._fork is None  # no side stream was made


def two_halves() -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """A source of ones, a zeroed target and the two copies (half the spread minimum each)
    that fill it; keep the source alive while the copies run."""
    src = torch.ones(SPREAD_MIN_BYTES, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    half = SPREAD_MIN_BYTES // 2
    jobs = [
        (dst.data_ptr(), src.data_ptr(), half),
        (dst.data_ptr() + half, src.data_ptr() + half, half),
    ]
    return src, dst, jobs


@pytest.mark.gpu
@requires_cuda
def test_a_gate_is_noted_and_taken_by_the_next_batch_of_its_bucket() -> None:
    """Bookkeeping only: gates change when the side stream may start, never what it copies."""
    from aiosync.planes import cuda_copies

    stream = torch.cuda.current_stream()
    gate = torch.cuda.Event()
    gate.record(stream)
    context = BucketContext()
    cuda_copies.wait_gate(stream, gate, context)
    assert context.gates == [gate]
    _src, dst, jobs = two_halves()  # the source lives until the test ends
    DeviceCopies(0).queue(jobs, stream, context)
    assert context.gates == []  # taken by that batch
    torch.cuda.synchronize()
    assert bool(dst.all())


@pytest.mark.gpu
@requires_cuda
def test_one_stream_keeps_only_the_next_batch_on_the_callers_stream() -> None:
    _src, dst, jobs = two_halves()  # the source lives until the test ends
    copies = DeviceCopies(0)
    context = BucketContext(one_stream=True)
    copies.queue(jobs, torch.cuda.current_stream(), context)
    assert copies._fork is None  # one stream
    copies.queue(jobs, torch.cuda.current_stream(), context)
    assert copies._fork is not None  # the batch after is spread again
    torch.cuda.synchronize()
    assert bool(dst.all())


@pytest.mark.gpu
@requires_cuda
def test_hints_stay_with_their_bucket_context() -> None:
    """A batch queued without a context (or with another) takes none of a context's hints."""
    from aiosync.planes import cuda_copies

    stream = torch.cuda.current_stream()
    gate = torch.cuda.Event()
    gate.record(stream)
    context = BucketContext(one_stream=True, graph=True)
    cuda_copies.wait_gate(stream, gate, context)
    _src, dst, jobs = two_halves()  # the source lives until the test ends
    copies = DeviceCopies(0)
    copies.queue(jobs, stream)
    copies.queue(jobs, stream, BucketContext())
    assert copies._fork is not None  # spread: the one-stream hint was not theirs
    assert context.take() == ([gate], True, True)
    assert context.take() == ([], False, False)  # taken once
    torch.cuda.synchronize()
    assert bool(dst.all())


class FakeGraph:
    """Stands in for a CUDA graph: records what it was made of and whether it was closed."""

    def __init__(self, jobs: list[tuple[int, int, int]], device: int, chains: list[int]) -> None:
        self.jobs, self.chains, self.closed = list(jobs), list(chains), False

    def close(self) -> None:
        self.closed = True


def test_a_batch_becomes_a_graph_the_second_time_and_the_oldest_graph_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiosync.planes import cuda_copies

    monkeypatch.setattr(cuda_copies, "CopyGraph", FakeGraph)
    monkeypatch.setattr(cuda_copies, "GRAPHS_KEPT", 2)
    copies = DeviceCopies(0)

    def batch(k: int, n: int = cuda_copies.GRAPH_MIN_JOBS) -> list[tuple[int, int, int]]:
        return [(1000 * k + i, 10**6 + i, 8) for i in range(n)]

    assert copies._graph(batch(1), 4) is None  # seen once: queued copy by copy
    first = copies._graph(batch(1), 4)
    assert isinstance(first, FakeGraph)
    assert first.jobs == batch(1)
    assert first.chains == cuda_copies.deal([8] * len(first.jobs), 4)  # dealt over 4 chains
    assert copies._graph(batch(1), 4) is first  # kept
    assert copies._graph(batch(1), 1) is None  # one stream: another graph, seen once
    assert copies._graph(batch(9, cuda_copies.GRAPH_MIN_JOBS - 1), 4) is None
    assert copies._graph(batch(9, cuda_copies.GRAPH_MIN_JOBS - 1), 4) is None  # too small
    for k in (2, 3):
        copies._graph(batch(k), 4)
        copies._graph(batch(k), 4)
    assert first.closed  # the least recently launched of three went
    assert len(copies._kept) == 2
    kept = list(copies._kept.values())
    copies.close()
    assert all(graph.closed for graph in kept)  # type: ignore[attr-defined]
    assert not copies._kept
    assert not copies._seen


def test_batches_seen_once_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosync.planes import cuda_copies

    monkeypatch.setattr(cuda_copies, "CopyGraph", FakeGraph)
    monkeypatch.setattr(cuda_copies, "SEEN_KEPT", 3)
    copies = DeviceCopies(0)
    jobs = [[(k, i, 8) for i in range(cuda_copies.GRAPH_MIN_JOBS)] for k in range(5)]
    for batch in jobs:
        assert copies._graph(batch, 4) is None
    assert len(copies._seen) == 3
    assert copies._graph(jobs[0], 4) is None  # forgotten: seen once again
    assert copies._graph(jobs[4], 4) is not None  # remembered: made a graph


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("width", [1, 2])
def test_a_recurring_batch_runs_as_a_graph_bit_exact_and_ordered(width: int) -> None:
    """Round 1 copy by copy, round 2 makes the graph, rounds 3 and 4 launch it: each time
    after the work queued before it on the caller's stream and before the work after."""
    from aiosync.planes.cuda_copies import GRAPH_MIN_JOBS

    gen = torch.Generator(device="cuda:0").manual_seed(3)
    sizes = [(i * 7919) % (MiB // 2) + 1 for i in range(2 * GRAPH_MIN_JOBS)] + [9 * MiB]
    sources = [
        torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0", generator=gen)
        for n in sizes
    ]
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda:0") for n in sizes]
    jobs = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in zip(targets, sources, strict=True)]
    copies = DeviceCopies(0, width)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for round_ in range(4):
            torch.cuda._sleep(2_000_000)  # the copies must wait for this
            for src in sources:
                src.add_(1)
            copies.queue(jobs, stream, BucketContext(graph=True))
            assert len(copies._kept) == (0 if round_ == 0 else 1)
            sums = torch.stack([t.sum(dtype=torch.int64) for t in targets])
            expected = torch.stack([s.sum(dtype=torch.int64) for s in sources])
            assert torch.equal(sums.cpu(), expected.cpu()), round_
    stream.synchronize()
    assert all(torch.equal(s, d) for s, d in zip(sources, targets, strict=True))
    assert copies.batches == {"unseen": 1, "graph": 3}
    copies.close()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lanes", [None, 1, 4])
def test_a_copy_graph_copies_every_job_and_refuses_a_launch_once_closed(
    lanes: int | None,
) -> None:
    from aiosync.planes.cuda_copies import deal
    from aiosync.planes.cuda_graphs import CopyGraph

    src = torch.arange(64 * 1024, dtype=torch.int32, device="cuda:0")
    dst = torch.zeros_like(src)
    step = src.nbytes // 32
    jobs = [(dst.data_ptr() + k * step, src.data_ptr() + k * step, step) for k in range(32)]
    graph = CopyGraph(jobs, 0, deal([step] * 32, lanes) if lanes else None)
    graph.launch(torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    graph.close()
    graph.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        graph.launch(torch.cuda.current_stream())


@pytest.mark.gpu
@requires_cuda
def test_a_batch_behind_a_pending_gate_is_queued_copy_by_copy() -> None:
    """A gate still pending (another process's work, here a spin on another stream) keeps
    the batch off its graph; once the gate fired, the recurring batch runs as one. Without
    the hint (``BucketContext.graph``) no batch is ever a graph."""
    from aiosync.planes import cuda_copies

    src = torch.ones(64 * 1024, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    step = src.nbytes // 32
    jobs = [(dst.data_ptr() + k * step, src.data_ptr() + k * step, step) for k in range(32)]
    copies = DeviceCopies(0)
    stream = torch.cuda.current_stream()
    for _ in range(3):
        copies.queue(jobs, stream)  # not asked for: never a graph
    assert not copies._kept
    copies.queue(jobs, stream, BucketContext(graph=True))  # seen once
    other = torch.cuda.Stream()
    gate = torch.cuda.Event()
    with torch.cuda.stream(other):
        torch.cuda._sleep(200_000_000)  # long enough to be pending at the next queue
        gate.record(other)
    context = BucketContext(graph=True)
    cuda_copies.wait_gate(stream, gate, context)
    copies.queue(jobs, stream, context)
    assert not copies._kept  # pending gate: no graph
    torch.cuda.synchronize()
    assert gate.query()
    context = BucketContext(graph=True)
    cuda_copies.wait_gate(stream, gate, context)
    copies.queue(jobs, stream, context)
    assert len(copies._kept) == 1  # fired: the graph
    torch.cuda.synchronize()
    assert bool(dst.all())
    copies.close()


def test_a_graph_the_runtime_cannot_make_leaves_the_copies_one_by_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiosync.core.errors import AiosyncError
    from aiosync.planes import cuda_copies

    def refuse(*_: object) -> None:
        raise AiosyncError("cudaGraphInstantiateWithFlags failed: not supported")

    monkeypatch.setattr(cuda_copies, "CopyGraph", refuse)
    copies = DeviceCopies(0)
    jobs = [(i, 10**6 + i, 8) for i in range(cuda_copies.GRAPH_MIN_JOBS)]
    assert copies._graph(jobs, 4) is None
    assert copies._graph(jobs, 4) is None  # the second time it tried, and was refused
    assert not copies.graphs  # never again on this device
    assert "no CUDA graph" in caplog.text


def test_prune_lets_go_of_what_the_last_version_did_not_ask_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiosync.planes import cuda_copies

    monkeypatch.setattr(cuda_copies, "CopyGraph", FakeGraph)
    copies = DeviceCopies(0)
    old, new = ([(k, i, 8) for i in range(cuda_copies.GRAPH_MIN_JOBS)] for k in (1, 2))
    copies._graph(old, 4)
    stale = copies._graph(old, 4)
    assert isinstance(stale, FakeGraph)
    copies.prune()  # the version that made it
    copies._graph(new, 4)  # the next version reads elsewhere (seen once)
    copies.prune()
    assert stale.closed
    assert not copies._kept
    assert list(copies._seen) == [(4, *new)]  # asked for in the last version: remembered
    fresh = copies._graph(new, 4)
    copies.prune()
    assert isinstance(fresh, FakeGraph)
    assert not fresh.closed
    copies.prune()  # a version that did not read it
    assert fresh.closed
    assert not copies._seen


def test_a_copy_graph_needs_a_chain_for_each_copy() -> None:
    from aiosync.planes import cuda_graphs

    with pytest.raises(ValueError, match="2 chains given for 3 copies"):
        cuda_graphs._add_copies(None, None, [(1, 2, 3)] * 3, [0, 1])  # type: ignore[arg-type]
