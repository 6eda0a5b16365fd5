"""``sekali metrics show [--json]`` and ``sekali metrics serve --port N``.

``serve`` answers ``GET /metrics`` on 127.0.0.1 (``--host`` to widen it) with prometheus-client's
own WSGI app over a private registry holding one :class:`SnapshotCollector`, so the exposition
(text 0.0.4 or OpenMetrics, as the scraper asks) is the library's. Every other path is 404, and
a scrape whose snapshot cannot be computed is 503, so Prometheus's ``up`` turns 0 instead of
recording a partial page.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from cli.commands.doctor import add_source_arguments, observability_from_args
from cli.commands.output import add_output_arguments, emit
from engine.health.metrics import MetricsSnapshot, SnapshotCollector

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: %s", format % args)


class MetricsServer:
    """Serves a snapshot source on ``/metrics``: ``start()`` on a thread, ``stop()`` ends it."""

    def __init__(
        self,
        collector: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        min_interval: float = 1.0,
        lease_seconds: float | None = None,
    ) -> None:

        snapshot: Callable[[], MetricsSnapshot] = collector.collect
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            SnapshotCollector(snapshot, min_interval=min_interval, lease_seconds=lease_seconds)
        )
        self._app = make_wsgi_app(self.registry)
        self.httpd = make_server(
            host, port, self._route, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host_text = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{host_text}:{port}/metrics"

    def _route(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"only /metrics is served\n"]
        try:
            return list(self._app(environ, start_response))
        except Exception as exc:  # noqa: BLE001 - answer 503, keep serving
            log.warning("metrics collection failed", exc_info=True)
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"metrics unavailable: {type(exc).__name__}\n".encode()]

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name="metrics-http"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("metrics", help="show metrics or serve them to Prometheus")
    actions = parser.add_subparsers(dest="metrics_command", required=True)
    show = actions.add_parser("show", help="print the current metrics")
    add_output_arguments(show)
    add_source_arguments(show)
    show.set_defaults(func=_show)
    serve = actions.add_parser("serve", help="serve /metrics to Prometheus on 127.0.0.1")
    serve.add_argument("--port", type=int, default=9464)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--min-interval", type=float, default=1.0,
                       help="reuse a snapshot for this many seconds")
    add_source_arguments(serve)
    serve.set_defaults(func=_serve)


def _show(args: argparse.Namespace) -> int:
    snapshot = observability_from_args(args).collector.collect()

    def human() -> None:
        for key, value in sorted(snapshot.flat().items()):
            print(f"{key:<80} {value:g}")
        if snapshot.missing:
            print(f"(sources missing: {', '.join(snapshot.missing)})")

    return emit(args, json.loads(json.dumps(snapshot.as_dict(), sort_keys=True)), human)


def _serve(args: argparse.Namespace) -> int:
    obs = observability_from_args(args, created=False)
    server = MetricsServer(obs.collector, host=args.host, port=args.port,
                           min_interval=args.min_interval,
                           lease_seconds=obs.setup.lease_seconds)
    print(f"serving {server.url}", flush=True)
    try:
        server.httpd.serve_forever()
    finally:
        server.httpd.server_close()
    return 0
