"""The fixed cost of a version: what a send costs before and after its bytes, bytes aside.

``python -m benchmarks.version_latency`` starts one engine process (a
:class:`~aiosync.WeightReceiver` over an in-place :class:`~aiosync.ModuleSink`, shared
memory plane) and streams versions to it from this process: Llama-3-8B's 291 tensor names
and shapes with every dimension divided by ``--scale`` (so bytes cost nothing), and, for
comparison, a version of one tiny tensor. Both processes stamp protocol events on one clock
(``time.perf_counter``, CLOCK_MONOTONIC on Linux): the trainer when each stream message is
handed to its channel and when each ack is matched, the engine when a message reaches its
serving loop and when each ack is handed to its channel. Per version it reports medians of:

- ``begin_sent``: the send's call to the trainer's channel taking the begin (reading the
  tensors, the manifest, encoding);
- ``at_engine``: the call to the begin reaching the engine's serving loop;
- ``accepted``: from there to the engine handing over its ack of the begin (its checks);
- ``first_acked``: the call to the trainer matching the ack of bucket 1;
- ``stream``: bucket 1's ack to the last bucket's ack;
- ``end``: the last bucket's ack to the send's return (completion check, commit, round
  trips), with ``end_engine``: the engine's share of it (from the completion message
  reaching its loop to its last ack handed over);
- ``total``: the call to the return.

With ``--engines N`` (policy ``all``), a version goes to N engine processes; acks count
once every engine's is in, and the engine side's marks are the first engine's.

Nothing is asserted: this is a measurement, printed as a table and as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from aiosync.core.layout import calculate_aligned_size

Mark = tuple[str, int, int, float]  # kind, version, seq, time
HIDDEN, KV, INTER, VOCAB, LAYERS = 4096, 1024, 14336, 128256, 32  # Llama-3-8B


def llama3_8b_shapes(scale: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B's 291 tensor names with every dimension divided by ``scale`` (at least 1)."""

    def dims(*sizes: int) -> tuple[int, ...]:
        return tuple(max(1, size // scale) for size in sizes)

    shapes = [("model.embed_tokens.weight", dims(VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "self_attn.q_proj.weight", dims(HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", dims(KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", dims(KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", dims(HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", dims(INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", dims(INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", dims(HIDDEN, INTER)),
            (p + "input_layernorm.weight", dims(HIDDEN)),
            (p + "post_attention_layernorm.weight", dims(HIDDEN)),
        ]
    shapes += [("model.norm.weight", dims(HIDDEN)), ("lm_head.weight", dims(VOCAB, HIDDEN))]
    return shapes


def build(case: str, scale: int) -> dict[str, torch.Tensor]:
    """The tensors of ``case`` (``"llama"``: 291 of them; ``"one"``: a single tiny tensor)."""
    if case == "one":
        return {"weight": torch.zeros(16, dtype=torch.bfloat16)}
    return {
        name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in llama3_8b_shapes(scale)
    }


def buffer_bytes_for(model: dict[str, torch.Tensor], buckets: int) -> int:
    """A buffer size that splits ``model`` into about ``buckets`` buckets."""
    sizes = [calculate_aligned_size(t.numel() * t.element_size()) for t in model.values()]
    return calculate_aligned_size(max(max(sizes), -(-sum(sizes) // buckets)))


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def trainer_marks(marks: list[Mark]) -> None:
    """Stamp each stream message the trainer hands over (``sent``) and each ack it matches."""
    from aiosync.core.trainer_session import LinkSession

    def sent(orig: Any) -> Any:
        def wrapped(self: Any, seq: int) -> None:
            marks.append(
                ("sent", self.version if self.version is not None else -1, seq, time.perf_counter())
            )
            orig(self, seq)

        return wrapped

    def ack(orig: Any) -> Any:
        def wrapped(self: Any, message: Any) -> Any:
            matched = orig(self, message)
            if matched is not None:
                marks.append(("acked", matched.version, matched.seq, time.perf_counter()))
            return matched

        return wrapped

    _wrap(LinkSession, "sent", sent)
    _wrap(LinkSession, "ack", ack)


def engine_marks(marks: list[Mark]) -> None:
    """Stamp each message reaching the engine's serving loop and each ack it hands over."""
    from aiosync.core.wire import Ack, decode
    from aiosync.engine.receiver import WeightReceiver

    def decide(orig: Any) -> Any:
        async def wrapped(self: Any, peer: Any, payload: bytes) -> Any:
            at = time.perf_counter()
            try:
                message = decode(payload)  # again, for the mark only (kept off the clock)
                kind = type(message).__name__.lower()
                seq = getattr(message, "seq", 0)
                marks.append((kind, getattr(message, "version", -1) or -1, seq, at))
            except Exception:
                pass
            return await orig(self, peer, payload)

        return wrapped

    def reply(orig: Any) -> Any:
        async def wrapped(self: Any, peer: Any, message: Any) -> None:
            if isinstance(message, Ack) and message.version is not None:
                marks.append(("reply", message.version, message.seq, time.perf_counter()))
            await orig(self, peer, message)

        return wrapped

    _wrap(WeightReceiver, "_decide", decide)
    _wrap(WeightReceiver, "_reply", reply)


def engine(args: argparse.Namespace) -> None:
    """Serve both cases; print the endpoints; on a line ``dump``, print the marks and exit."""
    import anyio

    from aiosync import ModuleSink, WeightReceiver
    from aiosync.runtime import run

    marks: list[Mark] = []
    engine_marks(marks)

    async def serve() -> None:
        async with (
            WeightReceiver(ModuleSink(build("llama", args.scale))) as llama,
            WeightReceiver(ModuleSink(build("one", args.scale))) as one,
        ):
            print(json.dumps({"llama": llama.endpoint, "one": one.endpoint}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            print(json.dumps({"marks": marks}), flush=True)

    run(serve)


def _at(marks: list[Mark], kind: str, version: int, seq: int) -> float:
    """When the first ``kind`` mark of ``seq`` was made; for acks, the last (every engine's)."""
    found = [t for k, v, s, t in marks if (k, v, s) == (kind, version, seq)]
    if not found:
        return float("nan")
    return found[-1] if kind == "acked" else found[0]


def phases(
    ours: list[Mark], theirs: list[Mark], version: int, call: float, done: float, buckets: int
) -> dict[str, float]:
    """One version's phases in milliseconds (see the module's docstring)."""
    begin = _at(ours, "sent", version, 0)
    first = _at(ours, "acked", version, 1)
    last = _at(ours, "acked", version, buckets)
    complete = _at(theirs, "complete", version, buckets + 1)
    engine_end = max(t for k, v, _, t in theirs if (k, v) == ("reply", version))
    arrived = _at(theirs, "begin", version, 0)
    return {
        "begin_sent": 1e3 * (begin - call),
        "at_engine": 1e3 * (arrived - call),
        "accepted": 1e3 * (_at(theirs, "reply", version, 0) - arrived),
        "first_acked": 1e3 * (first - call),
        "stream": 1e3 * (last - first),
        "end": 1e3 * (done - last),
        "end_engine": 1e3 * (engine_end - complete),
        "total": 1e3 * (done - call),
    }


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    """Run the engine process, stream every case, return the medians."""
    from aiosync import SenderConfig, WeightSender
    from aiosync.runtime import child_env, run, stop_process

    marks: list[Mark] = []
    trainer_marks(marks)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.version_latency",
                "--role",
                "engine",
                "--scale",
                str(args.scale),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(args.engines)
    ]
    proc = procs[0]  # its marks are the engine side's
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        each = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        endpoints = {case: [e[case] for e in each] for case in ("llama", "one")}
        runs: dict[str, list[tuple[int, float, float, int]]] = {}

        async def stream(case: str) -> None:
            model = build(case, args.scale)
            size = buffer_bytes_for(model, args.buckets)
            config = SenderConfig(buffer_bytes=size, num_buffers=args.buffers)
            async with WeightSender(endpoints[case], config=config) as sender:
                done: list[tuple[int, float, float, int]] = []
                for version in range(args.warmup + args.versions):
                    for tensor in model.values():
                        tensor.fill_(version % 7)
                    call = time.perf_counter()
                    report = await sender.send(model, version=version)
                    end = time.perf_counter()
                    if version >= args.warmup:
                        done.append((version, call, end, report.buckets))
                runs[case] = done

        async def main() -> None:
            for case in ("llama", "one"):
                await stream(case)

        run(main)
        for each_proc in procs:  # every engine prints its marks and exits
            assert each_proc.stdin is not None
            each_proc.stdin.write("dump\n")
            each_proc.stdin.flush()
        theirs = [tuple(m) for m in json.loads(proc.stdout.readline())["marks"]]
        for other in procs[1:]:
            other.stdout.readline()  # type: ignore[union-attr]  # read, so it can exit
    finally:
        for each_proc in procs:
            stop_process(each_proc, 5.0)
    result: dict[str, Any] = {}
    for case, done in runs.items():
        # the two cases share version numbers: split the marks by time
        lo, hi = done[0][1], done[-1][2]
        ours = [m for m in marks if lo <= m[3] <= hi]
        engine_side = [m for m in theirs if lo <= m[3] <= hi]  # type: ignore[operator]
        rows = [phases(ours, engine_side, v, c, e, b) for v, c, e, b in done]  # type: ignore[arg-type]
        result[case] = {
            "buckets": done[0][3],
            "versions": len(rows),
            "median_ms": {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]},
        }
    return result


def main() -> None:
    """Command line: ``--role engine`` is the child; otherwise run and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="trainer", choices=("trainer", "engine"))
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--scale", type=int, default=256)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--buffers", type=int, default=2)
    parser.add_argument("--engines", type=int, default=1, help="engine processes (policy all)")
    args = parser.parse_args()
    if args.role == "engine":
        engine(args)
        return
    result = trainer(args)
    for case, data in result.items():
        cells = "  ".join(f"{k} {v:.3f}" for k, v in data["median_ms"].items())
        print(f"{case:5} ({data['buckets']} buckets, {data['versions']} versions): {cells}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
