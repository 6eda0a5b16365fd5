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

Failures are two classes, by whether the request can have been received:

- :class:`HttpUnreachable`: no connection (refused, connect timeout): nothing was sent;
- :class:`HttpNoAnswer`: the request went out and no whole answer came (a read timeout, a reset,
  the deadline while reading): the server may have acted on it (``maybe_received``).
"""

from __future__ import annotations

import email.utils
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from resources.errors import SendDeadlinePassed, TransientJobError

DEFAULT_MAX_BODY = 64 * 1024


class HttpUnreachable(TransientJobError):
    """No connection to the server: nothing was sent. Retry with backoff; if it lasts, check
    the address and that the server is up."""


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
    """The send bound of the call this thread is making (a connection serves one call at a
    time, on the calling thread)."""

    at: float | None = None
    what: str = ""


_SEND_BOUND = _SendBound()


class _BoundedSend:
    """A connection that checks this thread's send bound right before each write."""

    def send(self, data: Any) -> None:
        at = _SEND_BOUND.at
        if at is not None:
            if getattr(self, "sock", None) is None:
                self.connect()  # type: ignore[attr-defined]
            late_by = time.monotonic() - at
            if late_by >= 0:
                self.close()  # type: ignore[attr-defined]
                raise SendDeadlinePassed(_SEND_BOUND.what, late_by)
        super().send(data)  # type: ignore[misc]


class _BoundedHTTPConnection(_BoundedSend, HTTPConnection):
    pass


class _BoundedHTTPSConnection(_BoundedSend, HTTPSConnection):
    pass


class _BoundedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _BoundedHTTPConnection


class _BoundedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _BoundedHTTPSConnection


class _DeadlinePassed(Exception):  # noqa: N818 - internal signal, mapped to HttpNoAnswer
    pass


class BoundedHttp:
    """The client (see the module). One per process is enough: it pools connections per host.
    """

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        deadline: float = 15.0,
        max_body: int = DEFAULT_MAX_BODY,
        pool_maxsize: int = 16,
    ) -> None:
        if timeout <= 0 or deadline <= 0:
            raise ValueError("timeout and deadline must be positive seconds")
        if max_body < 0:
            raise ValueError("max_body must be >= 0 bytes")
        self.timeout = min(timeout, deadline)
        self.deadline = deadline
        self.max_body = max_body
        self._http = urllib3.PoolManager(
            maxsize=pool_maxsize, block=False, retries=False,
            timeout=urllib3.Timeout(connect=self.timeout, read=self.timeout, total=deadline),
        )
        self._http.pool_classes_by_scheme = {"http": _BoundedHTTPPool,
                                             "https": _BoundedHTTPSPool}

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        send_by: float | None = None,
    ) -> HttpAnswer:
        """One call, bounded as the module says; any status is an answer (the caller maps it).
        """
        ends_at = time.monotonic() + self.deadline
        connect = self.timeout
        if send_by is not None:
            left = send_by - time.monotonic()
            if left <= 0:
                raise SendDeadlinePassed(f"{method} {_shown(url)}", -left)
            connect = min(connect, left)
        timeout = urllib3.Timeout(connect=connect, read=self.timeout, total=self.deadline)
        _SEND_BOUND.at, _SEND_BOUND.what = send_by, f"{method} {_shown(url)}"
        try:
            response = self._http.request(
                method, url, body=body, headers=dict(headers or {}), preload_content=False,
                timeout=timeout, redirect=False,
            )
        except (urllib3.exceptions.NewConnectionError,
                urllib3.exceptions.ConnectTimeoutError) as exc:
            raise HttpUnreachable(f"no connection to {_shown(url)}: {type(exc).__name__}"
                                  ) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise HttpNoAnswer(
                f"{method} {_shown(url)} was sent and got no answer: {type(exc).__name__}"
            ) from exc
        finally:
            _SEND_BOUND.at = None
        try:
            data, truncated = self._read(response, ends_at)
        except (urllib3.exceptions.HTTPError, OSError, _DeadlinePassed) as exc:
            response.close()
            raise HttpNoAnswer(
                f"{method} {_shown(url)} answered {response.status} but its body did not come "
                f"within the {self.deadline:g}s deadline: {type(exc).__name__}"
            ) from exc
        if truncated:
            response.close()  # the rest stays unread: this connection cannot be reused
        else:
            response.release_conn()
        names = {name.lower(): value for name, value in response.headers.items()}
        return HttpAnswer(response.status, names, data, truncated)

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
        self._http.clear()


def _shown(url: str) -> str:
    """A URL as errors name it: scheme, host and path; the query (tokens) left out."""
    return url.split("?", 1)[0][:200]


__all__ = [
    "DEFAULT_MAX_BODY",
    "BoundedHttp",
    "HttpAnswer",
    "HttpNoAnswer",
    "HttpUnreachable",
    "retry_after",
]
