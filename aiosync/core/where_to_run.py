"""Whether a step runs on the event loop or in a worker thread, decided by how big it is.

A hop to a worker thread and back costs 0.15-0.6 ms on the GPU hosts when the thread was
idle (``anyio.to_thread`` after 2 ms idle: median 150-322 µs, 90th percentile 351-592 µs;
docs/benchmarks.md, docs/cuda.md), and the worker then competes with the loop for the
GIL. A step that costs less than that runs on the loop, if the size of its work is known
before it starts. Each bound below counts one kind of work, and says what it was measured
against. :func:`on_loop` is the only place that compares a size with them;
:func:`walks_tensors` sizes up an engine's message with it.

The bounds are read when :func:`on_loop` is called, so a test may patch them here.
"""

from __future__ import annotations

from aiosync.core.wire import Begin, Bucket, Complete, Message

LOOP_ENTRIES = 1024
"""Entries (tensors) of per-entry work that is already known to be cheap: what the last
version left behind still holds. A ``begin``'s manifest encoded (about 70 µs for 1024), an
unchanged manifest compared with the remembered one (24 µs for 291), a kept direct split
checked (about 0.3 ms for Llama-3-8B's 291 tensors), a staged commit's pointer swap (a few
µs a tensor: 1-4 ms at the bound, past a hop, kept since it saves the commit's round trip)."""

LOOP_CHECKED = 256
"""Tensors of checks from scratch, which a message whose shape is new needs: each name,
dtype, shape and offset checked against the limits and the sink's expectations. Several
times an entry's cost above, hence the lower bound."""

LOOP_LOOKUPS = 64
"""Lookups of memory regions the allocator does not vouch for: a driver query each on CUDA
(about 5 µs on an H200's host, 0.3 ms for 64)."""

LOOP_BYTES = 64 * 1024
"""Bytes of a message decoded on the loop (msgpack into the wire's structs, work that grows
with its size; a bound set with the first per-tensor checks, not measured against a hop)."""

LOOP_SECONDS = 0.5e-3
"""Host seconds the same step took last time (measured), about what a hop costs. It bounds
what the loop is expected to be held, not what it is: a step that turns slow is run on the
loop that once and goes back to the worker from the next time on."""


def on_loop(
    *,
    entries: int = 0,
    checked: int = 0,
    lookups: int = 0,
    nbytes: int = 0,
    measured_seconds: float = 0.0,
) -> bool:
    """True when a step of this size runs on the event loop; False: in a worker thread.

    Each argument is one measure of the step's work (its count of entries, of tensors to
    check from scratch, of region lookups, of bytes to decode, or the seconds it took last
    time); the step runs on the loop when every measure given is within its bound
    (:data:`LOOP_ENTRIES`, :data:`LOOP_CHECKED`, :data:`LOOP_LOOKUPS`, :data:`LOOP_BYTES`,
    :data:`LOOP_SECONDS`). A measure left out counts as none of that work.
    """
    return (
        entries <= LOOP_ENTRIES
        and checked <= LOOP_CHECKED
        and lookups <= LOOP_LOOKUPS
        and nbytes <= LOOP_BYTES
        and measured_seconds <= LOOP_SECONDS
    )


def walks_tensors(message: Message) -> bool:
    """True for an engine's message whose checks visit too many tensors for the loop.

    A ``begin`` by its manifest, a ``bucket`` by its slots and specs (:data:`LOOP_CHECKED`);
    a ``complete`` always (its coverage check walks the version, unless the session finds
    it light); anything else is bounded work.
    """
    if isinstance(message, Begin):
        return not on_loop(checked=len(message.manifest or ()))
    if isinstance(message, Bucket):
        return not on_loop(checked=len(message.slots) + len(message.specs))
    return isinstance(message, Complete)
