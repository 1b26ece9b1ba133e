"""How a weight server listens, retains and bounds its peers: :class:`ServerConfig`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from aiosync.channels.keys import ChannelAuth
from aiosync.core.limits import Limits
from aiosync.engine.config import ReceiverConfig
from aiosync.server.retention import RetentionPolicy
from aiosync.server.roles import RoleAuth, role_auth


@dataclass(frozen=True)
class ServerConfig:
    """How a server listens, retains, and bounds its peers.

    ``publish_endpoint`` (publishers' ``WeightSender`` connects here) and
    ``control_endpoint`` (subscribers and clients): default ``ipc://`` in private
    directories; ``tcp://`` needs ``auth`` (CURVE keys, or loopback without).
    ``publisher_keys`` and ``subscriber_keys`` (public keys, Z85) separate the roles: only a
    publisher's key passes the publish endpoint's handshake, and on the control endpoint
    it may only ask for status and wait; only a subscriber's key may subscribe, fetch,
    follow or pull. A role not given takes ``auth.allowed_clients``, and without either
    every key of ``auth.allowed_clients`` holds both roles (:mod:`aiosync.server.roles`).
    ``subscriber_auth`` is this server's keypair towards subscribers' ``tcp://`` receivers
    (each subscriber names its receiver's public key when it subscribes; an ``ipc://``
    receiver without one is reached without CURVE). ``receiver`` bounds
    what a publisher may send. ``timeout`` bounds every wait on a subscriber;
    ``window`` the buckets awaiting a subscriber's ack; ``max_subscribers`` the
    subscriptions at once; ``memory_timeout`` how long a publisher's bucket waits for room.
    ``metrics_port`` (None: off) serves ``/metrics`` and ``/healthz`` on ``metrics_host``,
    which must be loopback, answering at most ``metrics_concurrency`` requests at once (more
    get 503) and closing a connection whose request has not arrived within
    ``metrics_read_timeout`` seconds. ``upstream`` makes this server a relay: it pulls every new
    version from that server's control endpoint (``upstream_auth``: its CURVE client keys)
    and serves it here (:mod:`aiosync.server.relay`); with ``resume_dir`` it saves the
    buckets of a version it is pulling there, so that after a restart it fetches only the
    missing ones. ``upstream_limits`` bound what the upstream may send, as an engine's
    ``limits`` bound a sender (:mod:`aiosync.server.relay_checks`).
    """

    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    publish_endpoint: str | None = None
    control_endpoint: str | None = None
    auth: ChannelAuth | None = None
    subscriber_auth: ChannelAuth | None = None
    publisher_keys: Collection[bytes | str] | None = None
    subscriber_keys: Collection[bytes | str] | None = None
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    timeout: float = 60.0
    window: int = 16
    max_subscribers: int = 64
    max_wait: float = 3600.0
    memory_timeout: float = 60.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_concurrency: int = 8
    metrics_read_timeout: float = 5.0
    name: str = ""
    upstream: str | None = None
    upstream_auth: ChannelAuth | None = None
    resume_dir: str | None = None
    upstream_limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if min(self.timeout, self.max_wait, self.memory_timeout) <= 0:
            raise ValueError("server timeouts must be positive")
        if self.window < 1 or self.max_subscribers < 1:
            raise ValueError("window and max_subscribers must be at least 1")
        workers, seconds = self.metrics_concurrency, self.metrics_read_timeout
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"metrics_concurrency must be at least 1, got {workers!r}")
        if not seconds > 0:  # also NaN
            raise ValueError(f"metrics_read_timeout must be positive, got {seconds!r}")
        role_auth(self.auth, self.publisher_keys, self.subscriber_keys)  # ValueError if not

    @property
    def role_auth(self) -> RoleAuth:
        """The publish and control endpoints' keys, and which key holds which role."""
        return role_auth(self.auth, self.publisher_keys, self.subscriber_keys)
