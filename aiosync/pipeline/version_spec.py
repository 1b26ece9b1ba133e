"""What one version is, as the stream sends it: made once per version, read by every stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio

from aiosync.core.layout import BucketPlan
from aiosync.core.manifest import TensorMeta
from aiosync.pipeline.ahead import PackedAhead
from aiosync.pipeline.report import ProgressCallback


@dataclass(frozen=True)
class VersionSpec:
    """One version's options for :class:`~aiosync.pipeline.stream.StreamRun` and its fanout.

    ``manifest``: the version's tensors (None: each bucket names its own); ``empty`` and
    ``rebase``: the begin's flags (no tensors; the version restarts the numbering);
    ``progress``: called with each acked bucket's running total; ``packed``: set once every
    byte of the version is in a buffer (the trainer may change its tensors again);
    ``check_snapshot``: raises if the tensors changed while they were read (run before any
    engine may commit); ``started``: the send's start on ``time.perf_counter`` (None: now);
    ``first``: bucket 1, packed while the version was read; ``begun``: the begin sent before
    the read (:mod:`~aiosync.pipeline.early_begin`, every link's stream open), and
    ``sent_first`` bucket 1's message if it went with it; ``on_sent``: called with each
    bucket's plan as its message goes to an engine (once per engine); ``stepwise``: no
    bucket goes before every engine accepted the ``begin`` (one that refuses it, say busy,
    is sent nothing), and no ``commit`` before its completion check was acked (a version
    abandoned before then is made live nowhere).
    """

    version: int
    manifest: list[TensorMeta] | None
    empty: bool = False
    rebase: bool = False
    progress: ProgressCallback | None = None
    packed: anyio.Event | None = None
    check_snapshot: Callable[[], None] | None = None
    started: float | None = None
    first: PackedAhead | None = None
    begun: bytes | None = None
    sent_first: bytes | None = None
    on_sent: Callable[[BucketPlan], None] | None = None
    stepwise: bool = False
