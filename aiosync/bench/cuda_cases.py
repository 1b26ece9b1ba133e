"""The CUDA cases of ``aiosync bench --device cuda``.

The drop-in, the native API, a lock-step baseline and the floors
(:mod:`aiosync.bench.cuda_dropin`), with the default allocator and with
``expandable_segments:True``, each in a child process of its own (the allocator setting is
read when CUDA starts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from aiosync.runtime import child_env

ALLOCATORS = {"default": "", "expandable_segments": "expandable_segments:True"}
CASE_TIMEOUT = 600.0  # seconds for one allocator's run (two model copies, a few versions)


def measure(
    size_mb: int, buffer_mb: float, repeats: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """Each allocator setting's figures (or its ``error``), keyed by the setting's name."""
    out: dict[str, Any] = {}
    argv = [
        sys.executable,
        "-m",
        "aiosync.bench.cuda_dropin",
        "--size-mb",
        str(size_mb),
        "--buffer-mb",
        str(int(buffer_mb)),
        "--dropin-mb",
        str(int(2 * buffer_mb)),
        "--repeats",
        str(repeats),
    ]
    for name, setting in ALLOCATORS.items():
        env = {**child_env(), "PYTORCH_CUDA_ALLOC_CONF": setting}
        if not setting:
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
        try:
            done = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT, check=False
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode or not lines:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
            case = json.loads(lines[-1])
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            out[name] = {"error": str(exc)}
            say(f"CUDA cases ({name}) failed: {exc}")
            continue
        out[name] = case
        say(
            f"{name}: drop-in {case['dropin_median_s'] * 1e3:.1f} ms (first call "
            f"{case['dropin_first_s'] * 1e3:.0f} ms), native {case['native_median_s'] * 1e3:.1f}"
            f" ms, lock-step {case['lockstep_median_s'] * 1e3:.1f} ms; floors: one copy "
            f"{case['one_copy_s'] * 1e3:.1f} ms, two copies {case['two_copies_s'] * 1e3:.1f} ms;"
            f" drop-in/native {case['dropin_over_native']:.2f}, bit-exact {case['bit_exact']}"
        )
    return out
