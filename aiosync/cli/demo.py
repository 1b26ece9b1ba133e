"""``aiosync demo``: stream a synthetic model trainer -> engine and check every version."""

from __future__ import annotations

import argparse
import json
import sys

from aiosync.cli.spawn import run_stream


def demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every version arrived bit-exact on the engine."""
    show = not args.quiet
    if show:
        print(
            f"aiosync demo: {args.size_mb} MiB fp32 Llama-shaped model, {args.versions} versions, "
            f"device {args.device}",
            file=sys.stderr,
        )
    result = run_stream(args, verify=True, show=show)
    versions = [
        each[0]["version"] for each in result["committed"] if all(c["verified"] for c in each)
    ]
    ok = (
        result["trainer_rc"] == 0
        and result["engine_rc"] == 0
        and versions == list(range(args.versions))
    )
    summary = {
        "ok": ok,
        "versions_verified": versions,
        "bytes_per_version": result["synced"][0]["bytes"] if result["synced"] else 0,
        "seconds": [s["seconds"] for s in result["synced"]],
    }
    if args.json:
        print(json.dumps(summary))
    elif show:
        verdict = "bit-exact" if ok else "FAILED"
        print(f"{len(versions)}/{args.versions} versions {verdict} on the engine", file=sys.stderr)
        print(
            "(times include the engine checking the previous version; `aiosync bench` "
            "measures throughput)",
            file=sys.stderr,
        )
    return 0 if ok else 1
