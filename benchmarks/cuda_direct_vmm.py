"""Direct mode with expandable segments (descriptor regions) beside it without, in turns.

Direct mode under ``expandable_segments:True`` against direct mode without it (legacy IPC
handles) and packed mode under each, alternately, in one run on one GPU. Run as
``python -m benchmarks.cuda_direct_vmm [--rounds 3] [--size-mb 15316]``.

The allocator setting is fixed when a process first touches CUDA, so each measurement is a
child ``python -m benchmarks.cuda_direct --modes packed,direct`` (trainer and its engine),
once with the default allocator and once with ``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``, taking turns ``--rounds`` times. Each child measures its own
copy floors, so every figure is also given over the floor of its own run. Prints one JSON
object a child as it ends, then a summary: per allocator, the medians (over rounds) of the
packed and direct medians and of their ratios to the floors, and direct with expandable
segments over direct without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

SETTINGS = {"legacy": "", "expandable": "expandable_segments:True"}
"""The allocator settings compared: the default, and expandable segments."""


def child(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``benchmarks.cuda_direct`` run under ``setting``: its JSON."""
    from aiosync.runtime import child_env

    env = child_env()
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if SETTINGS[setting]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[setting]
    command = [
        sys.executable,
        "-m",
        "benchmarks.cuda_direct",
        "--modes",
        args.modes,
        "--size-mb",
        str(args.size_mb),
        "--buffer-mb",
        str(args.buffer_mb),
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{setting} run failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["setting"] = setting
    return result


def summary(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Medians over rounds, per setting, and the comparison of the two direct modes."""
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        for mode in modes:
            floor = "two_copies" if mode == "packed" else "one_copy"
            out[f"{setting}_{mode}_ms"] = statistics.median(
                r[f"{mode}_median_s"] * 1e3 for r in mine
            )
            out[f"{setting}_{mode}_over_{floor}"] = statistics.median(
                r[f"{mode}_over_{floor}"] for r in mine
            )
            out[f"{setting}_{mode}_regions"] = mine[-1].get(f"{mode}_regions")
            out[f"{setting}_{mode}_note"] = mine[-1].get(f"{mode}_note")
        out[f"{setting}_bit_exact"] = all(r["bit_exact"] for r in mine)
    if "direct" in modes:
        out["expandable_direct_over_legacy_direct"] = (
            out["expandable_direct_ms"] / out["legacy_direct_ms"]
        )
    return out


def main() -> None:
    """Parse the command line, run both settings in turns, print each run and the summary."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=15316)
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="packed,direct")
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for setting in SETTINGS:
            runs.append(child(setting, args))
            print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"summary": summary(runs, args.modes.split(","))}), flush=True)


if __name__ == "__main__":
    main()
