"""Direct mode under ``expandable_segments:True``: descriptor regions on CUDA (needs a GPU).

torch then maps tensors into physical allocations (``cuMemCreate``) that have no legacy IPC
handle; the trainer passes their file descriptors over its UNIX socket and the engine maps
them (:mod:`aiosync.planes.fd_regions`). Trainer and engine are processes
(``tests/direct_peers.py``, or a trainer script here). Every test prints what it saw (the
region kinds, their physical allocations, the lookups, whether the mapping is read-only),
so a failure on the GPU host says where it went wrong. The CPU half (the socket, the
bookkeeping, the bounds) is ``tests/api/test_fd_passing.py`` and ``tests/unit/test_fd_regions.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack

import pytest

from tests.conftest import requires_cuda
from tests.helpers.peer_processes import ROOT, events, first, process

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.timeout(400)]
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
TEMPORARIES = 1024 * 512 * 4 + 333 * 77 * 2  # the cast and the fresh tensor, packed
Event = dict[str, object]


def fleet(
    versions: int, *, engines: int = 1, trainer_args: tuple[str, ...] = ()
) -> tuple[list[Event], list[dict[object, object]]]:
    """``engines`` engine processes and a trainer under expandable segments: the trainer's
    ``sent`` events (printed) and each engine's digests by committed version."""
    with ExitStack() as stack:
        procs = [
            stack.enter_context(process("tests.helpers.direct_peers", "engine"))
            for _ in range(engines)
        ]
        points = [a for p in procs for a in ("--endpoint", str(first(p, "ready")["endpoint"]))]
        argv = ["trainer", *points, "--versions", str(versions), *trainer_args]
        with process("tests.helpers.direct_peers", *argv, env=EXPANDABLE) as trainer:
            out = list(events(trainer))
            assert trainer.wait(timeout=300) == 0, out
        got: list[dict[object, object]] = []
        for proc in procs:
            got.append({})
            for event in events(proc):
                got[-1][event["version"]] = event["digests"]
                if event["version"] == versions - 1:
                    break
    for event in out:
        shown = {k: event.get(k) for k in ("version", "kinds", "pieces", "fresh", "checked")}
        print(event["event"], shown, event.get("note") or event.get("error"))
    assert not [e for e in out if e["event"] == "failed"], out
    return [e for e in out if e["event"] == "sent"], got


def test_expandable_segments_read_in_place_through_descriptors_bit_exact() -> None:
    """Every parameter goes direct (as descriptor regions), the temporaries are packed, and
    ten versions are bit-exact while the trainer steps right after each send; the split is
    kept, and once the allocator is steady it vouches for every region (no lookups)."""
    sent, got = fleet(10)
    assert [e["version"] for e in sent] == list(range(10))
    for event in sent:
        assert event["direct"] == event["params"], event
        assert event["packed"] == TEMPORARIES, event
        assert "legacy" not in str(event["note"]), event  # nothing packed for its memory
        assert event["kinds"] == ["CudaFdRegion"], event
        assert int(str(event["pieces"])) >= 2, event  # the big one's page(s), small ones
        assert got[0][event["version"]] == event["digests"], event["version"]
    assert [e["fresh"] for e in sent] == [True] + [False] * 9
    assert min(int(str(e["checked"])) for e in sent[1:]) == 0, [e["checked"] for e in sent]


def test_memory_moved_and_released_between_versions_stays_bit_exact() -> None:
    """``--churn``: new storages before version 3; before version 5 one freed,
    ``empty_cache`` unmapping its pages and a storage of the same size mapped again (often
    at the same address, in new physical allocations): the split is made afresh exactly
    then, and every version is read direct and bit-exact."""
    sent, got = fleet(9, trainer_args=("--churn",))
    assert [e["version"] for e in sent] == list(range(9))
    for event in sent:
        assert event["direct"] == event["params"], event
        assert got[0][event["version"]] == event["digests"], event["version"]
    assert [e["version"] for e in sent if e["fresh"]] == [0, 3, 5]
    print("version 5 at the same address as before:", sent[5]["same_address"])


def test_two_engine_processes_map_the_same_descriptors_bit_exact() -> None:
    sent, got = fleet(4, engines=2)
    assert [e["version"] for e in sent] == list(range(4))
    for event in sent:
        assert len(list(event["committed"])) == 2, event  # type: ignore[call-overload]
        assert event["direct"] == event["params"], event
        for engine in got:
            assert engine[event["version"]] == event["digests"]


TRAINER = """
import json, sys, torch
from aiosync.planes.direct_regions import RegionFinder
from aiosync.planes.fd_regions import FdRegions

device = torch.device("cuda", 0)
fd = FdRegions(0)
finder = RegionFinder(device, fd)
pad = torch.empty(3 << 20, dtype=torch.uint8, device=device)  # the tensor starts mid-page
gen = torch.Generator(device=device)
gen.manual_seed(7)
tensor = torch.randint(0, 256, (70 << 20,), dtype=torch.uint8, device=device, generator=gen)
mark = finder.marker()
spot = finder.locate(tensor)
if isinstance(spot, str):
    print(json.dumps({"refused": spot}), flush=True)
    sys.exit(0)
source = fd.source
print(json.dumps({
    "ident": spot.region.ident, "pieces": list(spot.region.pieces), "size": spot.region.size,
    "offset": spot.offset, "nbytes": tensor.nbytes, "sum": int(tensor.sum(dtype=torch.int64)),
    "head": tensor[:16].tolist(), "tail": tensor[-16:].tolist(),
    "owned": bool(finder.allocator_owned({spot.key})), "marker": mark is not None,
    "source": [source.path, source.pid, source.pid_namespace, source.token.hex()],
}), flush=True)
sys.stdin.readline()  # the engine has mapped, read and closed the region
still = finder.still(tensor, spot)
del tensor
torch.cuda.empty_cache()  # its pages are unmapped
print(json.dumps({"still": still, "marker_moved": finder.marker() != mark}), flush=True)
sys.stdin.readline()
fd.close()
"""


def test_a_tensor_over_several_physical_allocations_maps_whole_read_only_and_checked() -> None:
    """A 70 MiB tensor starting mid-page in the trainer: one region of several pieces; the
    engine (this process) maps it from the descriptors, reads it bit-exact across every
    page boundary, and refuses a region whose pieces are not the trainer's, a wrong token,
    another pid; the trainer's allocator vouches for the region until it unmaps pages."""
    import msgspec
    import torch

    from aiosync.core.errors import AiosyncError, ProtocolError
    from aiosync.core.plane_specs import CudaFdRegion, DescriptorSource
    from aiosync.planes.fd_regions import open_fd_region
    from aiosync.runtime import child_env

    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **EXPANDABLE},
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdin is not None
        found = json.loads(trainer.stdout.readline())
        print("trainer:", {k: v for k, v in found.items() if k not in ("head", "tail")})
        assert "refused" not in found, found
        pieces = tuple(found["pieces"])
        assert len(pieces) >= 4, pieces  # 70 MiB from mid-page over 20 MiB pages
        assert found["marker"], found
        assert found["owned"], found  # vouched for by the allocator
        path, pid, namespace, token = found["source"]
        source = DescriptorSource(path, pid, namespace, bytes.fromhex(token))
        region = CudaFdRegion(found["ident"], pieces, found["size"])
        memory = open_fd_region(region, 0, source)
        count, ro = len(memory.sizes), memory.read_only
        print(f"mapped {memory.size} bytes in {count} pieces; read-only: {ro}")
        view = memory.tensor[found["offset"] : found["offset"] + found["nbytes"]]
        assert int(view.sum(dtype=torch.int64)) == found["sum"]
        assert view[:16].tolist() == found["head"]
        assert view[-16:].tolist() == found["tail"]
        copied = view.clone()  # a device copy out of it, as an engine's apply makes
        torch.cuda.synchronize()
        assert int(copied.sum(dtype=torch.int64)) == found["sum"]
        memory.close()
        memory.close()  # idempotent
        bigger = CudaFdRegion(region.ident, (pieces[0] * 2, *pieces[1:]), region.size + pieces[0])
        with pytest.raises(ProtocolError, match="not the pieces"):
            open_fd_region(bigger, 0, source)
        with pytest.raises(AiosyncError, match="wrong token"):
            open_fd_region(region, 0, msgspec.structs.replace(source, token=b"x" * 32))
        with pytest.raises(AiosyncError, match="served by pid"):
            open_fd_region(region, 0, msgspec.structs.replace(source, pid=pid + 1))
        with pytest.raises(AiosyncError, match="no region"):
            open_fd_region(msgspec.structs.replace(region, ident=region.ident + 99), 0, source)
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        after = json.loads(trainer.stdout.readline())
        print("trainer after release:", after)
        assert after == {"still": True, "marker_moved": True}
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.wait(timeout=60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait(timeout=30)
