"""The code before a change and after it, run alternately in one run on one machine.

    python -m benchmarks.before_after --before REV --after REV [--rounds 3] [--cases cpu,cuda]

Each revision is checked out (``git worktree``) into a temporary directory (or a directory
is given). Every case is run from each tree in turn, ``--rounds`` times each, alternating
(before, after, before, ...), each run a fresh process with that tree first on
``PYTHONPATH``, so both see the same machine state. The CPU cases (``cpu``) are ``aiosync
bench``'s: 1 GiB to one engine, to four engines, and 100,000 tensors of 4 bytes. The GPU
cases (``cuda``): packed 2 x 1 GiB and direct mode for a Llama-3-8B-shaped bf16 model (the
direct-mode benchmark, from whichever folder a tree holds it in). Prints one JSON object:
every figure of every run, each case's medians, and the ratio after / before (lower is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Case = tuple[list[str], Callable[[dict[str, Any]], float]]


def cpu_cases() -> dict[str, Case]:
    """``aiosync bench``'s CPU cases and the figure each is judged by (seconds, us)."""
    bench = ["-m", "aiosync", "bench", "--device", "cpu", "--skip-baselines", "--json"]
    return {
        "one_engine_1GiB_s": (
            [*bench, "--size-mb", "1024", "--repeats", "3"],
            lambda out: float(out["one_engine"]["seconds"]),
        ),
        "four_engines_1GiB_s": (
            [*bench, "--size-mb", "1024", "--repeats", "3", "--engines", "4"],
            lambda out: float(out["many_engines"]["seconds"]),
        ),
        "per_tensor_100000_us": (
            [*bench, "--size-mb", "64", "--repeats", "9", "--per-tensor", "100000"],
            lambda out: float(out["per_tensor"]["us_per_tensor"]),
        ),
    }


def cuda_cases(tree: Path) -> dict[str, Case]:
    """Packed 2 x 1 GiB and direct, Llama-3-8B-shaped bf16, from ``tree``'s own script."""
    module = (
        "benchmarks.cuda_direct"
        if (tree / "benchmarks" / "cuda_direct.py").exists()
        else "aiosync.bench.cuda_direct"
    )
    run = ["-m", module, "--size-mb", "15316", "--buffer-mb", "1024", "--repeats", "7"]
    return {
        "cuda_packed_2x1GiB_s": (run, lambda out: float(out["packed_median_s"])),
        "cuda_direct_s": (run, lambda out: float(out["direct_median_s"])),
    }


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"no JSON line in the output:\n{text[-2000:]}")


def run_once(tree: Path, argv: list[str]) -> dict[str, Any]:
    """One fresh process of ``python argv`` with ``tree`` first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode:
        raise RuntimeError(f"{argv} in {tree} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return last_json(done.stdout)


def measure(trees: dict[str, Path], rounds: int, kinds: set[str]) -> dict[str, Any]:
    """Every case, alternating trees ``rounds`` times; runs shared by two cases run once."""
    out: dict[str, Any] = {"rounds": rounds, "runs": {}, "medians": {}, "after_over_before": {}}
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for label, tree in trees.items():
            cases = {
                **(cpu_cases() if "cpu" in kinds else {}),
                **(cuda_cases(tree) if "cuda" in kinds else {}),
            }
            results: dict[tuple[str, ...], dict[str, Any]] = {}
            for name, (argv, figure) in cases.items():
                key = tuple(argv)
                if key not in results:
                    results[key] = run_once(tree, argv)
                figures.setdefault(name, {}).setdefault(label, []).append(figure(results[key]))
    for name, by_label in figures.items():
        out["runs"][name] = by_label
        medians = {label: statistics.median(values) for label, values in by_label.items()}
        out["medians"][name] = medians
        out["after_over_before"][name] = medians["after"] / medians["before"]
    return out


def main() -> None:
    """Check out both revisions, measure, print the JSON, remove the worktrees."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a git revision, or a directory")
    parser.add_argument("--after", default="HEAD", help="a git revision, or a directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="cpu", help="cpu, cuda or cpu,cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aiosync-before-after-") as scratch:
        trees: dict[str, Path] = {}
        made: list[Path] = []
        try:
            for label in ("before", "after"):
                given = getattr(args, label)
                if Path(given).is_dir():
                    trees[label] = Path(given).resolve()
                    continue
                tree = Path(scratch) / label
                subprocess.run(
                    ["git", "worktree", "add", "--detach", str(tree), given],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                )
                made.append(tree)
                trees[label] = tree
            kinds = set(args.cases.split(","))
            if not kinds <= {"cpu", "cuda"}:
                parser.error(f"--cases: cpu and/or cuda, not {args.cases!r}")
            result = measure(trees, args.rounds, kinds)
            result["before"], result["after"] = args.before, args.after
            print(json.dumps(result), flush=True)
        finally:
            for tree in made:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False
                )


if __name__ == "__main__":
    main()
