"""Direct mode on CUDA (issue 10, item 2): the engine process copies straight out of the
trainer process's parameters; needs a GPU, skips without.

Trainer and engine are processes (``tests/direct_peers.py``): CUDA cannot open a process's
own IPC handles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parent.parent
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@contextmanager
def process(*argv: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    from aiosync.runtime import child_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.direct_peers", *argv],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **(env or {})},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def events(proc: subprocess.Popen[str]) -> Iterator[dict[str, object]]:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


def run_pair(
    versions: int, trainer_env: dict[str, str] | None = None
) -> tuple[list[dict[str, object]], dict[object, object]]:
    """One engine and one trainer process: the trainer's ``sent`` events and the engine's
    digests by committed version."""
    with process("engine") as engine:
        ready = next(events(engine))
        assert ready["event"] == "ready"
        n = ["--versions", str(versions)]
        with process("trainer", "--endpoint", str(ready["endpoint"]), *n, env=trainer_env) as tr:
            sent = [e for e in events(tr) if e["event"] == "sent"]
            assert tr.wait(timeout=300) == 0
        got: dict[object, object] = {}
        for event in events(engine):
            got[event["version"]] = event["digests"]
            if event["version"] == versions - 1:
                break
    return sent, got


def test_ten_versions_direct_with_temporaries_packed_bit_exact() -> None:
    """bf16 and fp32 parameters go direct, a cast and a fresh tensor are packed, in one
    version; the trainer changes its parameters right after each send (snapshot rule)."""
    sent, got = run_pair(10)
    assert [e["version"] for e in sent] == list(range(10))
    for event in sent:
        assert event["direct"] == event["params"], event  # every parameter read in place
        assert event["packed"] == 1024 * 512 * 4 + 333 * 77 * 2  # the two temporaries
        assert event["note"] == ""
        assert got[event["version"]] == event["digests"]


def test_expandable_segments_in_the_trainer_fall_back_to_packing_and_say_so() -> None:
    sent, got = run_pair(3, trainer_env=EXPANDABLE)
    for event in sent:
        assert event["direct"] == 0, event
        assert "legacy CUDA IPC" in str(event["note"]), event
        assert got[event["version"]] == event["digests"]


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
