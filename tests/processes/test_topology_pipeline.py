"""A colocated topology on the native pipeline, across 4 Gloo trainer processes on the CPU.

The four ranks (tests/helpers/colocate_worker.py, scenarios in
tests/helpers/colocate_pipeline.py) start
once for the module; engines are WeightReceivers over a RankedSink in their source rank's
process, reading every rank's own memfds through a gathered plane.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import aiosync.engine.receiver
import aiosync.planes
import aiosync.planes.gathered
from aiosync.core.engine_actions import OpenPlane
from aiosync.core.errors import MismatchError, ProtocolError
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits
from aiosync.core.wire import (
    GatheredPlaneSpec,
    Hello,
    PlaneSpec,
    ShmHandle,
    ShmPlaneSpec,
    decode,
    encode,
)
from aiosync.engine.receiver import WeightReceiver
from aiosync.engine.sinks import ModuleSink
from aiosync.planes.gathered import GatheredReceiverPlane, part_devices, part_of, split_name
from aiosync.topology.plans import plan_rank, union_plans
from aiosync.topology.sink import RankedSink
from tests.processes.test_topology_gloo import WORLD, World

GROUP_TIMEOUT = 120


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    store = tmp_path_factory.mktemp("gloo") / "store"
    started = World(store)
    try:
        for rank in range(WORLD):
            assert started.read(rank) == {"ready": rank}
        yield started
    finally:
        started.close()


def sources(answers: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {a["engine"]: a for a in answers if "engine_version" in a}


# --- pure parts ---------------------------------------------------------------------------


def test_gathered_spec_round_trips_in_a_hello_and_sizes_are_the_smallest() -> None:
    parts = [ShmPlaneSpec([ShmHandle("a", 1024), ShmHandle("b", 2048)])] * 2
    parts.append(ShmPlaneSpec([ShmHandle("c", 4096), ShmHandle("d", 512)]))
    spec = GatheredPlaneSpec(parts)
    assert spec.sizes == [1024, 512]
    hello = decode(encode(Hello(2, 2, "s", "t", spec)))
    assert isinstance(hello, Hello)
    assert hello.plane == spec


def test_a_gathered_plane_is_bounded_as_a_whole() -> None:
    part = ShmPlaneSpec([ShmHandle("a", 1024)])
    with pytest.raises(ProtocolError, match="3072 bytes"):
        GatheredReceiverPlane(
            GatheredPlaneSpec([part] * 3), torch.device("cpu"), Limits(max_session_bytes=2048)
        )
    with pytest.raises(ProtocolError, match="buffer count"):
        GatheredReceiverPlane(GatheredPlaneSpec([part, ShmPlaneSpec([])]), torch.device("cpu"))
    with pytest.raises(ProtocolError, match="0 parts"):
        GatheredReceiverPlane(GatheredPlaneSpec([]), torch.device("cpu"))


def test_names_say_the_part_and_a_bucket_is_one_part() -> None:
    assert split_name("3/layers.0.w") == (3, "layers.0.w")
    for bad in ("layers.0.w", "x/y", "3/"):
        with pytest.raises(MismatchError):
            split_name(bad)
    spec = TensorSpec("1/a", "float32", (2,), 0, 8)
    assert part_of([spec], 2) == 1
    with pytest.raises(MismatchError, match="mixes"):
        part_of([spec, TensorSpec("0/b", "float32", (2,), 512, 8)], 2)
    with pytest.raises(MismatchError, match="no rank 1"):
        part_of([spec], 1)


def test_union_prefixes_names_goes_round_robin_and_refuses_bad_plans() -> None:
    a = [("w", torch.ones(100)), ("v", torch.ones(200))]
    b = [("w", torch.zeros(100))]
    (pa, local_a), (pb, _) = plan_rank(a, 1024, 0), plan_rank(b, 1024, 1)
    assert len(local_a) == 2  # 400 + 800 bytes do not fit one 1024-byte buffer
    manifest, plans, places = union_plans([pa, pb], 4, 1024)
    assert [m.name for m in manifest] == ["0/w", "0/v", "1/w"]
    assert places == [(0, 0), (1, 0), (0, 1)]
    assert [s.name for p in plans for s in p.specs] == ["0/w", "1/w", "0/v"]
    with pytest.raises(ProtocolError, match="rank 5"):
        union_plans([pa, b"\xc1"], 4, 1024)
    with pytest.raises(ProtocolError, match="does not fit"):
        union_plans([pa], 4, 512)
    failed, _ = plan_rank([("w", object())], 1024, 7)  # type: ignore[list-item]
    with pytest.raises(MismatchError, match="trainer rank 7"):
        union_plans([pa, failed], 4, 1024)


def test_ranked_sink_names_each_rank_and_routes_buckets() -> None:
    t0, t1 = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    sink = RankedSink([ModuleSink(t0), ModuleSink(t1)])
    exp = sink.expectations()
    assert exp is not None
    assert set(exp.tensors) == {"0/w", "1/w"}
    assert exp.required == frozenset({"0/w", "1/w"})
    data = torch.tensor([5.0, 6.0]).view(torch.uint8)
    sink.apply_bucket(data, [TensorSpec("1/w", "float32", (2,), 0, 8)])
    sink.commit(1)
    assert torch.equal(t1["w"], torch.tensor([5.0, 6.0]))
    assert not t0["w"].any()


class OnDevice:
    """A sink that only says it lives on ``device`` (no GPU needed to name one)."""

    staged = True

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def expectations(self) -> None:
        return None

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        raise AssertionError("nothing is applied in these tests")

    def commit(self, version: int) -> None:
        pass

    def abort(self) -> None:
        pass


class FakePart:
    """A part's plane that records nothing but its closing."""

    closed = False

    def view(self, index: int, used: int) -> torch.Tensor:
        return torch.zeros(used, dtype=torch.uint8)

    def close(self) -> None:
        self.closed = True


def test_each_part_opens_on_the_device_of_its_ranks_sink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = RankedSink([OnDevice("cuda:1"), OnDevice("cuda:0"), OnDevice("cpu")])
    assert sink.device == torch.device("cuda:1")
    parts = [ShmPlaneSpec([ShmHandle(name, 1024)]) for name in "abc"]
    opened: list[tuple[PlaneSpec, torch.device]] = []

    def recording(part: PlaneSpec, device: torch.device, limits: Limits | None) -> FakePart:
        opened.append((part, device))
        return FakePart()

    open_plane = aiosync.planes.open_receiver_plane  # the receiver's entry, as it calls it
    monkeypatch.setattr(aiosync.planes.gathered, "open_ring", recording)  # each part's
    plane = open_plane(GatheredPlaneSpec(parts), sink.device, None, sink.part_devices)
    devices = [torch.device(d) for d in ("cuda:1", "cuda:0", "cpu")]
    assert opened == list(zip(parts, devices, strict=True))
    plane.close()
    opened.clear()  # without the sink's devices (any other sink): every part on ``device``
    GatheredReceiverPlane(GatheredPlaneSpec(parts), torch.device("cpu"), open_part=recording)
    assert [device for _, device in opened] == [torch.device("cpu")] * 3
    with pytest.raises(ProtocolError, match="3 parts for an engine of 2"):
        part_devices(3, torch.device("cpu"), [torch.device("cpu")] * 2)


def test_the_receiver_hands_the_plane_opener_its_sinks_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiosync.channels.inproc import InprocListener

    calls: list[tuple[torch.device, Any]] = []

    def refusing(spec: PlaneSpec, device: torch.device, limits: Any, devices: Any, **_: Any) -> Any:
        calls.append((device, devices))
        raise OSError("not opened in this test")

    monkeypatch.setattr(aiosync.engine.receiver, "open_receiver_plane", refusing)
    spec = GatheredPlaneSpec([ShmPlaneSpec([ShmHandle("a", 1024)])] * 2)

    async def main() -> None:
        sink = RankedSink([OnDevice("cuda:0"), OnDevice("cuda:1")])
        async with WeightReceiver(sink, InprocListener("devices")) as receiver:
            await receiver._do(OpenPlane("peer", spec))

    anyio.run(main)
    assert calls == [(torch.device("cuda:0"), [torch.device("cuda:0"), torch.device("cuda:1")])]


# --- four trainer processes ---------------------------------------------------------------


@pytest.mark.parametrize("counts", [[2, 2], [1, 3]])
def test_layouts_through_the_pipeline_are_bit_exact(world: World, counts: list[int]) -> None:
    answers = world.run(op="pipeline", counts=counts, versions=[5, None])
    for answer in answers:
        assert [r.get("error") for r in answer["reports"]] == [None, None], answer
        assert [r["committed"] for r in answer["reports"]] == [[0, 1], [0, 1]]
    for engine, answer in sources(answers).items():
        assert answer["engine_version"] == 6  # given 5, then None: the engine's next
        assert answer["exact_last"], answer
        applied = answer["applied"]  # several buckets per rank and version, each rank's own
        assert len(applied) == counts[engine]
        assert len(set(applied)) == 1
        assert applied[0] >= 4


def test_a_manifest_mismatch_is_refused_before_any_byte(world: World) -> None:
    answers = world.run(op="pipeline", counts=[2, 2], versions=[3], extra=1)
    for answer in answers:
        assert "error" in answer["reports"][0], answer
    engine0 = sources(answers)[0]
    assert "extra.w" in answers[0]["reports"][0]["error"]
    assert engine0["applied"] == [0, 0]
    assert engine0["engine_version"] is None
    assert sources(answers)[1]["engine_version"] is None  # policy all: the fleet stays


@pytest.mark.parametrize("policy", ["all", "available"])
def test_one_engine_failing_under_each_policy(world: World, policy: str) -> None:
    fail = {"engine": 1, "pos": 1, "at": 0}
    answers = world.run(op="pipeline", counts=[2, 2], versions=[1, 2], fail=fail, policy=policy)
    by_engine = sources(answers)
    assert by_engine[1]["engine_version"] is None  # every bucket to its rank 1 fails
    for answer in answers:
        reports = answer["reports"]
        if policy == "all":
            assert all("error" in r for r in reports), answer
            assert "engines [1]" in reports[0]["error"]
        else:
            assert [r["committed"] for r in reports] == [[0], [0]], answer
            assert [r["failed"] for r in reports] == [[1], [1]]
        assert all(r["seconds"] < GROUP_TIMEOUT for r in reports)  # released, no hang
    assert by_engine[0]["engine_version"] == (None if policy == "all" else 2)
    assert by_engine[0]["exact_last"]
    assert by_engine[1]["exact_last"]  # its staged sinks kept "version 0"
    if policy == "all":
        assert "out of memory on purpose" in by_engine[1]["reports"][0]["error"]


def test_a_rank_that_cannot_plan_fails_the_version_everywhere_then_the_next_goes(
    world: World,
) -> None:
    answers = world.run(op="pipeline", counts=[1, 3], versions=[None, None], unplannable=3)
    for answer in answers:
        first, second = answer["reports"]
        assert "engines [1] failed the version" in first.get("error", ""), answer
        if answer["rank"] == 1:  # engine 1's source has the rank's own text
            assert "trainer rank 3 cannot plan its tensors" in first["error"]
        assert second.get("error") is None
        assert second["committed"] == [0, 1]
    for answer in sources(answers).values():
        assert answer["engine_version"] == 0  # none held: None starts the engine at 0
        assert answer["exact_last"]


def test_a_silent_engine_is_given_up_within_the_link_deadline(world: World) -> None:
    fail = {"engine": 0, "pos": 1, "at": 0, "hang": True}
    answers = world.run(
        op="pipeline", counts=[2, 2], versions=[4], fail=fail, policy="available", link_timeout=2
    )
    for answer in answers:
        (report,) = answer["reports"]
        assert report.get("committed") == [1], answer
        assert report["failed"] == [0]
        assert report["seconds"] < GROUP_TIMEOUT / 2  # released by the link's deadline
    by_engine = sources(answers)
    assert by_engine[1]["engine_version"] == 4
    assert by_engine[0]["engine_version"] is None
