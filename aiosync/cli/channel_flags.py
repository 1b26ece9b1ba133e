"""Whether a command's endpoints may be used with the keys its flags give, said in flags.

The library refuses plain ``tcp://`` in terms of its Python API (``auth=ChannelAuth(...)``);
a person at the command line needs the flags instead. :func:`check_channel_flags` applies
the library's own rule (:func:`aiosync.channels.endpoints.plain_refusal`) to the parsed
arguments before anything starts, so a refusal is a usage error naming ``--keypair`` and
the flag for the other side's public key.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from aiosync.cli.checks import CommandError

KEYGEN = "made by 'aiosync keygen'"


class Use(NamedTuple):
    """One endpoint a command uses: the flag naming it, whether it binds, the peers' key."""

    flag: str
    endpoint: str | None
    binds: bool
    peer_key: str


def endpoints_of(args: argparse.Namespace) -> list[Use]:
    """The endpoints ``args`` (a parsed command line) binds or connects to."""
    if args.command == "trainer":
        key = "--server-key FILE (the engine's public key)"
        return [Use("--endpoint", e, False, key) for e in args.endpoint]
    if args.command == "engine":
        return [Use("--endpoint", args.endpoint, True, "--allow PATH (the trainers' public keys)")]
    if args.command == "serve":
        peers, upstream = "--allow PATH (the peers' public keys)", "--upstream-key FILE"
        return [
            Use("--publish", args.publish, True, peers),
            Use("--control", args.control, True, peers),
            Use("--upstream", args.upstream, False, f"{upstream} (the upstream's public key)"),
        ]
    return []


def check_channel_flags(args: argparse.Namespace) -> None:
    """Raise :class:`CommandError` for an endpoint the given flags do not allow.

    With ``--keypair`` every transport is allowed (the key files are read when the
    channel opens); without it, plain ``tcp://`` only on loopback with
    ``--insecure-loopback``, as the library decides.
    """
    from aiosync.channels.endpoints import check_endpoint, plain_refusal, scheme_of
    from aiosync.core.errors import AiosyncError

    for use in endpoints_of(args):
        if use.endpoint is None:
            continue
        if scheme_of(use.endpoint) == "inproc":
            raise CommandError(
                f"{use.flag} {use.endpoint}: inproc:// never reaches another process; use "
                "ipc://PATH on this machine, or tcp://HOST:PORT"
            )
        try:
            check_endpoint(use.endpoint, binding=use.binds)
        except AiosyncError as exc:
            raise CommandError(f"{use.flag} {exc.reason}") from None
        if args.keypair:
            continue
        refusal = plain_refusal(use.endpoint, insecure_loopback=args.insecure_loopback)
        keys = f"--keypair FILE (this side's secret key) and {use.peer_key}, {KEYGEN}"
        if refusal == "keys":
            raise CommandError(
                f"{use.flag} {use.endpoint} needs CURVE keys: pass {keys} (plain tcp only "
                "on 127.0.0.1, ::1 or localhost, with --insecure-loopback)"
            )
        if refusal == "loopback":
            raise CommandError(
                f"{use.flag} {use.endpoint} is not a loopback address: --insecure-loopback "
                f"allows plain tcp only on 127.0.0.1, ::1 or localhost; pass {keys}"
            )
