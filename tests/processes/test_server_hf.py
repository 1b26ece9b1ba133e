"""End to end through the server with a real Hugging Face causal LM (issue 12, item 9).

A trainer process (tests/helpers/hf_peers.py) steps a tiny random-init Llama, saves each version's
weights and publishes it to an embedded :class:`WeightServer`; engine processes
(tests/helpers/server_hf_engine.py) generate greedily with the weights they receive: one from the
start (killed outright mid-run and restarted: a new process subscribes after the kill),
one joining late. The joining processes start early and subscribe when told, since
importing torch and transformers takes seconds. Every output is then
recomputed here from the saved weights of the version it reported, with the same
settings, and must be equal.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiosync.runtime import child_env, stop_process
from aiosync.server import ServerConfig, WeightServer
from tests.helpers.hf_peers import build_model, deterministic, generate

ROOT = Path(__file__).resolve().parents[2]
HANG = 90.0
VERSIONS = 5
LATE_AT, RESTART_AT = 1, 3

Events = queue.Queue[tuple[str, dict[str, Any] | None]]


class Peer:
    """A process whose JSON lines land in a shared queue as ``(name, event)``."""

    def __init__(self, name: str, events: Events, *argv: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events: Events) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            events.put((self.name, json.loads(line)))
        events.put((self.name, None))

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        if not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        stop_process(self.proc, grace=10)
        self._reader.join(timeout=10)
        self.proc.stdout.close()


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    threads = torch.get_num_threads()
    strict = torch.are_deterministic_algorithms_enabled()
    deterministic()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(strict)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("deterministic_torch")
def test_late_and_restarted_engines_match_the_saved_weights(tmp_path: Path) -> None:
    anyio.run(run_fleet, tmp_path)  # once, on asyncio: the processes are the slow part


async def run_fleet(tmp_path: Path) -> None:
    events: Events = queue.Queue()
    requests: list[dict[str, Any]] = []
    finished: dict[str, dict[str, Any]] = {}

    async def next_event(dead: set[str]) -> tuple[str, dict[str, Any]]:
        while True:
            name, event = await anyio.to_thread.run_sync(events.get, True, HANG)
            if event is not None:
                return name, event
            assert name in dead, f"{name} exited early"

    async with WeightServer(ServerConfig(timeout=HANG)) as server:
        with ExitStack() as stack:

            def engine(name: str, *extra: str) -> Peer:
                argv = ("tests.helpers.server_hf_engine", "--control", server.control_endpoint)
                peer = Peer(name, events, *argv, "--name", name, "--seed", str(len(name)), *extra)
                stack.callback(peer.close)
                return peer

            engines = {"a": engine("a")}
            # started now (imports take seconds), subscribing only when told
            waiting_to_join = {"late": engine("late", "--wait-go"), "a2": engine("a2", "--wait-go")}
            dead: set[str] = {"trainer"}  # the trainer exits on its own once done
            trainer = Peer(
                "trainer",
                events,
                "tests.helpers.hf_peers",
                "trainer",
                "--endpoint",
                server.publish_endpoint,
                "--save-dir",
                str(tmp_path),
                "--versions",
                str(VERSIONS),
            )
            stack.callback(trainer.close)
            waiting: int | None = None
            seen: dict[str, int] = {}  # the newest version each live engine served
            done = False
            while not done or any(n not in finished for n in engines if n not in dead):
                name, event = await next_event(dead)
                kind = event["event"]
                if kind == "loaded":
                    continue
                if kind == "request":
                    requests.append(event)
                    seen[name] = max(seen.get(name, -1), event["version"])
                elif kind == "sent":
                    waiting = event["version"]
                elif kind == "done":
                    done = True
                elif kind == "finished":
                    finished[name] = event
                live = [n for n in engines if n not in dead]
                if done and all(seen.get(n, -1) >= VERSIONS - 1 for n in live):
                    for n in live:  # every engine served the last version: stop them
                        if n not in finished and not engines[n].proc.stdin.closed:  # type: ignore[union-attr]
                            engines[n].proc.stdin.close()  # type: ignore[union-attr]
                if waiting is not None and all(seen.get(n, -1) >= waiting for n in live):
                    if waiting == LATE_AT and "late" not in engines:
                        engines["late"] = waiting_to_join.pop("late")
                        engines["late"].say("go\n")  # joins late: served at once
                        continue
                    if waiting == RESTART_AT and "a2" not in engines:
                        engines["a"].proc.send_signal(signal.SIGKILL)  # killed mid-run
                        dead.add("a")
                        engines["a2"] = waiting_to_join.pop("a2")
                        engines["a2"].say("go\n")  # ... and restarted (a new process)
                        continue
                    if waiting + 1 < VERSIONS:
                        trainer.say("\n")
                    waiting = None
    by_engine = {n: {r["version"] for r in requests if r["name"] == n} for n in engines}
    assert by_engine["late"]
    assert min(by_engine["late"]) >= LATE_AT
    assert by_engine["a2"]
    assert min(by_engine["a2"]) >= RESTART_AT
    assert max(by_engine["a"]) >= RESTART_AT - 1
    assert {finished[n]["version"] for n in ("late", "a2")} == {VERSIONS - 1}
    model = build_model("llama")
    for version in sorted({r["version"] for r in requests}):
        state = torch.load(tmp_path / f"v{version}.pt", weights_only=True)
        model.load_state_dict(state)
        for request in (r for r in requests if r["version"] == version):
            assert generate(model, request["prompt"]) == request["output"], request
