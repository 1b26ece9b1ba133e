"""Teacher logits shared with a student process through an aiosync teacher buffer.

The teacher allocates a ``[N_mb, B, T, V]`` buffer with ``ensure_teacher_ipc_buffer``,
writes deterministic "logits" into it, and starts a student (a fresh interpreter, not a
fork) with the buffer's handle as JSON on its command line. The student opens the buffer
from the handle, checks every value against its own recomputation, and writes its
log-softmax back into a second microbatch slot, which the teacher checks in turn. The
teacher then asks for a larger vocabulary, which grows the buffer (new handle; the old
``/dev/shm`` name is unlinked), repeats the round trip, and releases the buffer.

Runs on CPU in a few seconds; exits nonzero if any value mismatches::

    PYTHONPATH=. python examples/distillation_buffers.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from aiosync.compat.teacher import (
    ensure_teacher_ipc_buffer,
    open_teacher_ipc_buffer,
    release_teacher_ipc_buffer,
)

N_MB, B, T = 2, 3, 5


def teacher_logits(vocab: int) -> torch.Tensor:
    """What the teacher writes to microbatch 0 (the student recomputes it)."""
    gen = torch.Generator().manual_seed(vocab)
    return torch.randn(B, T, vocab, generator=gen)


def student(handle_json: str, vocab: int) -> int:
    """Open the teacher's buffer by handle, check microbatch 0, write microbatch 1."""
    buf = open_teacher_ipc_buffer(json.loads(handle_json))
    got = buf[0, :, :, :vocab]
    want = teacher_logits(vocab)
    if not torch.equal(got, want):
        print(f"student: mismatch, max diff {(got - want).abs().max().item()}", file=sys.stderr)
        return 1
    buf[1, :, :, :vocab] = torch.log_softmax(got, dim=-1)
    print(f"student: read {tuple(got.shape)} teacher logits from buffer {tuple(buf.shape)}")
    return 0


def round_trip(storage: torch.Tensor, handle: tuple[object, ...], vocab: int) -> bool:
    """Teacher side of one exchange; True when both directions carried the right values."""
    storage[0, :B, :T, :vocab] = teacher_logits(vocab)
    storage[1].zero_()
    proc = subprocess.run(
        [sys.executable, __file__, "--student", json.dumps(handle), str(vocab)], check=False
    )
    if proc.returncode != 0:
        print(f"teacher: student exited {proc.returncode}", file=sys.stderr)
        return False
    back = storage[1, :B, :T, :vocab]
    want = torch.log_softmax(teacher_logits(vocab), dim=-1)
    if not torch.equal(back, want):
        print("teacher: student's log-softmax does not match", file=sys.stderr)
        return False
    print(f"teacher: student's log-softmax for vocab {vocab} matches")
    return True


def main() -> int:
    """Teacher: allocate, share, grow, share again, release."""
    storage, handle = ensure_teacher_ipc_buffer(
        None, None, N_MB, B, T, 16, torch.float32, torch.device("cpu")
    )
    try:
        if not round_trip(storage, handle, 16):
            return 1
        same, same_handle = ensure_teacher_ipc_buffer(
            storage, handle, N_MB, B, T, 8, torch.float32, torch.device("cpu")
        )
        if same is not storage or same_handle != handle:  # a smaller request reuses it
            print("teacher: a smaller request reallocated the buffer", file=sys.stderr)
            return 1
        storage, handle = ensure_teacher_ipc_buffer(
            storage, handle, N_MB, B, T, 32, torch.float32, torch.device("cpu")
        )
        print(f"teacher: grew buffer to {tuple(storage.shape)}, new segment {handle[1]}")
        if not round_trip(storage, handle, 32):
            return 1
    finally:
        release_teacher_ipc_buffer(storage)
    print("ok")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--student":
        sys.exit(student(sys.argv[2], int(sys.argv[3])))
    sys.exit(main())
