"""No internal class's constructor takes more than 8 parameters (issue 27's shape targets).

Public API classes are exempt: their keyword arguments are what users write, documented in
the README, and stay as they are (each one named here with why).
"""

from __future__ import annotations

from benchmarks.shape import shape

PUBLIC_API = {
    "aiosync.server.subscriber.Subscriber": "public: the server's subscriber, as users call it",
    "aiosync.engine.blocking.BackgroundReceiver": "public: the blocking receiver's options",
}


def test_no_internal_class_constructor_takes_over_8_parameters() -> None:
    wide = shape()["constructors_over_8"]
    internal = {name: count for name, count in wide.items() if name not in PUBLIC_API}
    assert internal == {}


def test_the_stream_and_the_engines_machine_are_within_the_bound() -> None:
    wide = shape()["constructors_over_8"]
    for name in (
        "aiosync.pipeline.stream.StreamRun",
        "aiosync.pipeline.fanout.BucketFanout",
        "aiosync.core.engine_session.EngineSession",
    ):
        assert name not in wide
