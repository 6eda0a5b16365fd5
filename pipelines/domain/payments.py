"""The payment downstream as sekali sees it: a small interface, an HTTP client, its errors.

Job types talk to :class:`PaymentGateway` only, so a user swaps the sandbox gateway for their
provider by writing one class. The HTTP client speaks the sandbox's protocol (Stripe-like):
``POST /charges`` with an ``Idempotency-Key`` header, ``GET /charges?reference=R``.

Error mapping (one place):

- timeouts, connection errors, resets, the deadline passed, 5xx, 409 (the same key is being
  processed), 429 -> :class:`GatewayUnavailable` (transient; ``retry_after`` from the
  ``Retry-After`` header). ``maybe_charged`` is True when a POST may have reached the gateway
  (the connection broke after sending, a read timed out, the deadline passed while waiting or
  reading, a body that is not JSON, or 500, 502 or 504, which a provider or its proxy may send
  after the charge): the charge may have happened. With the gateway's key support on, retrying
  with the same key is safe; without it, nothing may charge again until a lookup by reference
  is conclusive (see ``pipelines/jobs/payment.py``).
- other 4xx -> :class:`GatewayRejected` (permanent: fix the request, never retry it).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlencode, urlsplit

import urllib3

from engine import ClientOptions, Downstream, Sandbox
from engine.health.diagnosis import EffectLedger
from resources.errors import PermanentJobError, SendDeadlinePassed, TransientJobError
from resources.headers import http_header_value
from resources.storage.db import shared_database
from resources.storage.settings import Settings
from sandbox.gateway import GatewayServer

log = logging.getLogger(__name__)


class GatewayUnavailable(TransientJobError):
    """The gateway did not answer usefully (timeout, reset, 5xx, 409, 429). Retry with backoff.

    ``maybe_charged`` says the charge may have happened although no answer came: retry only with
    the same idempotency key, or look the charge up by reference before charging again.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        maybe_charged: bool = False,
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status
        self.maybe_charged = maybe_charged


class GatewayRejected(PermanentJobError):
    """The gateway refused the request (4xx): retrying the same request cannot help.

    Fix the payload (or the key reused with another body, 422) and replay from the DLQ.
    """

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"payment gateway rejected the request with {status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Charge:
    """One charge as the gateway recorded it."""

    charge_id: str
    reference: str
    amount_cents: int
    currency: str
    idempotency_key: str | None
    created_at: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Charge:
        return cls(
            charge_id=str(data["charge_id"]),
            reference=str(data["reference"]),
            amount_cents=int(data["amount_cents"]),
            currency=str(data["currency"]),
            idempotency_key=data.get("idempotency_key"),
            created_at=float(data["created_at"]),
        )


@runtime_checkable
class PaymentGateway(Protocol):
    """What a job type needs from a payment provider."""

    def charge(
        self,
        *,
        reference: str,
        amount_cents: int,
        currency: str,
        idempotency_key: str | None,
        correlation_id: str | None = None,
        send_by: float | None = None,
    ) -> Charge:
        """Charge once per ``idempotency_key`` (when the provider honours keys).

        ``send_by`` (``time.monotonic()`` scale): write no byte of the request after it; once it
        has passed, raise :class:`SendDeadlinePassed` (nothing sent) instead."""
        ...

    def find_charges(self, reference: str) -> list[Charge]:
        """Every charge recorded for ``reference`` (the business reference, e.g. an order id)."""
        ...


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # HTTP-date form: not used by the sandbox; fall back to our own backoff


_MAYBE_CHARGED_STATUSES = frozenset({500, 502, 504})


class _DeadlinePassed(Exception):  # noqa: N818 - internal signal, mapped to GatewayUnavailable
    pass


class HttpPaymentGateway:
    """:class:`PaymentGateway` over HTTP with a pooled, thread-safe urllib3 client.

    urllib3's own retries are off: the retry policy lives in :mod:`resources.retry`, which knows
    the error class, the attempt count and the shared budget. ``send_idempotency_key=False``
    simulates a provider without key support (every POST charges).

    Time bounds: ``timeout`` bounds connecting and each read; ``deadline`` bounds the whole call,
    so a provider that answers a byte at a time cannot hold a job past it. Connecting and
    waiting for the answer to start fall under urllib3's ``Timeout(total=deadline)``; the body
    is read a piece at a time, each read's socket timeout cut to what is left of the deadline,
    so a call ends at most ``deadline`` (plus scheduling slack) after it began, with
    :class:`GatewayUnavailable`. The one part urllib3 reads itself, the status line and headers,
    is bounded per read by ``timeout`` and in total only by the provider sending them (a few
    hundred bytes).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        deadline: float = 15.0,
        send_idempotency_key: bool = True,
        pool_maxsize: int = 16,
    ) -> None:
        if timeout <= 0 or deadline <= 0:
            raise ValueError("timeout and deadline must be positive seconds")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.deadline = deadline
        self.send_idempotency_key = send_idempotency_key
        self._timeouts = urllib3.Timeout(
            connect=min(timeout, deadline), read=min(timeout, deadline), total=deadline
        )
        self._http = urllib3.PoolManager(
            maxsize=pool_maxsize, block=False, retries=False, timeout=self._timeouts
        )

    def _request(
        self, method: str, path: str, *, body: Any = None, headers: dict[str, str] | None = None,
        send_by: float | None = None,
    ) -> Any:
        url = self.base_url + path
        ends_at = time.monotonic() + self.deadline
        all_headers = {"Accept": "application/json", **(headers or {})}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        timeout = self._timeouts
        if send_by is not None:
            # The last check before urllib3 writes the request; a new connection must be up
            # before the bound too, so no byte leaves after send_by (see :meth:`charge`).
            left = send_by - time.monotonic()
            if left <= 0:
                raise SendDeadlinePassed(f"{method} {path}", -left)
            timeout = urllib3.Timeout(
                connect=min(self.timeout, self.deadline, left),
                read=min(self.timeout, self.deadline),
                total=self.deadline,
            )
        try:
            response = self._http.request(
                method, url, body=payload, headers=all_headers, preload_content=False,
                timeout=timeout,
            )
        except urllib3.exceptions.NewConnectionError as exc:
            raise GatewayUnavailable(f"payment gateway unreachable at {url}: {exc}") from exc
        except urllib3.exceptions.ConnectTimeoutError as exc:
            raise GatewayUnavailable(f"payment gateway connect timeout at {url}") from exc
        except urllib3.exceptions.HTTPError as exc:
            # Read timeout, reset or close after the request was sent: the outcome is unknown.
            raise GatewayUnavailable(
                f"payment gateway gave no answer to {method} {path}: {exc!r}",
                maybe_charged=method == "POST",
            ) from exc
        try:
            data = self._read_body(response, ends_at)
        except (urllib3.exceptions.HTTPError, OSError, _DeadlinePassed) as exc:
            response.close()
            raise GatewayUnavailable(
                f"payment gateway gave no answer to {method} {path} within its "
                f"{self.deadline:g}s deadline: {exc!r}",
                maybe_charged=method == "POST",
            ) from exc
        finally:
            response.release_conn()
        status = response.status
        if status >= 500 or status in (409, 429):
            raise GatewayUnavailable(
                f"payment gateway answered {status} to {method} {path}",
                status=status,
                retry_after=_retry_after(response.headers),
                maybe_charged=method == "POST" and status in _MAYBE_CHARGED_STATUSES,
            )
        if status >= 400:
            raise GatewayRejected(status, data.decode(errors="replace")[:500])
        try:
            return json.loads(data)
        except ValueError as exc:
            raise GatewayUnavailable(
                f"payment gateway sent a body that is not JSON ({status})",
                status=status,
                maybe_charged=method == "POST",
            ) from exc

    def _read_body(self, response: urllib3.BaseHTTPResponse, ends_at: float) -> bytes:
        """The whole body, or :class:`_DeadlinePassed`: each read waits at most until
        ``ends_at``, so a body dripped a byte at a time cannot outlast the deadline."""
        sock = getattr(response.connection, "sock", None)
        chunks: list[bytes] = []
        while True:
            left = ends_at - time.monotonic()
            if left <= 0:
                raise _DeadlinePassed(f"{self.deadline:g}s passed while reading the answer")
            if sock is not None:
                sock.settimeout(min(self.timeout, left))
            chunk = response.read1(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def charge(
        self,
        *,
        reference: str,
        amount_cents: int,
        currency: str,
        idempotency_key: str | None,
        correlation_id: str | None = None,
        send_by: float | None = None,
    ) -> Charge:
        """POST the charge; with ``send_by``, refuse to write it once the bound passed.

        The idempotency key and the correlation id travel in headers, written by
        :func:`resources.headers.http_header_value` before anything is sent: a value outside
        printable ASCII is percent-encoded (the gateway decodes it), one with a control
        character is refused with :class:`ValidationError` naming the field, nothing sent.

        The bound is checked right before urllib3 is handed the request, and a connection
        urllib3 opens for it gets a connect timeout cut to what is left of the bound (a connect
        timeout is not charged: :class:`GatewayUnavailable` without ``maybe_charged``). So the
        request's bytes leave before ``send_by``, unless this process is paused between the
        check and the socket write (a few instructions inside urllib3), the one window left.
        """
        headers: dict[str, str] = {}
        if idempotency_key is not None and self.send_idempotency_key:
            headers["Idempotency-Key"] = http_header_value("idempotency_key", idempotency_key)
        if correlation_id is not None:
            headers["X-Correlation-Id"] = http_header_value("correlation_id", correlation_id)
        data = self._request(
            "POST",
            "/charges",
            body={"reference": reference, "amount_cents": amount_cents, "currency": currency},
            headers=headers,
            send_by=send_by,
        )
        charge = Charge.from_json(data)
        log.info(
            "charged %s %d %s as %s",
            reference,
            amount_cents,
            currency,
            charge.charge_id,
            extra={"idempotency_key": idempotency_key, "correlation_id": correlation_id},
        )
        return charge

    def find_charges(self, reference: str) -> list[Charge]:
        data = self._request("GET", "/charges?" + urlencode({"reference": reference}))
        return [Charge.from_json(item) for item in data["charges"]]

    def close(self) -> None:
        self._http.clear()


def _client(settings: Settings, options: ClientOptions) -> HttpPaymentGateway:
    return HttpPaymentGateway(
        options.address or settings.gateway_url,
        timeout=options.timeout or 5.0,
        deadline=options.deadline or 15.0,
        send_idempotency_key=bool(options.extra.get("send_idempotency_key", True)),
    )


def _address(settings: Settings) -> tuple[str, int, str]:
    parts = urlsplit(settings.gateway_url)
    return parts.hostname or "127.0.0.1", parts.port or 80, "SEKALI_GATEWAY_URL"


def _start_sandbox(settings: Settings, state: Path) -> GatewayServer:
    host, port, _ = _address(settings)
    return GatewayServer(f"sqlite:///{state / 'gateway.db'}", host=host, port=port).start()


GATEWAY = Downstream(
    name="payment_gateway",
    build=_client,
    description="The payment provider (SEKALI_GATEWAY_URL): charges, and lookups by reference.",
    calls=("charge", "find_charges"),
    sandbox=Sandbox("sandbox gateway", _address, _start_sandbox),
)
"""The payment downstream: ``ctx.client("payment_gateway")`` is a :class:`PaymentGateway`;
``SEKALI_RATE_PAYMENT_GATEWAY`` paces its calls; its retry budget is ``payment_gateway``."""


def charge_ledger(url: str) -> EffectLedger:
    """The gateway's own record of its charges (the sandbox's ``gateway_charges``) at ``url``:
    the doctor counts real duplicate charges there, one intent per reference."""
    return EffectLedger(
        "gateway_charges", shared_database(url), "gateway_charges",
        intent_column="reference", correlation_column="correlation_id",
        time_column="created_at",
    )
