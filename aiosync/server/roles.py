"""Who may do what at a weight server, and how it reaches a subscriber's receiver (pure).

Two roles, by CURVE key. *Publishers* stream versions to the publish endpoint; only their
keys pass its handshake. *Subscribers* ask the control endpoint to feed their receivers
(``subscribe``, ``fetch``, ``follow``) or pull versions (a relay's ``pull`` and ``get``).
The control endpoint lets both kinds of key in, and a publisher's key there may only ask
for ``status`` and ``wait`` (back-pressure). :func:`role_auth` derives each endpoint's keys
and the :class:`Roles` from a :class:`~aiosync.server.config.ServerConfig`'s.

Without ``publisher_keys`` and ``subscriber_keys`` a server keeps one list, its ``auth``'s
``allowed_clients``, and every key in it holds both roles. With either given, the roles
are separate: a key may not be in both lists.

Whatever the keys, a subscription proves that the subscriber owns the receiver it names
(:mod:`aiosync.server.admission`); :func:`new_challenge` and :func:`proven` are that
proof's two pure steps.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from collections.abc import Collection
from dataclasses import dataclass

import aiosync.server.messages as m
from aiosync.channels.keys import ChannelAuth, z85_key
from aiosync.core.errors import AiosyncError

TOKEN_BYTES = 32
"""Random bytes in a subscription's challenge."""

_SUBSCRIBING = (m.Subscribe, m.Proof, m.Fetch, m.Follow, m.Pull, m.Get)

SHARED = (
    "give ServerConfig(publisher_keys=..., subscriber_keys=...) (aiosync serve "
    "--allow-publishers, --allow-subscribers) to separate the roles"
)
"""What a server whose keys hold both roles logs at start (:attr:`RoleAuth.shared`)."""


@dataclass(frozen=True)
class Roles:
    """Which client keys hold which role (None: every key the endpoint lets in)."""

    publishers: frozenset[bytes] | None = None
    subscribers: frozenset[bytes] | None = None

    def refusal(self, request: m.Request, key: bytes | None) -> str | None:
        """Why a control client with ``key`` may not make ``request`` (None: it may).

        ``key`` None: the control endpoint has no CURVE (``ipc://`` in a private
        directory, or plain loopback), so every client holds every role.
        """
        if not isinstance(request, _SUBSCRIBING) or key is None or self.subscribers is None:
            return None
        if key in self.subscribers:
            return None
        kind = "a publisher's key" if key in (self.publishers or ()) else "not a subscriber's key"
        return (
            f"{type(request).__name__.lower()} refused: this client's key "
            f"{key[:8].decode('ascii', 'replace')}... is {kind}; publishers may only ask for "
            "status and wait here"
        )


@dataclass(frozen=True)
class RoleAuth:
    """Each endpoint's keys and the roles: ``publish`` and ``control`` (None: no keys)."""

    publish: ChannelAuth | None
    control: ChannelAuth | None
    roles: Roles

    @property
    def shared(self) -> bool:
        """Whether client keys are allowed and every one holds both roles (one list)."""
        keys = self.control.allowed_clients if self.control is not None else ()
        return bool(keys) and self.roles == Roles()


def _keys(keys: Collection[bytes | str], what: str) -> frozenset[bytes]:
    try:
        return frozenset(z85_key(key, f"a key in {what}") for key in keys)
    except AiosyncError as exc:
        raise ValueError(exc.reason) from None


def role_auth(
    auth: ChannelAuth | None,
    publisher_keys: Collection[bytes | str] | None,
    subscriber_keys: Collection[bytes | str] | None,
) -> RoleAuth:
    """The publish and control endpoints' keys and the roles (ValueError if inconsistent).

    A role whose list is not given takes ``auth.allowed_clients``. Without either list,
    both endpoints take ``auth`` as it is and every allowed key holds both roles.
    """
    if publisher_keys is None and subscriber_keys is None:
        return RoleAuth(auth, auth, Roles())
    if auth is None or auth.public_key is None:
        raise ValueError(
            "publisher_keys and subscriber_keys need auth with the server's keypair "
            "(ChannelAuth.server(...))"
        )
    given = frozenset(auth.allowed_clients)
    publishers = given if publisher_keys is None else _keys(publisher_keys, "publisher_keys")
    subscribers = given if subscriber_keys is None else _keys(subscriber_keys, "subscriber_keys")
    both = sorted(publishers & subscribers)
    if both:
        first = both[0][:8].decode("ascii", "replace")
        raise ValueError(
            f"{len(both)} key(s) are both publishers' and subscribers' (the first {first}...): "
            "each key holds one role"
        )
    publish = dataclasses.replace(auth, allowed_clients=publishers)
    control = dataclasses.replace(auth, allowed_clients=publishers | subscribers)
    return RoleAuth(publish, control, Roles(publishers, subscribers))


def receiver_auth(endpoint: str, own: ChannelAuth | None, key: str | None) -> ChannelAuth | None:
    """How the server connects to the receiver a subscription names (AiosyncError: it cannot).

    ``own`` is the server's ``subscriber_auth`` (its keypair, or ``insecure_loopback``);
    ``key`` the receiver's public key (Z85) from the subscription. With both: CURVE. An
    ``ipc://`` receiver without a key is reached plain: the private directory's permissions
    guard it, as they guard every default endpoint. A ``tcp://`` one without a key gets
    ``own`` as it is (plain only on loopback with ``insecure_loopback``).
    """
    if key is not None and own is not None and own.public_key is not None:
        server_key = key.encode("ascii", "replace")
        return ChannelAuth(own.public_key, own.secret_key, server_key=server_key)
    if endpoint.startswith("ipc://"):
        return None
    if own is not None and own.public_key is not None and own.server_key is None:
        raise AiosyncError(
            f"{endpoint}: a tcp:// receiver needs its public key in the subscription "
            "(Subscriber(receiver_auth=ChannelAuth.server(...)))"
        )
    return own


def new_challenge() -> tuple[str, bytes]:
    """A fresh challenge: (a reference both sides may see, the secret token)."""
    return secrets.token_hex(8), secrets.token_bytes(TOKEN_BYTES)


def proven(token: bytes, proof: m.Request) -> bool:
    """Whether ``proof`` (peer input) is a :class:`~.messages.Proof` of ``token``."""
    return isinstance(proof, m.Proof) and hmac.compare_digest(proof.token, token)
