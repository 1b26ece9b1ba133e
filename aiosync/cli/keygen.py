"""``aiosync keygen DIR [--name NAME]``: write a CURVE keypair for ``tcp://`` channels.

Writes ``DIR/NAME.key`` (the public key: give it to the other side) and
``DIR/NAME.key_secret`` (both keys, mode 0600: keep it here). Existing files are never
overwritten. See docs/security.md for where each file goes.
"""

from __future__ import annotations

import argparse

from aiosync.cli.checks import CommandError


def keygen(args: argparse.Namespace) -> int:
    """Write the keypair and say which file goes where."""
    from aiosync.channels.keys import generate_keypair, load_public_key
    from aiosync.core.errors import AiosyncError

    try:
        public, secret = generate_keypair(args.directory, args.name)
    except AiosyncError as exc:
        raise CommandError(str(exc)) from None
    print(f"public key: {public} (give it to the other side: {load_public_key(public).decode()})")
    print(f"secret key: {secret} (mode 0600; keep it on this machine)")
    return 0
