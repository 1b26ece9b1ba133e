"""The rules an endpoint string must follow before any socket is made (pure, no IO).

:func:`check_endpoint` refuses what zmq would answer with a bare "Invalid argument", or
accept and never connect: an endpoint without a scheme (``localhost:5555``) and
``inproc://`` (every aiosync channel and listener has a zmq context of its own, and
``inproc://`` reaches only sockets of the same context; an engine in the trainer's own
process uses :class:`~aiosync.channels.inproc.InprocListener` instead). :func:`plain_refusal`
says whether an endpoint may be used without CURVE keys: the one rule behind both the
library's error (:func:`aiosync.channels.zmq_common.curve_keys`) and the CLI's, which
names its flags instead of the Python API.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from aiosync.core.errors import UsageError

LOCAL_SCHEMES = ("ipc", "inproc")
NETWORK_SCHEMES = ("tcp", "ws", "wss", "tipc", "vmci", "udp", "pgm", "epgm", "norm")

Refusal = Literal["keys", "loopback"]
"""Why plain use is refused: CURVE keys are needed, or insecure_loopback on a non-loopback."""


def scheme_of(endpoint: str) -> str:
    """The endpoint's scheme in lower case (``""`` when it has none)."""
    return endpoint.partition("://")[0].lower() if "://" in endpoint else ""


def check_endpoint(endpoint: str, *, binding: bool) -> None:
    """Raise :class:`UsageError` for an endpoint no aiosync peer could ever use.

    ``binding``: the endpoint is to be bound (a receiver's), else connected to (a sender's).
    """
    if "://" not in endpoint:
        raise UsageError(
            f"bad address {endpoint!r}: an endpoint needs a scheme, "
            f"tcp://{endpoint or 'HOST:PORT'} or ipc://PATH"
        )
    if scheme_of(endpoint) == "inproc":
        who = "no sender can reach it" if binding else "no receiver can be reached there"
        raise UsageError(
            f"{endpoint}: {who}: zmq's inproc:// connects only sockets of one zmq context, "
            "and each aiosync channel and listener has its own; use ipc:// on this machine, "
            "or, for an engine in the trainer's process, pass an "
            "aiosync.channels.inproc.InprocListener as the receiver's endpoint and its "
            "connect() as the sender's engine"
        )


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ``tcp://`` on 127.0.0.0/8, ``::1`` or ``localhost``; anything unclear is not."""
    if not endpoint.startswith("tcp://"):
        return False
    address = endpoint.removeprefix("tcp://").rpartition(";")[2]  # "source;destination"
    host = address.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", interface names, host names: not provably loopback


def plain_refusal(endpoint: str, *, insecure_loopback: bool) -> Refusal | None:
    """Why ``endpoint`` may not be used without CURVE keys; None when it may.

    ``ipc://`` (and unknown schemes, which zmq refuses as bad addresses) need no keys;
    ``tcp://`` only on a loopback address with ``insecure_loopback``; other network
    transports always need keys.
    """
    scheme = scheme_of(endpoint)
    if scheme in LOCAL_SCHEMES or scheme not in NETWORK_SCHEMES:
        return None
    if scheme == "tcp" and insecure_loopback:
        return None if is_loopback_endpoint(endpoint) else "loopback"
    return "keys"
