"""``aiosync serve``: run a weight server until SIGTERM or Ctrl-C.

It prints one JSON line on stdout once serving, ``{"event": "ready", "publish": ...,
"control": ..., "metrics": ...}``: trainers give ``publish`` to their ``WeightSender``,
engines give ``control`` to a :class:`~aiosync.server.Subscriber`. SIGTERM and SIGINT
cancel the server: transfers in flight are aborted, subscribers are told, and shared
memory and private directories are released before the exit (status 143 and 130). A metrics
port that cannot be listened on (in use) ends it at once with one line and status 2.
"""

from __future__ import annotations

import argparse
import logging

from aiosync.cli.checks import (
    MiB,
    OptionError,
    bind_endpoint,
    connect_endpoint,
    port_number,
    positive_float,
    positive_int,
    size_mib,
)

log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options."""
    parser.add_argument(
        "--publish",
        type=bind_endpoint,
        metavar="ENDPOINT",
        help="where trainers connect (default: private ipc://)",
    )
    parser.add_argument(
        "--control",
        type=bind_endpoint,
        metavar="ENDPOINT",
        help="where engines subscribe (default: private ipc://)",
    )
    parser.add_argument(
        "--retain", type=positive_int, default=2, metavar="N", help="versions kept at most"
    )
    parser.add_argument(
        "--retain-mb",
        type=size_mib,
        default=None,
        metavar="MIB",
        help="shared memory for versions at most (must hold two versions); default: no bound",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="longest wait on a subscriber at each step",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve /metrics and /healthz on 127.0.0.1:PORT (0: any free port); default: off",
    )
    parser.add_argument(
        "--metrics-concurrency",
        type=positive_int,
        default=8,
        metavar="N",
        help="metrics requests answered at once at most (more get 503)",
    )
    parser.add_argument(
        "--metrics-read-timeout",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="close a metrics connection whose request has not arrived within this",
    )
    parser.add_argument(
        "--keypair", metavar="FILE", help="the server's CURVE secret key file (tcp:// needs keys)"
    )
    parser.add_argument(
        "--allow",
        metavar="PATH",
        help="public key file, or directory of them, of peers let in: each may both publish "
        "and subscribe (a role given its own list below takes that instead)",
    )
    parser.add_argument(
        "--allow-publishers",
        metavar="PATH",
        help="public key file, or directory of them, of the trainers that may publish (and on "
        "the control endpoint only ask for status and wait)",
    )
    parser.add_argument(
        "--allow-subscribers",
        metavar="PATH",
        help="public key file, or directory of them, of the engines and relays that may "
        "subscribe (they may not publish)",
    )
    parser.add_argument(
        "--upstream",
        type=connect_endpoint,
        metavar="ENDPOINT",
        help="relay: pull every version from this server's control endpoint (tcp:// between "
        "machines) and serve it here",
    )
    parser.add_argument(
        "--upstream-key", metavar="FILE", help="the upstream server's public key file (with keys)"
    )
    parser.add_argument(
        "--resume-dir",
        metavar="DIR",
        help="relay: keep the buckets of a version being pulled here, so that a restarted "
        "relay fetches only the missing ones (made 0700)",
    )
    parser.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="allow plain tcp on 127.0.0.1 without keys (any local user can then connect)",
    )


def serve(args: argparse.Namespace) -> int:
    """Run the server until stopped."""
    from aiosync.cli.roles import emit, run_role

    async def main() -> None:
        from aiosync.channels.keys import ChannelAuth
        from aiosync.cli.checks import CommandError
        from aiosync.server import RetentionPolicy, ServerConfig, WeightServer

        publishers, subscribers = _role_keys(args)
        if args.keypair:
            if not (args.allow or args.allow_publishers or args.allow_subscribers):
                raise CommandError(
                    "--keypair needs --allow, or --allow-publishers and --allow-subscribers "
                    "(the peers' public keys)"
                )
            auth: ChannelAuth | None = ChannelAuth.server(args.keypair, args.allow or [])
            assert auth is not None
            # towards subscribers' tcp receivers: this keypair; each names its own key
            client: ChannelAuth | None = ChannelAuth(auth.public_key, auth.secret_key)
        elif args.insecure_loopback:
            auth = client = ChannelAuth(insecure_loopback=True)
        else:
            auth = client = None
        upstream_auth = auth
        if args.upstream and args.keypair:
            if not args.upstream_key:
                raise CommandError("--upstream with --keypair needs --upstream-key")
            upstream_auth = ChannelAuth.client(args.keypair, args.upstream_key)
        limit = None if args.retain_mb is None else int(args.retain_mb * MiB)
        try:
            config = ServerConfig(
                retention=RetentionPolicy(max_versions=args.retain, max_bytes=limit),
                publish_endpoint=args.publish,
                control_endpoint=args.control,
                auth=auth,
                publisher_keys=publishers,
                subscriber_keys=subscribers,
                subscriber_auth=client,
                timeout=args.timeout,
                metrics_port=args.metrics_port,
                metrics_concurrency=args.metrics_concurrency,
                metrics_read_timeout=args.metrics_read_timeout,
                upstream=args.upstream,
                upstream_auth=upstream_auth,
                resume_dir=args.resume_dir,
            )
        except ValueError as exc:  # a key given both roles
            raise CommandError(str(exc)) from None
        async with WeightServer(config) as server:
            emit(
                "ready",
                publish=server.publish_endpoint,
                control=server.control_endpoint,
                metrics=server.metrics_address,
            )
            import anyio

            await anyio.sleep_forever()

    from aiosync.runtime import unwrap_group
    from aiosync.server.metrics import MetricsAddressError

    try:
        run_role(main)
    except BaseException as exc:
        if isinstance(unwrap_group(exc), MetricsAddressError):
            raise OptionError("--metrics-port", str(unwrap_group(exc))) from None
        raise
    return 0


def _role_keys(
    args: argparse.Namespace,
) -> tuple[frozenset[bytes] | None, frozenset[bytes] | None]:
    """The keys of ``--allow-publishers`` and ``--allow-subscribers`` (None: not given)."""
    from aiosync.channels.keys import load_public_keys
    from aiosync.cli.checks import CommandError

    paths = args.allow_publishers, args.allow_subscribers
    if any(paths) and not args.keypair:
        raise CommandError("--allow-publishers and --allow-subscribers need --keypair")
    publishers, subscribers = (None if p is None else load_public_keys(p) for p in paths)
    return publishers, subscribers
