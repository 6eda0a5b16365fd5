"""``sekali metrics show [--json]`` and ``sekali metrics serve --port N``.

``serve`` answers ``GET /metrics`` on 127.0.0.1 with the Prometheus text format, computing a
fresh snapshot per scrape (at most one per ``--min-interval`` seconds, so a burst of scrapes
costs one set of queries). Only the standard library's ``http.server``: no new dependency.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pipelines.commands.doctor import add_source_arguments, observability_from_args
from pipelines.metrics import to_prometheus

log = logging.getLogger(__name__)


class MetricsServer:
    """A Prometheus endpoint over a collector: ``start()`` serves on a thread, ``stop()`` ends."""

    def __init__(
        self, collector: Any, *, host: str = "127.0.0.1", port: int = 0,
        min_interval: float = 1.0,
    ) -> None:
        self.collector = collector
        self.min_interval = min_interval
        self._cache: tuple[float, str] | None = None
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics http: %s", format % args)

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    body = server.render().encode()
                except Exception as exc:  # noqa: BLE001 - answer 503, keep serving
                    log.warning("metrics collection failed", exc_info=True)
                    self.send_error(503, f"metrics unavailable: {type(exc).__name__}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        host_text = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{host_text}:{self.httpd.server_port}/metrics"

    def render(self) -> str:

        with self._lock:
            now = time.monotonic()
            if self._cache is None or now - self._cache[0] >= self.min_interval:
                self._cache = (now, to_prometheus(self.collector.collect()))
            return self._cache[1]

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="metrics-http")
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
    show.add_argument("--json", action="store_true")
    add_source_arguments(show)
    show.set_defaults(func=_show)
    serve = actions.add_parser("serve", help="serve /metrics (Prometheus text) on 127.0.0.1")
    serve.add_argument("--port", type=int, default=9464)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--min-interval", type=float, default=1.0,
                       help="reuse a snapshot for this many seconds")
    add_source_arguments(serve)
    serve.set_defaults(func=_serve)


def _show(args: argparse.Namespace) -> int:
    snapshot = observability_from_args(args).collector.collect()
    if args.json:
        print(json.dumps(snapshot.as_dict(), indent=2, sort_keys=True))
        return 0
    for key, value in sorted(snapshot.flat().items()):
        print(f"{key:<80} {value:g}")
    if snapshot.missing:
        print(f"(sources missing: {', '.join(snapshot.missing)})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    server = MetricsServer(observability_from_args(args).collector, host=args.host,
                           port=args.port, min_interval=args.min_interval)
    print(f"serving {server.url}", flush=True)
    try:
        server.httpd.serve_forever()
    finally:
        server.httpd.server_close()
    return 0
