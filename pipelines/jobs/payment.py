"""``charge_payment``: charge an order once, even when workers die between charge and record.

Key ``payment:{order_id}``. The order row is locked in each short transaction (``FOR UPDATE`` on
Postgres, ``BEGIN IMMEDIATE`` on SQLite); the idempotency claim serialises whole attempts, and
every business write is fenced with the claim's fence, so a stale holder cannot overwrite a newer
one. The gateway call happens outside any transaction, carrying the idempotency key.

The payment reference is derived from the key (:func:`reference_for`), so every attempt of one
intent charges under the same reference: when the gateway ignores keys (or the client does not
send them), a retry or a takeover first looks the charge up by reference and only charges if
none exists.

Payment states (``orders.payment_status``), written here beside their transitions::

    (absent) ---------------- claim ---------------> payment_pending
    payment_pending --- gateway answered a charge ---> charged_not_confirmed  (+ checkpoint)
    charged_not_confirmed --- confirm + complete ---> paid                    (one transaction)
    payment_pending --- gateway rejected (4xx) -----> payment_failed

A timeline of the crash this design survives (``SEKALI_CRASH_AT=after_charge``)::

    t=0   attempt 1 claims payment:o1 (fence 1), order -> payment_pending
    t=1   gateway charges ch_1 under reference ord-<hash>; the worker is SIGKILLed
    t=3   the lease expires; attempt 2 claims (fence 2, takeover)
    t=3   it looks up reference ord-<hash>, finds ch_1, records it: no second charge
    t=4   charged_not_confirmed -> paid and the key completes in one transaction
"""

from __future__ import annotations

import hashlib
import logging
import time
from enum import StrEnum
from typing import Any

from sqlalchemy import text

from pipelines.domain.payments import Charge, GatewayRejected
from pipelines.jobs.base import (
    JobContext,
    JobType,
    PayloadField,
    fenced_update,
    reject_unknown,
    require_int,
    require_str,
)
from resources.errors import PermanentJobError, ValidationError

logger = logging.getLogger(__name__)


class PaymentStatus(StrEnum):
    PENDING = "payment_pending"
    CHARGED_NOT_CONFIRMED = "charged_not_confirmed"
    PAID = "paid"
    FAILED = "payment_failed"


class OrderAmountMismatch(PermanentJobError):
    """The order already exists with another amount or currency: fix the request, then replay."""

    def __init__(self, order_id: str, stored: str, given: str) -> None:
        super().__init__(f"order {order_id!r} is {stored}, request says {given}; fix the request")
        self.order_id = order_id


def reference_for(key: str) -> str:
    """The gateway reference of an intent: the same for every attempt of one key."""
    return "ord-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def validate(payload: dict[str, Any]) -> dict[str, Any]:
    reject_unknown(payload, {"order_id", "amount_cents", "currency"})
    currency = payload.get("currency", "EUR")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        raise ValidationError("currency", "a three-letter ISO code such as EUR", currency)
    return {
        "order_id": require_str(payload, "order_id"),
        "amount_cents": require_int(payload, "amount_cents", maximum=10**9),
        "currency": currency.upper(),
    }


def key_for(payload: dict[str, Any]) -> str:
    return f"payment:{payload['order_id']}"


def _charge_dict(charge: Charge) -> dict[str, Any]:
    return {"charge_id": charge.charge_id, "reference": charge.reference}


def charge_payment(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    services = ctx.services
    gateway = services.gateway
    if gateway is None:
        raise RuntimeError("charge_payment needs a payment gateway (resource 'gateway')")
    order_id = p["order_id"]
    reference = reference_for(ctx.key)
    now = time.time()
    charge_id: str | None = None

    with ctx.locked_row("orders", "order_id", order_id, "lock_order") as (conn, row):
        if row is None:
            conn.execute(
                text(
                    "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                    " payment_reference, payment_fence, created_at, updated_at)"
                    " VALUES (:o, :a, :c, 'payment_pending', :ref, :f, :now, :now)"
                ),
                {"o": order_id, "a": p["amount_cents"], "c": p["currency"], "ref": reference,
                 "f": ctx.fence, "now": now},
            )
            status = PaymentStatus.PENDING
            ctx.attempt.status_before = "absent"
        else:
            status = PaymentStatus(row.payment_status)
            ctx.attempt.status_before = str(status)
            if row.amount_cents is not None and (
                row.amount_cents != p["amount_cents"] or row.currency != p["currency"]
            ):
                raise OrderAmountMismatch(
                    order_id,
                    f"{row.amount_cents} {row.currency}",
                    f"{p['amount_cents']} {p['currency']}",
                )
            if status is PaymentStatus.PAID:
                result = {"order_id": order_id, "charge_id": row.charge_id,
                          "reference": reference, "status": "paid"}
                ctx.complete(result, conn=conn)
                ctx.attempt.status_after = str(status)
                return result
            fenced_update(
                conn, "orders", "order_id", order_id, fence_column="payment_fence",
                fence=ctx.fence,
                assignments="amount_cents = :a, currency = :c, payment_reference = :ref,"
                " updated_at = :now",
                params={"a": p["amount_cents"], "c": p["currency"], "ref": reference, "now": now},
            )
            charge_id = row.charge_id

    if status is not PaymentStatus.CHARGED_NOT_CONFIRMED:
        charge = None
        if ctx.claim.attempt > 1 or ctx.claim.takeover:
            with ctx.timed("gateway_lookup"):
                found = gateway.find_charges(reference)
            if len(found) > 1:
                logger.error("reference %s has %d charges at the gateway", reference, len(found))
            charge = found[0] if found else None
        if charge is None:
            try:
                with ctx.concurrency_slot(JOB_TYPE), ctx.timed("gateway_charge"):
                    charge = gateway.charge(
                        reference=reference,
                        amount_cents=p["amount_cents"],
                        currency=p["currency"],
                        idempotency_key=ctx.key,
                        correlation_id=ctx.correlation_id,
                    )
            except GatewayRejected:
                with ctx.locked_row("orders", "order_id", order_id, "record_failure") as (c2, _):
                    fenced_update(
                        c2, "orders", "order_id", order_id, fence_column="payment_fence",
                        fence=ctx.fence,
                        assignments="payment_status = 'payment_failed', updated_at = :now",
                        params={"now": time.time()},
                    )
                ctx.attempt.status_after = str(PaymentStatus.FAILED)
                raise
        ctx.crash_point("after_charge")
        ctx.check_lease()
        with ctx.locked_row("orders", "order_id", order_id, "record_charge") as (conn, _):
            fenced_update(
                conn, "orders", "order_id", order_id, fence_column="payment_fence",
                fence=ctx.fence,
                assignments="payment_status = 'charged_not_confirmed', charge_id = :ch,"
                " updated_at = :now",
                params={"ch": charge.charge_id, "now": time.time()},
            )
            ctx.checkpoint("charged", _charge_dict(charge), conn=conn)
        charge_id = charge.charge_id
        ctx.crash_point("after_record_charge")

    result = {"order_id": order_id, "charge_id": charge_id, "reference": reference,
              "status": "paid"}
    with ctx.locked_row("orders", "order_id", order_id, "confirm") as (conn, _):
        fenced_update(
            conn, "orders", "order_id", order_id, fence_column="payment_fence", fence=ctx.fence,
            assignments="payment_status = 'paid', updated_at = :now",
            params={"now": time.time()},
        )
        ctx.complete(result, conn=conn)
    ctx.attempt.status_after = str(PaymentStatus.PAID)
    return result


JOB_TYPE = JobType(
    name="charge_payment",
    queue="heavy",
    validate=validate,
    key_for=key_for,
    max_runtime_seconds=300,
    side_effect=True,
    handler=charge_payment,
    resource_id=lambda p: str(p["order_id"]),
    lock="db-row",
    downstream="payment_gateway",
    description="Charge an order once at the payment gateway (key payment:{order_id}).",
    concurrency_key="order:{order_id}",  # no customer in the payload; an order's versions share it
    concurrency_limit=1,
    fields=(
        PayloadField("order_id", str, "The order to charge; the key is payment:{order_id}."),
        PayloadField("amount_cents", int, "The amount in cents, 1 to 10^9."),
        PayloadField(
            "currency", str, "A three-letter ISO code.", required=False, default="EUR"
        ),
    ),
    example={"order_id": "o-example-1", "amount_cents": 1250, "currency": "EUR"},
    result_fields=("charge_id", "reference"),
)
