"""A bounded HTTP client: every call ends within its deadline, reads at most ``max_body`` bytes
of an answer, and says whether the request may have reached the server.

urllib3 underneath, pooled and thread-safe, its own retries off (the retry policy lives in
:mod:`resources.retry`). The bounds:

- ``timeout``: connecting and each read of the socket;
- ``deadline``: the whole call. Connecting and waiting for the answer to start fall under
  urllib3's ``Timeout(total=deadline)``; the body is read a piece at a time, each read's socket
  timeout cut to what is left, so an answer dripped a byte at a time cannot outlast it;
- ``max_body``: the answer's body is read up to this many bytes; the rest is left unread and
  the connection closed (``HttpAnswer.truncated``), so a huge answer costs no memory;
- ``send_by`` (per call, ``time.monotonic()`` scale): no byte of the request is written after
  it (:class:`SendDeadlinePassed`); a new connection's connect timeout is cut to it. The bound is
  checked before urllib3 is handed the request and again right before each write to the socket
  (the headers, then the body), so a process paused anywhere in between (connecting, a sibling
  thread's stop, a VM pause) writes nothing once it resumes past the bound. Refused at the body,
  only the headers left and the connection is closed: no server can act on that request. What
  is left is a pause between the last check and its ``sendall`` (a few instructions), or a
  kernel that holds written bytes and sends them later.

Where a call may go is decided first (:mod:`resources.egress`): the URL's host is resolved
within the deadline, every address checked against the rules and the allow-list, and the
connection is pinned to the checked address (no second resolution), or made through
``SEKALI_EGRESS_PROXY``. Redirects are never followed: a 3xx is an answer like any other.

Failures are two classes, by whether the request can have been received:

- :class:`HttpUnreachable`: no byte of the request was written: no connection (refused,
  connect timeout), a TLS handshake that failed (a wrong certificate, a plain-text server),
  a name that did not resolve in time;
- :class:`HttpNoAnswer`: the request went out and no whole answer came (a read timeout, a reset,
  the deadline while reading): the server may have acted on it (``maybe_received``).

No error carries an answer's body: :meth:`HttpAnswer.described` gives its status, size and
hash, which is what callers put in errors (an internal service's answer must not be readable
back through an error, a DLQ record or a log line).
"""

from __future__ import annotations

import email.utils
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.util import connection as urllib3_connection

from resources.egress import (
    Destination,
    EgressPolicy,
    EgressRefused,
    EgressUnresolved,
    shown_url,
)
from resources.errors import SendDeadlinePassed, TransientJobError
from resources.send_bound import within

DEFAULT_MAX_BODY = 64 * 1024
_MAX_POOLS = 128


class HttpUnreachable(TransientJobError):
    """No byte of the request was written (no connection, a failed TLS handshake, a name that
    did not resolve): nothing was sent. Retry with backoff; if it lasts, check the address,
    its certificate and that the server is up."""


class HttpNoAnswer(TransientJobError):
    """The request was sent and no whole answer came back within the bounds: the server may
    have acted on it. Do not repeat a non-idempotent request blind: ask the server first, or
    repeat it only under the same idempotency key or message id."""

    maybe_received = True


@dataclass(frozen=True)
class HttpAnswer:
    """A whole answer (its body cut to ``max_body`` when ``truncated``)."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    truncated: bool = False

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def described(self) -> str:
        """The answer as an error may name it: status, size and the body's hash, never the
        body (``410, 1234 bytes, sha256 9f86d081884c7d65``)."""
        more = "+" if self.truncated else ""
        digest = hashlib.sha256(self.body).hexdigest()[:16]
        return f"{self.status}, {len(self.body)}{more} bytes, sha256 {digest}"


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delta seconds or an HTTP date; None when
    absent or unreadable (the caller's own backoff applies)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


class _SendBound(threading.local):
    """The call this thread is making (a connection serves one call at a time, on the calling
    thread): its send bound, and whether a byte of it was written yet."""

    at: float | None = None
    what: str = ""
    wrote: bool = False


_SEND_BOUND = _SendBound()


class _BoundedSend:
    """A connection that checks this thread's send bound right before each write, notes that
    the request started going out, and connects to its pinned (checked) address."""

    pinned: str | None = None

    def send(self, data: Any) -> None:
        if getattr(self, "sock", None) is None:
            self.connect()  # type: ignore[attr-defined]  # a failure here wrote nothing
        try:
            with within(_SEND_BOUND.at, _SEND_BOUND.what):
                _SEND_BOUND.wrote = True
                super().send(data)  # type: ignore[misc]
        except SendDeadlinePassed:
            self.close()  # type: ignore[attr-defined]
            raise

    def _new_conn(self) -> Any:
        """urllib3's own connect, to the checked address instead of a fresh lookup of the
        host name (which could answer something else: DNS rebinding). The host name stays the
        connection's ``host``: the ``Host`` header, TLS's SNI and its certificate check."""
        if self.pinned is None:
            return super()._new_conn()  # type: ignore[misc]
        try:
            return urllib3_connection.create_connection(
                (self.pinned, self.port),  # type: ignore[attr-defined]
                self.timeout,  # type: ignore[attr-defined]
                source_address=self.source_address,  # type: ignore[attr-defined]
                socket_options=self.socket_options,  # type: ignore[attr-defined]
            )
        except TimeoutError as exc:
            raise urllib3.exceptions.ConnectTimeoutError(
                self, f"connection to {self.pinned} timed out") from exc
        except OSError as exc:
            raise urllib3.exceptions.NewConnectionError(
                self, f"failed to connect to {self.pinned}: {exc}",  # type: ignore[arg-type]
            ) from exc


class _BoundedHTTPConnection(_BoundedSend, HTTPConnection):
    pass


class _BoundedHTTPSConnection(_BoundedSend, HTTPSConnection):
    pass


class _Pinned:
    """A pool whose new connections go to one checked address."""

    pinned: str | None = None

    def _new_conn(self) -> Any:
        conn = super()._new_conn()  # type: ignore[misc]
        conn.pinned = self.pinned
        return conn


class _BoundedHTTPPool(_Pinned, HTTPConnectionPool):
    ConnectionCls = _BoundedHTTPConnection


class _BoundedHTTPSPool(_Pinned, HTTPSConnectionPool):
    ConnectionCls = _BoundedHTTPSConnection


class _DeadlinePassed(Exception):  # internal signal, mapped to HttpNoAnswer
    pass


class BoundedHttp:
    """The client (see the module). One per process is enough: it pools connections per
    checked destination. ``policy``: where calls may go (``EgressPolicy.from_env()``, read when
    the client is built)."""

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        deadline: float = 15.0,
        max_body: int = DEFAULT_MAX_BODY,
        pool_maxsize: int = 16,
        policy: EgressPolicy | None = None,
    ) -> None:
        if timeout <= 0 or deadline <= 0:
            raise ValueError("timeout and deadline must be positive seconds")
        if max_body < 0:
            raise ValueError("max_body must be >= 0 bytes")
        self.timeout = min(timeout, deadline)
        self.deadline = deadline
        self.max_body = max_body
        self.policy = policy if policy is not None else EgressPolicy.from_env()
        self._pool_maxsize = pool_maxsize
        self._pools: OrderedDict[tuple[str, str, int, str], HTTPConnectionPool] = OrderedDict()
        self._pools_lock = threading.Lock()
        self._proxy: urllib3.ProxyManager | None = None
        if self.policy.proxy is not None:
            self._proxy = urllib3.ProxyManager(
                self.policy.proxy, maxsize=pool_maxsize, block=False, retries=False,
                timeout=urllib3.Timeout(connect=self.timeout, read=self.timeout,
                                        total=deadline),
            )
            self._proxy.pool_classes_by_scheme = {"http": _BoundedHTTPPool,
                                                  "https": _BoundedHTTPSPool}

    def _pool(self, where: Destination) -> HTTPConnectionPool:
        """The pool of one checked destination (at most ``_MAX_POOLS`` kept, oldest closed)."""
        assert where.address is not None
        key = (where.scheme, where.host, where.port, where.address)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                cls = _BoundedHTTPSPool if where.scheme == "https" else _BoundedHTTPPool
                pool = cls(where.host, where.port, maxsize=self._pool_maxsize, block=False,
                           retries=False)
                pool.pinned = where.address
                self._pools[key] = pool
                while len(self._pools) > _MAX_POOLS:
                    self._pools.popitem(last=False)[1].close()
            self._pools.move_to_end(key)
            return pool

    def destination(self, url: str) -> Destination:
        """Where ``url`` would go, checked (:class:`EgressRefused` when it may not), resolving
        within the client's connect timeout."""
        return self.policy.check(url, self.timeout)

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        send_by: float | None = None,
        require_tls: bool = False,
    ) -> HttpAnswer:
        """One call, bounded as the module says; any status is an answer (the caller maps it).
        :class:`resources.egress.EgressRefused` (permanent) when the destination may not be
        called; ``require_tls``: plain http only to a destination the allow-list names."""
        shown = shown_url(url)
        ends_at = time.monotonic() + self.deadline
        try:
            where = self.policy.check(url, min(self.timeout, self.deadline),
                                      require_tls=require_tls)
        except EgressUnresolved as exc:
            raise HttpUnreachable(f"no connection to {shown}: {exc}") from exc
        connect = min(self.timeout, max(0.001, ends_at - time.monotonic()))
        if send_by is not None:
            left = send_by - time.monotonic()
            if left <= 0:
                raise SendDeadlinePassed(f"{method} {shown}", -left)
            connect = min(connect, left)
        total = max(0.001, ends_at - time.monotonic())
        timeout = urllib3.Timeout(connect=connect, read=self.timeout, total=total)
        _SEND_BOUND.at, _SEND_BOUND.what, _SEND_BOUND.wrote = send_by, f"{method} {shown}", False
        try:
            response = self._open(where, method, url, body, headers, timeout)
        except urllib3.exceptions.HTTPError as exc:
            if not _SEND_BOUND.wrote:
                raise HttpUnreachable(f"no connection to {shown}: {type(exc).__name__}"
                                      ) from exc
            raise HttpNoAnswer(
                f"{method} {shown} was sent and got no answer: {type(exc).__name__}"
            ) from exc
        finally:
            _SEND_BOUND.at = None
        try:
            data, truncated = self._read(response, ends_at)
        except (urllib3.exceptions.HTTPError, OSError, _DeadlinePassed) as exc:
            response.close()
            raise HttpNoAnswer(
                f"{method} {shown} answered {response.status} but its body did not come "
                f"within the {self.deadline:g}s deadline: {type(exc).__name__}"
            ) from exc
        if truncated:
            response.close()  # the rest stays unread: this connection cannot be reused
        else:
            response.release_conn()
        names = {name.lower(): value for name, value in response.headers.items()}
        return HttpAnswer(response.status, names, data, truncated)

    def _open(self, where: Destination, method: str, url: str, body: bytes | None,
              headers: Mapping[str, str] | None, timeout: urllib3.Timeout
              ) -> urllib3.BaseHTTPResponse:
        common: dict[str, Any] = {"body": body, "headers": dict(headers or {}),
                                  "preload_content": False, "timeout": timeout,
                                  "redirect": False, "retries": False}
        if self._proxy is not None:
            return self._proxy.urlopen(method, url, **common)
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return self._pool(where).urlopen(method, target, assert_same_host=False, **common)

    def _read(self, response: urllib3.BaseHTTPResponse, ends_at: float) -> tuple[bytes, bool]:
        sock = getattr(response.connection, "sock", None)
        chunks: list[bytes] = []
        size = 0
        while True:
            left = ends_at - time.monotonic()
            if left <= 0:
                raise _DeadlinePassed(f"{self.deadline:g}s passed while reading the answer")
            if sock is not None:
                sock.settimeout(min(self.timeout, left))
            chunk = response.read1(min(65536, self.max_body - size + 1))
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body:
                return b"".join(chunks)[: self.max_body], True

    def close(self) -> None:
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            pool.close()
        if self._proxy is not None:
            self._proxy.clear()


__all__ = [
    "DEFAULT_MAX_BODY",
    "BoundedHttp",
    "EgressPolicy",
    "EgressRefused",
    "HttpAnswer",
    "HttpNoAnswer",
    "HttpUnreachable",
    "retry_after",
]
