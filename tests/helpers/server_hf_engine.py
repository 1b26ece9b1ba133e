"""An engine that subscribes to a weight server and serves a tiny Hugging Face causal LM.

Run as ``python -m tests.helpers.server_hf_engine --control ENDPOINT --name NAME``. It builds the
model of :mod:`tests.helpers.hf_peers` (random init, nothing downloaded), subscribes with a staged
:class:`~aiosync.ModuleSink`, and once a first version is live runs greedy-generation
requests back to back, each inside a read lease in a worker thread, printing ``request``
(prompt, output, version) for each until stdin closes; then ``finished``. With
``--wait-go`` it loads first and subscribes only after a line on stdin (a test starts it
early, since importing torch and transformers takes seconds, and says when to join).
"""

from __future__ import annotations

import argparse
import random
import sys

import anyio

from aiosync import ModuleSink
from aiosync.runtime import run
from aiosync.server import Subscriber
from tests.helpers.hf_peers import VOCAB, build_model, deterministic, emit, generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--wait-go", action="store_true", help="subscribe only after a line on stdin"
    )
    args = parser.parse_args()
    deterministic()
    model = build_model("llama")

    async def serve() -> None:
        if args.wait_go:  # started early (imports are slow), joins when told
            emit("loaded", name=args.name)
            await anyio.to_thread.run_sync(sys.stdin.readline)
        sub = Subscriber(args.control, ModuleSink(model, staged=True), name=args.name)
        async with sub:
            emit("ready", name=args.name, version=sub.current_version)
            stop = anyio.Event()

            async def watch_stdin() -> None:
                await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes it
                stop.set()

            async def requests() -> None:
                rng = random.Random(args.seed)
                while not stop.is_set():
                    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]
                    async with sub.serving() as version:
                        if version is None:  # not ready: no version has committed yet
                            await anyio.sleep(0.01)
                            continue
                        output = await anyio.to_thread.run_sync(generate, model, prompt)
                    emit("request", name=args.name, prompt=prompt, output=output, version=version)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_stdin)
                tg.start_soon(requests)
            emit("finished", name=args.name, version=sub.current_version)

    run(serve)


if __name__ == "__main__":
    main()
