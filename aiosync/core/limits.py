"""What an engine accepts from one peer: sizes, counts and version steps (plain data).

Every bound here protects a long-running engine from a peer's input: memory (message size,
tensors per message, mapped bytes), time (tensors checked per message), its own records
(failures kept, sessions open) and its version number (how far a version may jump). The
defaults let any real model through; an engine states its limits in its ``ready`` so that a
sender plans buckets and manifests to fit.
"""

from __future__ import annotations

import msgspec

GiB = 1 << 30


class Limits(msgspec.Struct, frozen=True):
    """An engine's bounds on what one peer may send; validated at construction."""

    max_message_bytes: int = 64 << 20
    """Largest frame accepted on the control channel."""
    max_bucket_tensors: int = 1 << 16
    """Tensors (or chunks) in one bucket."""
    max_manifest_tensors: int = 1 << 20
    """Entries in one manifest (a larger version streams without one)."""
    max_buffers: int = 64
    """Buffers one session's plane may name."""
    max_session_bytes: int = 256 * GiB
    """Bytes one session's plane may map."""
    max_sessions: int = 64
    """Sessions open at once."""
    max_sessions_per_key: int = 32
    """Sessions one CURVE key may hold at once (without CURVE: one per connection)."""
    max_name_length: int = 1024
    """Characters in a tensor name, a sender name or any peer-chosen string kept."""
    max_failures: int = 1000
    """Failed streams remembered (the oldest are forgotten)."""
    max_version_step: int = 1024
    """How far a version may jump past the current one (the first version may be any).

    Small, so that a peer allowed to send versions cannot wedge the numbering far ahead of
    the trainer's in one step (it can still move it ahead by this much per version).
    """
    allow_rebase: bool = False
    """Whether a sender may restart the numbering (``begin`` with ``rebase``)."""

    def __post_init__(self) -> None:
        numbers = {k: getattr(self, k) for k in self.__struct_fields__ if k != "allow_rebase"}
        for name, value in numbers.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut (for peer strings)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
