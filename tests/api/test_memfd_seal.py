"""Direct mode's shared tensors cannot be written by another process (issue 26, item 6).

:func:`aiosync.share_tensors` seals its memfd with ``F_SEAL_FUTURE_WRITE`` once the
trainer has mapped it. Another process of the same user that opens the memfd through
``/proc/<pid>/fd/<n>`` may open it read-write, but a writable shared ``mmap`` and
``write(2)`` are refused; the trainer's own mapping (the tensors) still writes, and an
engine's read-only mapping still reads what it wrote. A kernel that refuses the seal is
warned about.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender, share_tensors
from aiosync.planes import memfd
from aiosync.planes.memfd import memfd_available
from aiosync.planes.shm import ShmSegment

F_SEAL_FUTURE_WRITE = 0x0010


def future_write_sealable() -> bool:
    """Whether this kernel knows ``F_SEAL_FUTURE_WRITE`` (Linux >= 5.1)."""
    if not memfd_available():
        return False
    probe = os.memfd_create("aiosync-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(probe, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    except OSError:
        return False
    finally:
        os.close(probe)
    return True


pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not future_write_sealable(), reason="no F_SEAL_FUTURE_WRITE here"),
]

# Another process of this user: reach the trainer's memfd through /proc and try to change
# its first float to -666.0, by a writable shared mapping and by write(2).
INTRUDER = r"""
import json, mmap, os, struct, sys
path, size = sys.argv[1], int(sys.argv[2])
out = {}
fd = os.open(path, os.O_RDWR)
out["opened"] = True
try:
    view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view[:4] = struct.pack("<f", -666.0)
    view.close()
    out["mmap"] = "wrote"
except OSError as exc:
    out["mmap"] = exc.errno
try:
    out["write"] = "wrote %d" % os.pwrite(fd, struct.pack("<f", -666.0), 0)
except OSError as exc:
    out["write"] = exc.errno
print(json.dumps(out))
"""


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)


def memfd_path(handle_name: str) -> str:
    """``/proc/<pid>/fd/<n>`` of a memfd handle (``aiosync-memfd-<ns>-<pid>-<fd>-<token>``)."""
    _, _, pid, fd, _ = handle_name.removeprefix("aiosync-").split("-")
    return f"/proc/{pid}/fd/{fd}"


def intrude(path: str, size: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", INTRUDER, path, str(size)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_another_process_cannot_write_the_shared_tensors() -> None:
    model = Net()
    with torch.no_grad():
        model.proj.weight.fill_(1.5)
    with share_tensors(model) as shared:
        found = intrude(memfd_path(shared.handle.name), shared.size)
        assert torch.all(model.proj.weight == 1.5)  # never -666.0
        assert found["opened"] is True  # the mode lets this user open it read-write...
        assert found["mmap"] == errno.EPERM  # ...but a writable shared mapping is refused
        assert found["write"] == errno.EPERM  # and so is write(2)

        with torch.no_grad():  # the trainer's own mapping still writes
            model.proj.weight.fill_(2.5)
        engine = ShmSegment.attach(shared.handle, max_size=shared.size, writable=False)
        try:
            first = engine.tensor[: model.proj.weight.nbytes].view(torch.float32)
            assert torch.all(first == 2.5)  # the engine's read-only mapping reads it
        finally:
            engine.close()


def test_an_engine_in_direct_mode_still_reads_the_sealed_tensors() -> None:
    torch.manual_seed(0)
    model = Net()
    shared = share_tensors(model)

    async def main() -> None:
        there = Net()
        async with WeightReceiver(ModuleSink(there)) as receiver:
            config = SenderConfig(direct=True, buffer_bytes=4096)
            async with WeightSender(receiver.endpoint, config=config) as sender:
                for version in range(2):
                    with torch.no_grad():
                        model.proj.weight.add_(1.0)  # training writes through its views
                    report = await sender.send(model, version=version)
                    assert report.direct_bytes > 0
                    assert torch.equal(there.proj.weight, model.proj.weight)
                    assert torch.equal(there.proj.bias, model.proj.bias)

    try:
        anyio.run(main)
    finally:
        shared.close()


def test_a_kernel_that_refuses_the_seal_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(memfd, "_seal_future_writes", lambda fd: False)
    memfd._warn_unsealed.cache_clear()
    caplog.set_level(logging.WARNING, logger="aiosync.planes.memfd")
    try:
        with share_tensors(Net()):
            pass
    finally:
        memfd._warn_unsealed.cache_clear()
    assert "refuses F_SEAL_FUTURE_WRITE" in caplog.text
    assert "/proc/<pid>/fd" in caplog.text
