"""What an engine answers to one weight-update call, as plain data."""

from __future__ import annotations

import msgspec


class WeightSyncResult(msgspec.Struct, frozen=True):
    """What an engine answered to one weight-update call: success and its own text."""

    success: bool
    """True when the engine applied the call."""
    message: str = ""
    """The engine's text: why it failed, or what it reported when it succeeded."""
