"""The payment downstream as sekali sees it: a small interface, an HTTP client, its errors.

Job types talk to :class:`PaymentGateway` only, so a user swaps the sandbox gateway for their
provider by writing one class. The HTTP client speaks the sandbox's protocol (Stripe-like):
``POST /charges`` with an ``Idempotency-Key`` header, ``GET /charges?reference=R``, through
:class:`resources.http.BoundedHttp` (the one bounded HTTP read: timeouts, deadline, size cap).

Error mapping (one place):

- timeouts, connection errors, resets, the deadline passed, 5xx, 409 (the same key is being
  processed), 429 -> :class:`GatewayUnavailable` (transient; ``retry_after`` from the
  ``Retry-After`` header, delta seconds or an HTTP date); so is an answer over ``max_answer``
  bytes. ``maybe_charged`` is True when a POST may have reached the gateway (the connection
  broke after sending, a read timed out, the deadline passed while waiting or reading, an
  answer too large or not JSON, or 500, 502 or 504, which a provider or its proxy may send
  after the charge): the charge may have happened. With the gateway's key support on, retrying
  with the same key is safe; without it, nothing may charge again until a lookup by reference
  is conclusive (see ``pipelines/jobs/payment.py``).
- other 4xx -> :class:`GatewayRejected` (permanent: fix the request, never retry it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlencode, urlsplit

from engine import ClientOptions, Downstream, Effect, Sandbox
from engine.health.diagnosis import EffectLedger
from resources.errors import PermanentJobError, TransientJobError
from resources.headers import http_header_value
from resources.http import BoundedHttp, HttpNoAnswer, HttpUnreachable, retry_after
from resources.storage.db import shared_database
from resources.storage.files import write_private
from resources.storage.settings import Settings
from sandbox.gateway import ADMIN_TOKEN_FILE, GatewayServer

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


_MAYBE_CHARGED_STATUSES = frozenset({500, 502, 504})

MAX_ANSWER = 1024 * 1024
"""Bytes of an answer the client reads at most: a charge is a few hundred, a reference's list of
charges a few KiB; anything bigger is a broken or hostile provider, not data to hold in memory."""


class HttpPaymentGateway:
    """:class:`PaymentGateway` over HTTP through :class:`resources.http.BoundedHttp` (pooled,
    thread-safe, urllib3's own retries off: the retry policy lives in :mod:`resources.retry`,
    which knows the error class, the attempt count and the shared budget).
    ``send_idempotency_key=False`` simulates a provider without key support (every POST
    charges).

    Time bounds (BoundedHttp's): ``timeout`` bounds connecting and each read; ``deadline``
    bounds the whole call, the body read a piece at a time with each read's socket timeout cut
    to what is left, so a provider that answers a byte at a time cannot hold a job past it: the
    call ends at most ``deadline`` (plus scheduling slack) after it began, with
    :class:`GatewayUnavailable`. The status line and headers, read by urllib3 itself, are
    bounded per read by ``timeout``.

    Size bound: an answer over ``max_answer`` bytes is dropped with its connection after at most
    ``max_answer + 1`` bytes were read, and raises :class:`GatewayUnavailable` (``maybe_charged``
    for a POST: the provider answered something), so memory per call stays bounded whatever the
    provider sends.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        deadline: float = 15.0,
        send_idempotency_key: bool = True,
        pool_maxsize: int = 16,
        max_answer: int = MAX_ANSWER,
    ) -> None:
        self._http = BoundedHttp(timeout=timeout, deadline=deadline, max_body=max_answer,
                                 pool_maxsize=pool_maxsize)
        self.max_answer = max_answer
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.deadline = deadline
        self.send_idempotency_key = send_idempotency_key

    def _request(
        self, method: str, path: str, *, body: Any = None, headers: dict[str, str] | None = None,
        send_by: float | None = None,
    ) -> Any:
        """The answer's JSON, or the error the module maps it to. ``send_by``: BoundedHttp
        writes no byte of the request after it (see :meth:`charge`)."""
        all_headers = {"Accept": "application/json", **(headers or {})}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        try:
            answer = self._http.request(method, self.base_url + path, body=payload,
                                        headers=all_headers, send_by=send_by)
        except HttpUnreachable as exc:  # nothing was sent: nothing can have been charged
            raise GatewayUnavailable(f"payment gateway unreachable: {exc}") from exc
        except HttpNoAnswer as exc:  # sent, no whole answer: the outcome is unknown
            raise GatewayUnavailable(
                f"payment gateway gave no answer to {method} {path}: {exc}",
                maybe_charged=method == "POST",
            ) from exc
        status = answer.status
        if answer.truncated:
            raise GatewayUnavailable(
                f"payment gateway answered {method} {path} with a body over "
                f"{self.max_answer} bytes",
                status=status,
                maybe_charged=method == "POST",
            )
        if status >= 500 or status in (409, 429):
            raise GatewayUnavailable(
                f"payment gateway answered {status} to {method} {path}",
                status=status,
                retry_after=retry_after(answer.header("Retry-After"), time.time()),
                maybe_charged=method == "POST" and status in _MAYBE_CHARGED_STATUSES,
            )
        if status >= 400:
            raise GatewayRejected(status, answer.body.decode(errors="replace")[:500])
        try:
            return json.loads(answer.body)
        except ValueError as exc:
            raise GatewayUnavailable(
                f"payment gateway sent a body that is not JSON ({status})",
                status=status,
                maybe_charged=method == "POST",
            ) from exc

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

        :class:`resources.http.BoundedHttp` checks the bound right before urllib3 is handed the
        request and again right before each write to the socket, and a connection urllib3 opens
        for it gets a connect timeout cut to what is left of the bound (a connect timeout is not
        charged: :class:`GatewayUnavailable` without ``maybe_charged``). So the request's bytes
        leave before ``send_by``, unless this process is paused between the last check and its
        ``sendall`` (a few instructions), the one window left.
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
        self._http.close()


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
    """The sandbox gateway of ``sekali dev``; its admin token is left, 0600, in the state
    folder for the developer's own tools."""
    host, port, _ = _address(settings)
    server = GatewayServer(f"sqlite:///{state / 'gateway.db'}", host=host, port=port).start()
    write_private(state / ADMIN_TOKEN_FILE, server.admin_token + "\n")
    return server


def reference_for(key: str) -> str:
    """The gateway reference of an intent: the same for every attempt of one key."""
    return "ord-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _recorded_charges(server: GatewayServer, key: str, payload: Any) -> list[Effect]:
    """The sandbox gateway's own rows for the intent's reference, each a charge it took, with
    the time it committed it (its ``created_at``)."""
    return [Effect(str(c["charge_id"]), float(c["created_at"]), {"reference": c["reference"]})
            for c in server.ledger.by_reference(reference_for(key))]


GATEWAY = Downstream(
    name="payment_gateway",
    build=_client,
    description="The payment provider (SEKALI_GATEWAY_URL): charges, and lookups by reference.",
    calls=("charge", "find_charges"),
    sandbox=Sandbox("sandbox gateway", _address, _start_sandbox, record=_recorded_charges),
    dedupes=True,
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
