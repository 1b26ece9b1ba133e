"""End to end with a real Hugging Face causal LM: no request ever sees a mixed model.

A trainer process takes SGD steps on a tiny model (random init, nothing downloaded), saves
each version's weights and streams it; an engine process serves greedy generation through
read leases from its asyncio loop, with several requests in flight throughout. Every
request's output is then recomputed here from the saved weights of the version it
reported, with the same settings, and must be equal (see tests/helpers/hf_peers.py). Two cases: a
Llama made live by copy swap, and a GPT-2 (``lm_head.weight`` tied to the embedding) made
live by pointer swap.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from aiosync.channels.zmq import private_ipc_endpoint
from aiosync.runtime import child_env, stop_process
from tests.helpers.hf_peers import build_model, deterministic, generate

ROOT = Path(__file__).resolve().parents[2]
PER_VERSION = 2  # requests reporting a version before the trainer takes its next step
HANG = 90.0  # seconds: a hang guard per event only; events normally come within a second

Events = queue.Queue[tuple[str, dict[str, Any] | None]]


@contextmanager
def peer(role: str, events: Events, *argv: str) -> Iterator[subprocess.Popen[str]]:
    """A peer process whose JSON lines land in ``events`` as ``(role, event)``; None at EOF."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.hf_peers", role, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    assert proc.stdout is not None
    assert proc.stdin is not None

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.put((role, json.loads(line)))
        events.put((role, None))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield proc
    finally:
        if not proc.stdin.closed:
            proc.stdin.close()
        stop_process(proc, grace=10)
        reader.join(timeout=10)
        proc.stdout.close()


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    """The peers' settings for the recomputation, restored afterwards for other tests."""
    threads = torch.get_num_threads()
    strict = torch.are_deterministic_algorithms_enabled()
    deterministic()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(strict)


def next_event(events: Events, done: frozenset[str] = frozenset()) -> tuple[str, dict[str, Any]]:
    """The next event of a peer; the end of output is skipped for the roles in ``done``."""
    while True:
        role, event = events.get(timeout=HANG)
        if event is not None:
            return role, event
        assert role in done, f"the {role} exited early"


CASES = [  # model, swap, versions (at least 20)
    pytest.param("llama", "copy", 24, id="llama-copy"),
    pytest.param("gpt2", "pointer", 20, id="gpt2-tied-pointer"),
]


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize(("kind", "swap", "versions"), CASES)
def test_every_request_matches_the_saved_weights_of_its_version(
    tmp_path: Path, kind: str, swap: str, versions: int
) -> None:
    endpoint, directory = private_ipc_endpoint()
    events: Events = queue.Queue()
    requests: list[dict[str, Any]] = []
    served: Counter[int] = Counter()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        engine = stack.enter_context(
            peer("engine", events, "--endpoint", endpoint, "--model", kind, "--swap", swap)
        )
        role, event = next_event(events)
        assert (role, event["event"]) == ("engine", "ready")
        trainer = stack.enter_context(
            peer(
                "trainer",
                events,
                "--endpoint",
                endpoint,
                "--save-dir",
                str(tmp_path),
                "--versions",
                str(versions),
                "--model",
                kind,
            )
        )
        assert trainer.stdin is not None
        assert engine.stdin is not None
        waiting: int | None = None  # the version the trainer sent and waits on
        done = False
        while not done:
            role, event = next_event(events)
            if event["event"] == "request":
                requests.append(event)
                served[event["version"]] += 1
            elif event["event"] == "sent":
                waiting = event["version"]
            elif event["event"] == "done":
                done = True
            if waiting is not None and served[waiting] >= PER_VERSION:
                trainer.stdin.write("next\n")  # requests saw this version: take a step
                trainer.stdin.flush()
                waiting = None
        engine.stdin.close()  # stop the requests
        while True:
            role, event = next_event(events, done=frozenset({"trainer"}))
            if role == "engine" and event["event"] == "request":
                requests.append(event)
            elif role == "engine" and event["event"] == "finished":
                finished = event
                break
        assert trainer.wait(timeout=HANG) == 0
        assert engine.wait(timeout=HANG) == 0

    assert finished["version"] == versions - 1
    assert finished["failures"] == []
    assert finished["tied"] == (kind == "gpt2")  # GPT-2's head is still its embedding
    assert finished["storages"] == (2 if swap == "pointer" else 1)  # swapped, or copied
    reported = Counter(r["version"] for r in requests)
    assert len(requests) >= 40
    assert len(reported) >= 5, reported
    assert max(reported) == versions - 1

    # Recompute each request from the saved weights of its version; and, to show that a
    # wrong version would be caught, one request of each version from the next version's.
    model = build_model(kind)
    mismatched = []
    changed = checked = 0
    for version in sorted(reported):
        state = torch.load(tmp_path / f"v{version}.pt", weights_only=True)
        model.load_state_dict(state, strict=True)
        for r in requests:
            if r["version"] == version and generate(model, r["prompt"]) != r["output"]:
                mismatched.append(r)
        before = next((r for r in requests if r["version"] == version - 1), None)
        if before is not None:
            checked += 1
            changed += generate(model, before["prompt"]) != before["output"]
    assert not mismatched, f"{len(mismatched)} of {len(requests)}, first: {mismatched[0]}"
    assert checked >= 4
    assert changed >= checked // 2, (changed, checked)
