"""``sekali ui-proxy``: HTTP basic authentication in front of the writable Dagster UI.

The Dagster webserver has no login: anyone who reaches it reads payloads and launches runs
with config of their own. In production the writable webserver listens on loopback only, and
this proxy is what people reach: every request needs ``Authorization: Basic`` with a user and
password from ``--users-file`` (``user:password`` lines; the file must be this user's and mode
0600, or it is refused), compared in constant time; anything else gets 401 and never reaches
the webserver. Viewers use a second webserver started with ``dagster-webserver --read-only``
(deploy/production/README.md), which needs no proxy.

What passes: the request line, headers (``Authorization`` removed, ``X-Forwarded-For`` set)
and body, to ``--upstream`` (a fixed address of the operator's: no request picks where it
goes), and the answer back, streamed. A WebSocket upgrade (the UI's live run logs) is
authenticated the same way, then the two connections are joined byte for byte.
``GET /server_info`` (the webserver's version, what health probes ask) passes without a login.

Bounds: the client's headers within :data:`READ_TIMEOUT_S`, a request body of at most
``--max-body`` bytes (413 otherwise, before reading it), connecting to the upstream within 5 s
and each read from it within 60 s. Put TLS in front of it (a load balancer, or a TLS
terminator) wherever the network between the user and the proxy is not trusted: basic
authentication sends the password with every request.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import http.client
import logging
import select
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from resources.storage.files import SecretFileUnsafe, read_secret_file

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 60.0
MAX_BODY = 16 * 1024 * 1024
REALM = "sekali"
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailers", "transfer-encoding", "upgrade", "authorization", "host"})
OPEN_PATHS = frozenset({"/server_info"})


def load_users(path: Path) -> dict[str, str]:
    """``user -> password`` from ``path`` (``user:password`` lines, ``#`` comments), refused
    (:class:`SecretFileUnsafe`) unless only its owner (this user) can read it."""
    users: dict[str, str] = {}
    for line in read_secret_file(path).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise SecretFileUnsafe(f"{path}: a line is not user:password")
        users[user] = password
    if not users:
        raise SecretFileUnsafe(f"{path}: no user:password line")
    return users


def allowed(users: dict[str, str], header: str | None) -> str | None:
    """The user ``header`` (an ``Authorization`` value) authenticates, or None. Every user's
    password is compared, in constant time, whatever matched."""
    if not header or not header.startswith("Basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    found = None
    for name, expected in users.items():
        same = hmac.compare_digest(name.encode(), user.encode())
        if hmac.compare_digest(expected.encode(), password.encode()) and same and sep:
            found = name
    return found


class AuthProxy(ThreadingHTTPServer):
    """The proxy server: ``users`` allowed, requests forwarded to ``upstream``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: tuple[str, int], upstream: str, users: dict[str, str],
                 max_body: int = MAX_BODY) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--upstream: an http://host:port URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.users = users
        self.max_body = max_body
        super().__init__(listen, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S
    server: AuthProxy

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("ui-proxy %s " + format, self.address_string(), *args)

    def _refuse(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
        data = message.encode()
        self.send_response(status)
        for name, value in {"Content-Type": "text/plain", "Content-Length": str(len(data)),
                            **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _any(self) -> None:
        path = urlsplit(self.path).path
        user = allowed(self.server.users, self.headers.get("Authorization"))
        if user is None and not (self.command == "GET" and path in OPEN_PATHS):
            self._refuse(401, "login required\n",
                         {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'})
            return
        if self.headers.get("Upgrade", "").lower() == "websocket":
            self._tunnel()
            return
        declared = (self.headers.get("Content-Length") or "0").strip()
        if not declared.isdigit() or int(declared) > self.server.max_body:
            self.close_connection = True
            self._refuse(413 if declared.isdigit() else 400, "request body refused\n")
            return
        body = self.rfile.read(int(declared)) if int(declared) else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers["X-Forwarded-For"] = self.client_address[0]
        if user:
            headers["X-Forwarded-User"] = user
        upstream = http.client.HTTPConnection(*self.server.upstream,
                                              timeout=CONNECT_TIMEOUT_S)
        try:
            upstream.connect()
            assert upstream.sock is not None
            upstream.sock.settimeout(UPSTREAM_READ_TIMEOUT_S)
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            self.send_response(answer.status, answer.reason)
            bodiless = self.command == "HEAD" or answer.status in (204, 304)
            for name, value in answer.getheaders():
                if name.lower() not in _HOP and (bodiless or name.lower() != "content-length"):
                    self.send_header(name, value)
            if bodiless:
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        except OSError as exc:
            log.warning("ui-proxy: upstream %s:%d: %s", *self.server.upstream, exc)
            self.close_connection = True
            if not self.wfile.closed:
                self._refuse(502, "the Dagster webserver did not answer\n")
        finally:
            upstream.close()

    def _tunnel(self) -> None:
        """Send the upgrade request on, then join the two sockets until either closes."""
        lines = [f"{self.command} {self.path} {self.request_version}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items() if k.lower() != "authorization"]
        try:
            upstream = socket.create_connection(self.server.upstream, CONNECT_TIMEOUT_S)
        except OSError:
            self._refuse(502, "the Dagster webserver did not answer\n")
            return
        self.close_connection = True
        with upstream:
            upstream.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            client = self.connection
            client.settimeout(None)
            upstream.settimeout(None)
            pending = self.rfile.peek() if hasattr(self.rfile, "peek") else b""
            if pending:
                upstream.sendall(self.rfile.read1(len(pending)))
            pair = {client: upstream, upstream: client}
            while True:
                ready, _, _ = select.select(list(pair), [], [], 300)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    pair[sock].sendall(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _any  # noqa: N815


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    proxy = sub.add_parser("ui-proxy", help="basic authentication in front of the Dagster UI")
    proxy.add_argument("--listen", default="127.0.0.1:3000", help="HOST:PORT (127.0.0.1:3000)")
    proxy.add_argument("--upstream", default="http://127.0.0.1:3001",
                       help="the writable webserver, on loopback (http://127.0.0.1:3001)")
    proxy.add_argument("--users-file", type=Path, required=True,
                       help="user:password lines, mode 0600, owned by this user")
    proxy.add_argument("--max-body", type=int, default=MAX_BODY,
                       help=f"largest request body in bytes ({MAX_BODY})")
    proxy.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"error: --listen: HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 2
    try:
        users = load_users(args.users_file)
        server = AuthProxy((host.strip("[]"), int(port)), args.upstream, users, args.max_body)
    except (OSError, SecretFileUnsafe, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"sekali ui-proxy: {args.listen} -> {args.upstream} ({len(users)} user(s))",
          file=sys.stderr, flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0
