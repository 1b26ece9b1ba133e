"""Direct mode on CUDA (issue 10, item 2): the engine process copies straight out of the
trainer process's parameters; needs a GPU, skips without.

Trainer and engine are processes (``tests/helpers/direct_peers.py``): CUDA cannot open a process's
own IPC handles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import AbstractContextManager, ExitStack

import pytest

from tests.conftest import requires_cuda
from tests.helpers.peer_processes import ROOT, ask, events, first, process

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.timeout(400)]
Event = dict[str, object]


def peer(
    *argv: str, env: dict[str, str] | None = None, stdin: bool = False
) -> AbstractContextManager[subprocess.Popen[str]]:
    """A ``tests.helpers.direct_peers`` process."""
    return process("tests.helpers.direct_peers", *argv, env=env, stdin=stdin)


def endpoints(*engines: subprocess.Popen[str]) -> list[str]:
    """``--endpoint E`` for each engine, once it is ready."""
    return [a for e in engines for a in ("--endpoint", str(first(e, "ready")["endpoint"]))]


def run_fleet(
    versions: int,
    *,
    engines: int = 1,
    trainer_env: dict[str, str] | None = None,
    trainer_args: tuple[str, ...] = (),
    engine_args: tuple[str, ...] = (),
) -> tuple[list[Event], list[dict[object, object]]]:
    """``engines`` engine processes and one trainer: the trainer's events, and each
    engine's digests by committed version."""
    with ExitStack() as stack:
        procs = [stack.enter_context(peer("engine", *engine_args)) for _ in range(engines)]
        points = [
            a for proc in procs for a in ("--endpoint", str(first(proc, "ready")["endpoint"]))
        ]
        n = ["--versions", str(versions), *trainer_args]
        with peer("trainer", *points, *n, env=trainer_env) as tr:
            sent = list(events(tr))
            assert tr.wait(timeout=300) == 0
        got: list[dict[object, object]] = []
        for proc in procs:
            got.append({})
            for event in events(proc):
                got[-1][event["version"]] = event["digests"]
                if event["version"] == versions - 1:
                    break
    return sent, got


def run_pair(
    versions: int, trainer_env: dict[str, str] | None = None, *trainer_args: str
) -> tuple[list[Event], dict[object, object]]:
    """One engine and one trainer process: the trainer's ``sent`` events and the engine's
    digests by committed version."""
    sent, got = run_fleet(versions, trainer_env=trainer_env, trainer_args=trainer_args)
    return [e for e in sent if e["event"] == "sent"], got[0]


def test_ten_versions_direct_with_temporaries_packed_bit_exact() -> None:
    """bf16 and fp32 parameters go direct, a cast and a fresh tensor are packed, in one
    version; the trainer changes its parameters right after each send (snapshot rule)."""
    sent, got = run_pair(10)
    assert [e["version"] for e in sent] == list(range(10))
    for event in sent:
        assert event["direct"] == event["params"], event  # every parameter read in place
        assert event["packed"] == 1024 * 512 * 4 + 333 * 77 * 2  # the two temporaries
        assert str(event["note"]).startswith("2 tensors"), event  # the temporaries, and why
        assert "not persistent" in str(event["note"]), event
        assert got[event["version"]] == event["digests"]
    assert [e["fresh"] for e in sent] == [True] + [False] * 9  # the split kept throughout
    # once the trainer's allocator is steady, its counters vouch for every region
    assert min(int(str(e["checked"])) for e in sent[1:]) == 0, [e["checked"] for e in sent]


def test_an_engine_loop_on_a_stream_of_its_own_still_commits_whole_versions() -> None:
    """The engine serves inside ``torch.cuda.stream(s)``: the direct buckets it applies on
    its loop (quick applies) must still go on the stream its commit waits for, or a commit
    would be acked while copies still read the trainer, who steps right after each send."""
    sent, got = run_fleet(10, engine_args=("--loop-stream",))
    sent = [e for e in sent if e["event"] == "sent"]
    assert [e["version"] for e in sent] == list(range(10))
    for event in sent:
        assert got[0][event["version"]] == event["digests"]


def test_storage_replaced_and_empty_cache_between_versions_stay_bit_exact() -> None:
    """Before version 3 two parameters get new storages (``.data =``, ``set_``); before
    version 5 one is freed, ``empty_cache`` releases its segment and it gets a storage of
    the same size again (often at the same address, in a new allocation). Every version
    is read direct and bit-exact; the split is made afresh exactly then."""
    sent, got = run_pair(9, None, "--churn")
    assert [e["version"] for e in sent] == list(range(9))
    for event in sent:
        assert event["direct"] == event["params"], event
        assert "not persistent" in str(event["note"]), event  # only the temporaries packed
        assert got[event["version"]] == event["digests"], event["version"]
    assert [e["version"] for e in sent if e["fresh"]] == [0, 3, 5]
    assert min(int(str(e["checked"])) for e in sent[6:]) == 0, [e["checked"] for e in sent]
    print("version 5 at the same address as before:", sent[5]["same_address"])


def test_direct_mode_fanned_out_to_two_engine_processes_bit_exact_on_both() -> None:
    """One trainer, two engine processes on the same GPU, both reading its parameters in
    place: every version committed by both, bit-exact on both, the byte split reported."""
    out, got = run_fleet(4, engines=2)
    sent = [e for e in out if e["event"] == "sent"]
    assert [e["version"] for e in sent] == list(range(4))
    for event in sent:
        assert len(list(event["committed"])) == 2, event  # type: ignore[call-overload]
        assert event["direct"] == event["params"], event
        assert event["packed"] == 1024 * 512 * 4 + 333 * 77 * 2
        for engine in got:
            assert engine[event["version"]] == event["digests"]


def test_an_engine_killed_mid_version_the_sender_raises_naming_it() -> None:
    """Two engines under policy ``all``; one dies (``os._exit``) while applying version
    2's second direct region. The send raises within its timeout, naming that engine (the
    trainer's exit is the hang guard); the other engine, staged, still holds version 1."""
    with (
        peer("engine", "--die-in-version", "2") as dying,
        peer("engine", "--staged", "--answer", stdin=True) as staying,
    ):
        dead_at = str(first(dying, "ready")["endpoint"])
        argv = [*endpoints(staying), "--versions", "4", "--timeout", "10"]
        with peer("trainer", "--endpoint", dead_at, *argv) as trainer:
            code = trainer.wait(timeout=120)  # the send must raise first
            out = list(events(trainer))
        assert code == 0
        assert dying.wait(timeout=30) == 9
        sent = {e["version"]: e for e in out if e["event"] == "sent"}
        failed = [e for e in out if e["event"] == "failed"]
        assert sorted(sent) == [0, 1]
        assert len(failed) == 1
        assert failed[0]["version"] == 2
        assert dead_at in str(failed[0]["error"]), failed
        print("the send raised after", failed[0]["seconds"], "s:", failed[0]["error"])
        state = ask(staying, "state")
        assert state["version"] == 1
        assert state["digests"] == sent[1]["digests"]


def test_a_region_claiming_more_than_its_allocation_is_refused() -> None:
    """The engine checks a region's claimed size against what the driver mapped."""
    import torch

    from aiosync.core.errors import ProtocolError
    from aiosync.core.wire import CudaRegion
    from aiosync.planes.direct import open_region
    from aiosync.planes.direct_regions import address_range
    from aiosync.runtime import child_env

    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from aiosync.planes.cuda_runtime import DeviceMemory\n"
            "m = DeviceMemory.allocate(2 << 20, 0)\n"
            "print(m.handle.hex(), flush=True)\n"
            "sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    try:
        assert owner.stdout is not None
        assert owner.stdin is not None
        handle = bytes.fromhex(owner.stdout.readline().strip())
        opened = open_region(CudaRegion(handle, 2 << 20), 0, 1 << 30)
        found = address_range(opened.tensor.data_ptr())
        assert found is not None  # the check is live, not skipped
        assert found[1] >= 2 << 20
        opened.closer()
        with pytest.raises(ProtocolError, match="claims"):
            open_region(CudaRegion(handle, 64 << 20), 0, 1 << 30)
        torch.cuda.synchronize()
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.wait(timeout=60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(timeout=30)


MARKER_PROBE = """
import json, torch
from aiosync.planes.cuda_runtime import DeviceMemory
from aiosync.planes.direct_regions import RegionFinder

finder = RegionFinder(torch.device("cuda", 0))
tensor = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
own = DeviceMemory.allocate(2 << 20, 0)  # aiosync's own cudaMalloc: not the allocator's
ours, theirs = finder.locate(tensor), finder.locate(own.tensor)
out = {"owned": sorted(k == ours.key for k in finder.allocator_owned({ours.key, theirs.key}))}
before = finder.marker()
out["steady"] = before is not None and finder.marker() == before
del tensor
torch.cuda.empty_cache()  # the tensor's segment is released
out["released"] = finder.marker() != before
keep = torch.empty(1, device="cuda:0")  # a live segment while the counters are reset
torch.cuda.reset_accumulated_memory_stats(0)
out["reset"] = finder.marker()
own.close()
print(json.dumps(out))
"""


def test_the_allocator_vouches_for_its_own_segments_until_one_is_released() -> None:
    """In a fresh process: the caching allocator's segment is vouched for, aiosync's own
    ``cudaMalloc`` is not; a released segment changes the marker; a reset of the counters
    while a segment lives turns the marker off."""
    from aiosync.runtime import child_env

    probe = subprocess.run(
        [sys.executable, "-c", MARKER_PROBE],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found == {"owned": [True], "steady": True, "released": True, "reset": None}
