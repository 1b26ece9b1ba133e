"""``aiosync serve``: an async weight server with retention, subscribers and bounded lag.

:class:`WeightServer` (embeddable, ``async with``) takes versions from publishers through
the ordinary :class:`~aiosync.WeightSender` and streams them from shared memory to
:class:`Subscriber` engines. :class:`ServerClient` asks a server for status and waits.
"""

from aiosync.server.config import ServerConfig
from aiosync.server.fleet import FleetBook, SubscriberState
from aiosync.server.retention import RetentionBook, RetentionPolicy
from aiosync.server.server import WeightServer
from aiosync.server.subscriber import ServerClient, Subscriber

__all__ = [
    "FleetBook",
    "RetentionBook",
    "RetentionPolicy",
    "ServerClient",
    "ServerConfig",
    "Subscriber",
    "SubscriberState",
    "WeightServer",
]
