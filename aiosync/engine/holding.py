"""What a receiver holds for its peers, as it counts it: :class:`Holding` (read-only).

Each bound on a peer (docs/security.md, "Fair shares") is a count the receiver keeps, so
that what a peer makes it hold can be read without measuring the process: bytes received
and not yet served, and the manifests it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiosync.core.engine_session import EngineSession
from aiosync.core.wire import ManifestMemo


@dataclass(frozen=True)
class Holding:
    """A receiver's holdings now.

    ``queued_bytes``: messages received and not yet served, over every peer (each at most
    twice ``max_message_bytes``; a listener that does not count them says 0);
    ``manifest_entries``: entries of the distinct manifests held, those of open streams,
    of the last whole stream and the one kept to recognise the next ``begin`` by its bytes;
    ``memo_bytes``: that one's encoded bytes.
    """

    sessions: int
    queued_bytes: int
    manifest_entries: int
    memo_bytes: int


def holding(machine: EngineSession, memo: ManifestMemo, queued_bytes: int) -> Holding:
    """What ``machine`` and ``memo`` hold, with ``queued_bytes`` from the listener."""
    memo_bytes, kept = memo.kept
    lists = {id(manifest): manifest for manifest in machine.manifests}
    if kept is not None:
        lists[id(kept)] = kept
    entries = sum(len(manifest) for manifest in lists.values())
    return Holding(len(machine.sessions), queued_bytes, entries, memo_bytes)
