"""What the sandbox's HTTP stand-ins share: a JSON request handler, a threaded server that takes
a client hanging up in its stride, and serving on a background thread.

Every stand-in reads its clients under one bound, :data:`READ_TIMEOUT_S`: a half-sent
request is disconnected, not served forever.

A stand-in subclasses :class:`JsonHandler` (its ``dispatch(method)`` answers every request) and
:class:`ServedOnThread` (it names its handler class and thread); the handler reaches the
stand-in as ``self.server.owner``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
"""Seconds a stand-in waits on any one read of a client's socket (the request line, a header,
the body, or the next request on a kept-alive connection) before it closes the connection: a
client that sends half a request holds a handler thread this long, not forever. Longer than
httpx keeps an idle pooled connection (5 s): a pooled client rarely finds its idle one closed."""


class RequestRefused(Exception):  # answered with its status, never raised further
    """The request cannot be served: answered with ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class FaultSet:
    """A stand-in's faults as a dataclass: :meth:`update` changes the named ones and refuses a
    name it does not have."""

    def update(self, changes: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}  # type: ignore[arg-type]
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {sorted(names)}")
        for name, value in changes.items():
            setattr(self, name, value)


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    owner: Any

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (the faults make them) is a debug line, not a traceback that
        ``socketserver`` prints on stderr; anything else is logged as the error it is."""
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("client %s went away", client_address, exc_info=True)
        else:
            log.exception("request from %s failed", client_address)


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with JSON answers; every GET and POST goes to :meth:`dispatch`. Each read of
    the client's socket waits at most :data:`READ_TIMEOUT_S`; then the connection is closed
    without an answer (``handle_one_request`` or the stand-in's ``OSError`` branch)."""

    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S
    server: QuietServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s " + format, type(self).__module__, self.address_string(), *args)

    def send_json(
        self, status: int, payload: Any, headers: dict[str, str] | None = None, *,
        drip_ms: float = 0.0,
    ) -> None:
        """Answer ``payload`` as JSON; with ``drip_ms`` the body goes one byte every
        ``drip_ms`` (each read sees progress, the whole answer takes long)."""
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if drip_ms <= 0:
            self.wfile.write(data)
            return
        self.wfile.flush()
        for i in range(len(data)):
            time.sleep(drip_ms / 1000)
            self.wfile.write(data[i : i + 1])
            self.wfile.flush()

    def read_body(self, limit: int) -> bytes:
        """The request's body, refused (:class:`RequestRefused`) before a byte of it is read
        when its ``Content-Length`` is not a byte count (400) or is over ``limit`` (413)."""
        declared = (self.headers.get("Content-Length") or "0").strip()
        if not declared.isdigit():
            self.close_connection = True  # the body's end is unknown: nothing after it is read
            raise RequestRefused(400, f"Content-Length: {declared[:40]!r} is not a byte count")
        length = int(declared)
        if length > limit:
            self.close_connection = True
            raise RequestRefused(413, f"Content-Length: {length} bytes is over {limit}")
        return self.rfile.read(length) if length else b""

    def admin_allowed(self, token: str) -> bool:
        """The request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
        given = self.headers.get("Authorization") or ""
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def drop(self) -> None:
        """Close the connection without an answer."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self.dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.dispatch("POST")

    def dispatch(self, method: str) -> None:
        raise NotImplementedError


class ServedOnThread:
    """``start()`` serves on a background thread, ``stop()`` ends it (or use ``with``);
    ``serve_forever()`` serves on the calling thread. ``port`` 0 picks a free one."""

    handler: type[JsonHandler]
    thread_name = "sandbox-http"
    host: str
    port: int

    _httpd: QuietServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _bind(self) -> QuietServer:
        self._httpd = QuietServer((self.host, self.port), self.handler)
        self._httpd.owner = self
        self.port = int(self._httpd.server_address[1])
        return self._httpd

    def start(self) -> Self:
        httpd = self._bind()
        self._thread = threading.Thread(
            target=httpd.serve_forever, name=self.thread_name, daemon=True
        )
        self._thread.start()
        log.info("%s on %s", self.thread_name, self.url)
        return self

    def serve_forever(self) -> None:
        self._bind().serve_forever()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
