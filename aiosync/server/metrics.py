"""The server's metrics (``prometheus-client``, the ``server`` extra) and its health check.

Each server has a registry of its own (two servers in one process do not mix). The HTTP
endpoint is off unless asked for, and binds loopback only: :func:`serve_metrics` refuses
any other host. ``/metrics`` is the Prometheus text format; ``/healthz`` answers 200 once
the server holds a version and 503 before (its body says why). The endpoint answers at
most ``ServerConfig.metrics_concurrency`` requests at once and closes a connection whose
request has not arrived within ``metrics_read_timeout`` seconds
(:mod:`aiosync.server.metrics_http`): slow clients hold no threads.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack, ExitStack
from typing import Any

from aiosync.core.errors import AiosyncError, UsageError
from aiosync.server.config import ServerConfig
from aiosync.server.fleet import FleetBook
from aiosync.server.metrics_http import BoundedHTTPServer, HeadReadHandler

log = logging.getLogger(__name__)

STAGES = ("publish", "transfer", "late_join")
"""Latency histograms: a published version from its first bucket to retained, a transfer
to one engine, and a new engine's wait for its first version: from the first moment the
server has one to send it (it subscribed and a version is retained; with ``follow=False``,
it fetched one) to that version committed there, retries included."""


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise UsageError(
            "server metrics need prometheus-client: pip install 'aiosync[server]'"
        ) from None
    return prometheus_client


class ServerMetrics:
    """Counters, gauges and per-stage latency histograms of one server."""

    def __init__(self) -> None:
        prom = _require()
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.published = prom.Counter("aiosync_versions_published", "Versions retained", registry=r)
        self.served = prom.Counter(
            "aiosync_versions_served", "Versions committed by subscribers", registry=r
        )
        self.bytes_in = prom.Counter("aiosync_bytes_published", "Bytes published", registry=r)
        self.bytes_out = prom.Counter("aiosync_bytes_served", "Bytes streamed", registry=r)
        self.bytes_held = prom.Counter(
            "aiosync_bytes_held", "Bytes not streamed: the engine held them", registry=r
        )
        self.failures = prom.Counter(
            "aiosync_transfer_failures", "Transfers to subscribers that failed", registry=r
        )
        self.latency = prom.Histogram(
            "aiosync_stage_seconds",
            "Seconds per stage",
            ["stage"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.newest = prom.Gauge("aiosync_newest_version", "Newest retained version", registry=r)
        self.retained_bytes = prom.Gauge(
            "aiosync_retained_bytes", "Shared memory held by retained versions", registry=r
        )
        self.engines = prom.Gauge("aiosync_engines_connected", "Subscribers connected", registry=r)
        self.engine_version = prom.Gauge(
            "aiosync_engine_version", "Each engine's version", ["engine"], registry=r
        )
        self.engine_lag = prom.Gauge(
            "aiosync_engine_lag", "Versions each engine lags", ["engine"], registry=r
        )

    def engine(self, name: str, version: int | None, lag: int | None) -> None:
        """Record one engine's version and lag (-1: none yet)."""
        self.engine_version.labels(name).set(-1 if version is None else version)
        self.engine_lag.labels(name).set(-1 if lag is None else lag)

    def update(self, fleet: FleetBook, retained_bytes: int) -> None:
        """Record every engine's version and lag, how many there are, and memory held."""
        for state in fleet.subscribers.values():
            self.engine(state.name, state.version, fleet.lag(state.name))
        self.engines.set(len(fleet.subscribers))
        self.retained_bytes.set(retained_bytes)

    def forget(self, names: Iterable[str]) -> None:
        """Drop the per-engine series of engines that left."""
        for name in names:
            for gauge in (self.engine_version, self.engine_lag):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(_require().generate_latest(self.registry))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsAddressError(AiosyncError):
    """The metrics endpoint cannot listen on its port: in use, or not this user's to take."""


class MetricsEndpoint:
    """A small HTTP server on a loopback address, in a thread of its own.

    At most ``concurrency`` requests are answered at once (more get 503); a connection
    whose request has not arrived within ``read_timeout`` seconds is closed.
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        concurrency: int = 8,
        read_timeout: float = 5.0,
    ) -> None:
        if not _loopback(host):
            raise UsageError(f"the metrics endpoint binds loopback only, not {host!r}")
        self._metrics = metrics
        self._health = health
        if not 0 <= port <= 65535:
            raise MetricsAddressError(f"metrics port {port} is not from 0 to 65535")
        handler = self._handler()
        try:
            self._server = BoundedHTTPServer(
                (host, port), handler, concurrency=concurrency, read_timeout=read_timeout
            )
        except OSError as exc:
            raise MetricsAddressError(
                f"the metrics endpoint cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="aiosync-metrics", daemon=True
        )

    @property
    def address(self) -> str:
        """``http://host:port`` of the endpoint."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def _handler(self) -> type[HeadReadHandler]:
        endpoint = self

        class Handler(HeadReadHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, status = endpoint._metrics.text(), 200
                    kind = "text/plain; version=0.0.4"
                elif self.path == "/healthz":
                    ok, detail = endpoint._health()
                    body, status = json.dumps(detail).encode(), 200 if ok else 503
                    kind = "application/json"
                else:
                    body, status, kind = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics: " + format, *args)

        return Handler

    def start(self) -> None:
        """Serve in the background thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop serving and join the thread."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def open_metrics(
    stack: ExitStack | AsyncExitStack,
    config: ServerConfig,
    health: Callable[[], tuple[bool, dict[str, Any]]],
) -> tuple[ServerMetrics | None, MetricsEndpoint | None]:
    """The server's metrics and its HTTP endpoint (started, closed with ``stack``).

    Without prometheus-client: no metrics, or a UsageError when an endpoint is asked for.
    """
    try:
        metrics = ServerMetrics()
    except UsageError:
        if config.metrics_port is not None:
            raise
        return None, None
    if config.metrics_port is None:
        return metrics, None
    http = MetricsEndpoint(
        metrics,
        health,
        config.metrics_host,
        config.metrics_port,
        concurrency=config.metrics_concurrency,
        read_timeout=config.metrics_read_timeout,
    )
    stack.callback(http.close)
    http.start()
    return metrics, http
