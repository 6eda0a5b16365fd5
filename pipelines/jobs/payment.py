"""``charge_payment``: charge an order once, even when workers die between charge and record,
stall past their lease, or the provider ignores idempotency keys and answers late or never.

Key ``payment:{order_id}``. The order row is locked in each short transaction (``FOR UPDATE`` on
Postgres, ``BEGIN IMMEDIATE`` on SQLite); the idempotency claim serialises whole attempts, and
every business write is fenced with the claim's fence, so a stale holder cannot overwrite a newer
one. The gateway call happens outside any transaction, carrying the idempotency key.

The payment reference is derived from the key (:func:`reference_for`), so every attempt of one
intent charges under the same reference: when the gateway ignores keys (or the client does not
send them), a retry or a takeover first looks the charge up by reference and only charges if
none exists.

Two rules make that lookup trustworthy:

1. **The send is written down before it goes out.** Right before the POST the order becomes
   ``charged_not_confirmed`` with no ``charge_id`` and ``charge_sent_at`` (the claim gets the
   checkpoint ``charge_sent`` in the same transaction), and the lease is confirmed in the store
   (:meth:`JobContext.confirm_lease`). A holder frozen before that point and taken over is
   refused there (fence, owner token) and charges nothing. The confirmation gives a send bound
   the client checks right before writing the request: a holder frozen after it sends nothing
   once the bound passed, re-confirms, and stops with ``LeaseLost`` if taken over.
2. **An unknown outcome is never charged blind.** When no answer came (a timeout, a reset or
   the deadline after the request was sent; the worker died mid-call), a slow provider may
   still commit the charge, and a lookup now would miss it. Until ``charge_sent_at`` plus the
   settle window (``Services.settle_seconds``, longer than 0.4 of a lease plus the provider's
   longest processing time: the send bound is capped at ``charge_sent_at`` plus 0.4 of a
   lease, :meth:`JobContext.stamp_send`) has passed, every retry or redelivery raises
   :class:`PaymentNotSettled` (transient, ``retry_after`` = the time left). After it, a
   lookup is conclusive: a charge found is recorded; none found means nothing was charged, and
   the job charges again, once (its new send is written down first). Reconciliation resolves
   the same state the same way when nothing retries the job.

An answer that says the charge did not happen (a refusal, 503, 429, 409, no connection) puts the
order back to ``payment_pending`` (or ``payment_failed`` for a 4xx refusal) at once.

Payment states (``orders.payment_status``), written here beside their transitions::

    (absent) ------------------------ claim ----------------------> payment_pending
    payment_pending / payment_failed -- about to send (+ checkpoint) -> charged_not_confirmed
                                                                      (charge_id NULL, sent_at)
    charged_not_confirmed (no id) --- gateway answered a charge ---> charged_not_confirmed (id)
    charged_not_confirmed (no id) --- answer: not charged (503..) -> payment_pending
    charged_not_confirmed (no id) --- gateway refused (4xx) -------> payment_failed
    charged_not_confirmed (no id) --- settled, lookup finds it ----> charged_not_confirmed (id)
    charged_not_confirmed (no id) --- settled, lookup finds none --> (sends again, new sent_at)
    charged_not_confirmed (id) ------ confirm + complete ----------> paid  (one transaction)

A timeline of the crash this design survives (``SEKALI_CRASH_AT=after_charge``)::

    t=0   attempt 1 claims payment:o1 (fence 1), order -> payment_pending
    t=1   it records the send (sent_at=1); the gateway charges ch_1 under reference ord-<hash>;
          the worker is SIGKILLed
    t=3   the lease expires; attempt 2 claims (fence 2, takeover); the send at t=1 is not yet
          settled: PaymentNotSettled, retry after the window
    t=1+W attempt 3 looks up reference ord-<hash>, finds ch_1, records it: no second charge;
          charged_not_confirmed -> paid and the key completes in one transaction

And the slow provider (keys ignored): attempt 1 sends at t=0, times out at t=5 while the provider
still works; the provider commits ch_1 at t=30; any retry before t=W is told to wait; at t=W
(W > 0.4 of a lease + the provider's longest processing time) the lookup finds ch_1. One
charge.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text
from sqlalchemy.engine import Connection

from engine import (
    SEND_TRIES,
    Calls,
    ChaosCase,
    ChaosCount,
    ChaosProof,
    Check,
    Concurrency,
    Effect,
    FlowControl,
    JobContext,
    JobType,
    Keying,
    NaiveRun,
    Presentation,
    Queue,
    Reconciling,
    Running,
    Tally,
    Upkeep,
    fenced_update,
    formatted,
    require_int,
    require_str,
)
from engine.registry import get_job_type
from engine.upkeep.reconciliation import record_only
from pipelines.domain.payments import (
    GATEWAY,
    Charge,
    GatewayRejected,
    GatewayUnavailable,
    PaymentGateway,
)
from pipelines.domain.payments import reference_for as reference_for  # the job type's, too
from resources.errors import (
    NotYetSettled,
    PermanentJobError,
    RateLimited,
    RequestCancelled,
    SendDeadlinePassed,
    ValidationError,
    shown,
)
from resources.storage.db import Database

logger = logging.getLogger(__name__)

CHARGE_SENT = "charge_sent"  # recovery point: a charge went out at data["sent_at"]
CHARGED = "charged"  # recovery point: the gateway answered with data["charge_id"]
# an attempt's status before/after (job_attempts) while a send's outcome is unknown: the order is
# charged_not_confirmed without a charge_id
CHARGE_UNKNOWN = "charge_unknown"


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


class PaymentNotSettled(NotYetSettled):
    """A charge of this order went out and no answer came back; the provider may still commit
    it. Nothing charges again before ``settles_at``: retry then, when a lookup is conclusive."""

    def __init__(self, order_id: str, sent_at: float, settles_at: float, now: float,
                 cause: str = "") -> None:
        super().__init__(
            (f"{cause}; " if cause else "")
            + f"the charge of order {order_id!r} sent at {_iso(sent_at)} may have happened; it "
            f"is looked up, never charged again blind, from {_iso(settles_at)} "
            f"(retry in {max(0.0, settles_at - now):.1f}s)",
            settles_at=settles_at,
            retry_after=max(0.0, settles_at - now),
        )
        self.order_id = order_id
        self.sent_at = sent_at


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="milliseconds")


def _currency(payload: dict[str, Any], field_name: str) -> str:
    currency = payload.get(field_name)
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        raise ValidationError(
            field_name, f"must be a three-letter ISO code such as EUR, got {shown(currency)}",
            currency,
        )
    return currency.upper()


class ChargeRequest(BaseModel):
    """What charging an order takes: the key is ``payment:{order_id}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"order_id": "o-example-1", "amount_cents": 1250, "currency": "EUR"},
    ]})

    order_id: Annotated[str, Check(require_str), Field(
        description="The order to charge; the key is payment:{order_id}.")]
    amount_cents: Annotated[int, Check(require_int, maximum=10**9), Field(
        description="The amount in cents, 1 to 10^9.")]
    currency: Annotated[str, Check(_currency), Field(description="A three-letter ISO code.")] = (
        "EUR"
    )


def charge_effect(charge: Charge) -> Effect:
    """A gateway charge as the lookup reports it: the charge id, when, and what it was."""
    return Effect(
        charge.charge_id, charge.created_at,
        {"reference": charge.reference, "amount_cents": charge.amount_cents,
         "currency": charge.currency},
    )


def lookup_charges(client: Callable[[str], Any], key: str, payload: Any) -> list[Effect]:
    """The charges the gateway holds under this intent's reference (:func:`reference_for`),
    oldest first. Raises :class:`GatewayUnavailable` when the gateway cannot answer."""
    gateway: PaymentGateway = client(GATEWAY.name)
    charges = sorted(gateway.find_charges(reference_for(key)),
                     key=lambda c: (c.created_at, c.charge_id))
    return [charge_effect(c) for c in charges]


def _charge_dict(charge: Charge) -> dict[str, Any]:
    return {"charge_id": charge.charge_id, "reference": charge.reference}


def _lookup(ctx: JobContext, gateway: PaymentGateway, order_id: str, reference: str
            ) -> Charge | None:
    """The order's charge at the gateway: under this key's reference, else under any other
    reference a send of this order went out under (:func:`sent_references`): a run of the same
    order under another key must find that charge, not make a second one."""
    with ctx.services.db.statement() as conn:
        others = [r for r in sent_references(conn, order_id) if r != reference]
    found: list[Charge] = []
    with ctx.timed("gateway_lookup"):
        for ref in (reference, *others):
            found = gateway.find_charges(ref)
            if found:
                break
    if len(found) > 1:
        logger.error("order %s has %d charges at the gateway", order_id, len(found))
    return found[0] if found else None


def sent(conn: Connection, order_id: str) -> list[tuple[str, str | None]]:
    """Every ``(reference, key)`` a charge of ``order_id`` went out under, oldest first (the
    owner's read of ``payment_references``; reconciliation asks under each)."""
    return [
        (r.reference, r.key)
        for r in conn.execute(
            text("SELECT reference, key FROM payment_references WHERE order_id = :o"
                 " ORDER BY first_sent_at, reference"),
            {"o": order_id},
        )
    ]


def sent_references(conn: Connection, order_id: str) -> list[str]:
    """Every reference a charge of ``order_id`` went out under, oldest first."""
    return [reference for reference, _ in sent(conn, order_id)]


def _set_payment(ctx: JobContext, order_id: str, name: str, assignments: str) -> None:
    with ctx.locked_row("orders", "order_id", order_id, name) as (conn, _):
        fenced_update(
            conn, "orders", "order_id", order_id, fence_column="payment_fence",
            fence=ctx.write_fence,
            assignments=f"{assignments}, updated_at = :now", params={"now": time.time()},
        )


def _send_charge(
    ctx: JobContext, gateway: PaymentGateway, p: ChargeRequest, reference: str
) -> Charge:
    """Write the send down, confirm the lease, charge within the send bound the confirmation
    gave. Raises :class:`PaymentNotSettled` when the outcome is unknown (the order keeps its
    ``charge_sent_at``).

    When the client refused to send because the bound passed (:class:`SendDeadlinePassed`:
    nothing left this process, so no outcome is unknown), the send is written down again
    (a new ``sent_at``) and the lease confirmed again: a holder taken over meanwhile stops
    there with :class:`LeaseLost` and the new owner's lookup after the settle window is still
    conclusive, because this holder never sent."""
    order_id = p.order_id
    ctx.crash_point("before_charge")
    with ctx.concurrency_slot(JOB_TYPE):
        for tries_left in range(SEND_TRIES - 1, -1, -1):
            sent_at = ctx.stamp_send()
            with ctx.locked_row("orders", "order_id", order_id, "record_send") as (conn, _):
                fenced_update(
                    conn, "orders", "order_id", order_id, fence_column="payment_fence",
                    fence=ctx.write_fence,
                    assignments="payment_status = 'charged_not_confirmed', charge_id = NULL,"
                    " charge_sent_at = :sent, updated_at = :sent",
                    params={"sent": sent_at},
                )
                ctx.checkpoint(CHARGE_SENT, {"reference": reference, "sent_at": sent_at},
                               conn=conn)
                conn.execute(
                    text(
                        "INSERT INTO payment_references (order_id, reference, key,"
                        " first_sent_at) VALUES (:o, :ref, :key, :sent) ON CONFLICT DO NOTHING"
                    ),
                    {"o": order_id, "ref": reference, "key": ctx.key, "sent": sent_at},
                )
            try:
                send_by = ctx.confirm_lease()
            except RequestCancelled:  # cancelled before the send: nothing left, take it back
                _set_payment(ctx, order_id, "record_not_charged",
                             "payment_status = 'payment_pending', charge_sent_at = NULL")
                raise
            try:
                with ctx.timed("gateway_charge"):
                    return gateway.charge(
                        reference=reference,
                        amount_cents=p.amount_cents,
                        currency=p.currency,
                        idempotency_key=ctx.key,
                        correlation_id=ctx.correlation_id,
                        send_by=send_by,
                    )
            except SendDeadlinePassed as exc:
                if tries_left:
                    logger.warning("%s: %s; confirming the lease again", ctx.key, exc)
                    continue
                _set_payment(ctx, order_id, "record_not_charged",
                             "payment_status = 'payment_pending', charge_sent_at = NULL")
                raise
            except (GatewayRejected, ValidationError):  # refused, or by the client before a byte
                _set_payment(ctx, order_id, "record_failure",
                             "payment_status = 'payment_failed', charge_sent_at = NULL")
                ctx.attempt.status_after = str(PaymentStatus.FAILED)
                raise
            except RateLimited:  # our own pacing refused the call before anything was sent
                _set_payment(ctx, order_id, "record_not_charged",
                             "payment_status = 'payment_pending', charge_sent_at = NULL")
                raise
            except GatewayUnavailable as exc:
                if exc.maybe_charged:
                    ctx.attempt.status_after = CHARGE_UNKNOWN
                    settles_at = sent_at + ctx.services.settle_seconds
                    raise PaymentNotSettled(
                        order_id, sent_at, settles_at, time.time(), str(exc)
                    ) from exc
                _set_payment(ctx, order_id, "record_not_charged",
                             "payment_status = 'payment_pending', charge_sent_at = NULL")
                raise
    raise AssertionError("the last try returns or raises")


def charge_payment(ctx: JobContext, p: ChargeRequest) -> dict[str, Any]:
    services = ctx.services
    gateway: PaymentGateway = ctx.client(GATEWAY.name)
    order_id = p.order_id
    reference = reference_for(ctx.key)
    now = time.time()
    charge_id: str | None = None
    sent_at: float | None = None

    with ctx.locked_row("orders", "order_id", order_id, "lock_order") as (conn, row):
        if row is None:
            conn.execute(
                text(
                    "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                    " payment_reference, payment_fence, created_at, updated_at)"
                    " VALUES (:o, :a, :c, 'payment_pending', :ref, :f, :now, :now)"
                ),
                {"o": order_id, "a": p.amount_cents, "c": p.currency, "ref": reference,
                 "f": ctx.fence, "now": now},
            )
            status = PaymentStatus.PENDING
            ctx.attempt.status_before = "absent"
        else:
            status = PaymentStatus(row.payment_status)
            ctx.attempt.status_before = str(status)
            if row.amount_cents is not None and (
                row.amount_cents != p.amount_cents or row.currency != p.currency
            ):
                raise OrderAmountMismatch(
                    order_id,
                    f"{row.amount_cents} {row.currency}",
                    f"{p.amount_cents} {p.currency}",
                )
            if status is PaymentStatus.PAID:
                result = {"order_id": order_id, "charge_id": row.charge_id,
                          "reference": reference, "status": "paid"}
                ctx.complete(result, conn=conn)
                ctx.attempt.status_after = str(status)
                return result
            fenced_update(
                conn, "orders", "order_id", order_id, fence_column="payment_fence",
                fence=ctx.write_fence,
                assignments="amount_cents = :a, currency = :c, payment_reference = :ref,"
                " updated_at = :now",
                params={"a": p.amount_cents, "c": p.currency, "ref": reference, "now": now},
            )
            charge_id = row.charge_id
            if status is PaymentStatus.CHARGED_NOT_CONFIRMED and charge_id is None:
                sent_at = float(row.charge_sent_at or row.updated_at)
                ctx.attempt.status_before = CHARGE_UNKNOWN

    if charge_id is None:
        charge = None
        if sent_at is not None:  # an earlier send's outcome is unknown
            settles_at = sent_at + services.settle_seconds
            if time.time() < settles_at:
                ctx.attempt.status_after = CHARGE_UNKNOWN
                raise PaymentNotSettled(order_id, sent_at, settles_at, time.time())
            charge = _lookup(ctx, gateway, order_id, reference)
        elif ctx.claim.attempt > 1 or ctx.claim.takeover or JOB_TYPE.looks_up_first():
            charge = _lookup(ctx, gateway, order_id, reference)
        if charge is None:
            charge = _send_charge(ctx, gateway, p, reference)
        ctx.crash_point("after_charge")
        ctx.check_lease()
        with ctx.locked_row("orders", "order_id", order_id, "record_charge") as (conn, _):
            fenced_update(
                conn, "orders", "order_id", order_id, fence_column="payment_fence",
                fence=ctx.write_fence,
                assignments="payment_status = 'charged_not_confirmed', charge_id = :ch,"
                " updated_at = :now",
                params={"ch": charge.charge_id, "now": time.time()},
            )
            ctx.checkpoint(CHARGED, _charge_dict(charge), conn=conn)
        charge_id = charge.charge_id
        ctx.crash_point("after_record_charge")

    result = {"order_id": order_id, "charge_id": charge_id, "reference": reference,
              "status": "paid"}
    with ctx.locked_row("orders", "order_id", order_id, "confirm") as (conn, _):
        fenced_update(
            conn, "orders", "order_id", order_id, fence_column="payment_fence",
            fence=ctx.write_fence,
            assignments="payment_status = 'paid', updated_at = :now",
            params={"now": time.time()},
        )
        ctx.complete(result, conn=conn)
    ctx.attempt.status_after = str(PaymentStatus.PAID)
    return result


def reconcile_payments(rec: Reconciling, report: Tally) -> None:
    """The payment checks, for orders changed between ``lookback`` and ``grace`` ago, each
    charge looked up at the gateway by each reference of the order:

    - ``charged_not_confirmed``: the gateway has a charge for an order we still show unpaid
      (the worker died between charge and record). Fix: confirm it
      (``reconcile:confirm-charge:{o}``). Also a charge whose answer never came
      (``charged_not_confirmed`` without a ``charge_id``) that the gateway still does not know
      once ``charge_sent_at`` is past the settle window (longer than 0.4 of a lease plus the
      provider's longest processing time, so "not found" is conclusive): nothing was charged,
      and the order is reopened (``payment_pending``) so a retry or replay charges it, once per
      unanswered send
      (``reconcile:reopen-unsettled:{o}:{sent_at}``).
    - ``double_charged``: more than one charge for one order, under its reference or any other
      reference a charge of it went out under (``payment_references``: a run under another key
      of the same order). Fix: a refund is marked pending for each extra charge
      (``compensate:refund-pending:{o}:{charge}``).
    - ``paid_without_charge``: we show paid, the gateway has no such charge. Flagged for a
      person (``reconcile:flag-paid-without-charge:{o}``).

    Skipped when the run has no gateway client."""
    gateway = rec.client(GATEWAY.name)
    if gateway is None:
        return  # nothing to look charges up at
    now = rec.clock()
    with rec.db.statement() as conn:
        orders = conn.execute(
            text(
                "SELECT order_id, payment_status, payment_reference, charge_id,"
                " charge_sent_at FROM orders"
                " WHERE payment_reference IS NOT NULL AND updated_at <= :settled"
                " AND updated_at >= :since ORDER BY order_id"
            ),
            {"settled": now - rec.grace, "since": now - rec.lookback},
        ).all()
    lookup = get_job_type(JOB_TYPE.name).effects  # as registered: a test may swap it
    for order in orders:
        with rec.db.statement() as conn:
            went_out = sent(conn, order.order_id)
        keyed = sorted({key for _, key in went_out if key is not None})
        references = {order.payment_reference, *(reference for reference, _ in went_out)}
        found: dict[str, Effect] = {}
        for key in keyed:
            found.update((e.reference, e) for e in lookup(rec.client, key, None))
        for ref in sorted(references - {reference_for(k) for k in keyed}):
            found.update((c.charge_id, charge_effect(c)) for c in gateway.find_charges(ref))
        charges = sorted(found.values(), key=lambda e: (e.at or 0.0, e.reference))
        ids = [c.reference for c in charges]
        if order.payment_status in ("payment_pending", "charged_not_confirmed") and charges:
            report.found["charged_not_confirmed"] += 1
            first = charges[0].reference
            report.fixed["charged_not_confirmed"] += rec.act(
                report,
                f"reconcile:confirm-charge:{order.order_id}",
                "confirm_charge",
                order.order_id,
                functools.partial(_confirm, order_id=order.order_id, charge_id=first, now=now),
            )
        elif (
            order.payment_status == "charged_not_confirmed"
            and order.charge_id is None
            and order.charge_sent_at is not None
            and order.charge_sent_at <= now - rec.settle
        ):
            report.found["charged_not_confirmed"] += 1
            report.fixed["charged_not_confirmed"] += rec.act(
                report,
                f"reconcile:reopen-unsettled:{order.order_id}:{order.charge_sent_at!r}",
                "reopen_unsettled_charge",
                order.order_id,
                functools.partial(
                    _reopen, order_id=order.order_id, sent_at=order.charge_sent_at, now=now
                ),
            )
        if order.payment_status == "paid" and order.charge_id not in ids:
            key = f"reconcile:flag-paid-without-charge:{order.order_id}"
            if not rec.done(key):
                report.found["paid_without_charge"] += 1
                report.fixed["paid_without_charge"] += rec.act(
                    report,
                    key,
                    "paid_without_charge",
                    order.order_id,
                    record_only({"charge_id": order.charge_id, "gateway": ids}),
                )
        kept = order.charge_id if order.charge_id in ids else (ids[0] if ids else None)
        for extra in [i for i in ids if i != kept]:
            key = f"compensate:refund-pending:{order.order_id}:{extra}"
            if rec.done(key):
                continue
            report.found["double_charged"] += 1
            report.fixed["double_charged"] += rec.act(
                report,
                key,
                "refund_pending",
                order.order_id,
                record_only({"refund_charge_id": extra, "kept_charge_id": kept}),
            )


def _reopen(conn: Connection, *, order_id: str, sent_at: float, now: float) -> dict[str, Any]:
    """Back to ``payment_pending`` only if the order still waits on that very send: a job that
    resolved it, or sent again (a new ``charge_sent_at``), meanwhile wins."""
    reopened = conn.execute(
        text(
            "UPDATE orders SET payment_status = 'payment_pending', charge_sent_at = NULL,"
            " updated_at = :now WHERE order_id = :o AND payment_status = 'charged_not_confirmed'"
            " AND charge_id IS NULL AND charge_sent_at = :sent"
        ),
        {"o": order_id, "sent": sent_at, "now": now},
    ).rowcount
    return {"charge_sent_at": sent_at, "not_found_after_settle": True, "reopened": reopened == 1}


def _confirm(conn: Connection, *, order_id: str, charge_id: str, now: float) -> dict[str, Any]:
    conn.execute(
        text(
            "UPDATE orders SET payment_status = 'paid', charge_id = :c, updated_at = :now"
            " WHERE order_id = :o AND payment_status IN ('payment_pending',"
            " 'charged_not_confirmed')"
        ),
        {"c": charge_id, "o": order_id, "now": now},
    )
    return {"charge_id": charge_id}


WATCHES = (
    "EXISTS (SELECT 1 FROM orders o WHERE o.order_id = reconciliation_actions.subject"
    " AND o.updated_at >= :watched_since)"
)
"""A payment check reads orders changed within the lookback: their actions stay that long."""


# -- what the chaos proof needs (engine.chaos) ------------------------------------------------


def _chaos_sample(i: int, poison: bool) -> dict[str, Any]:
    """Request ``i`` of the chaos mix: an order of its own; poison charges a negative amount."""
    return {"order_id": f"o{i}", "amount_cents": -1 if poison else 100 + i, "currency": "EUR"}


def _naive_charge(run: NaiveRun, clean: dict[str, Any], key: str, correlation_id: str) -> None:
    run.client(GATEWAY.name).charge(
        reference=reference_for(key), amount_cents=clean["amount_cents"],
        currency=clean["currency"], idempotency_key=None, correlation_id=correlation_id,
    )


@dataclass(frozen=True)
class _Orders:
    fences: dict[str, int]  # order -> the payment fence on its row
    refunds: Counter[str]  # order -> extra charges reconciliation marked for a refund


def _gather_orders(db: Database) -> _Orders:
    with db.statement() as conn:
        fences = {str(r.order_id): int(r.payment_fence) for r in conn.execute(
            text("SELECT order_id, payment_fence FROM orders"))}
        refunds = Counter(str(r.subject) for r in conn.execute(text(
            "SELECT subject FROM reconciliation_actions WHERE kind = 'refund_pending'")))
    return _Orders(fences, refunds)


def _count_charges(orders: _Orders, case: ChaosCase) -> ChaosCount:
    """Each charge the gateway took for the request is an effect; a second one is never
    excused, and counted as refund-marked once reconciliation marked it."""
    effects = len(case.arrivals)
    if effects <= 1:
        return ChaosCount(effects)
    marked = min(effects - 1, orders.refunds[str(case.payload["order_id"])])
    return ChaosCount(effects, stats={"double_charges_refund_marked": marked})


def _order_fenced(orders: _Orders, payload: Mapping[str, Any], fence: int) -> str | None:
    found = orders.fences.get(payload["order_id"])
    return None if found == fence else f"order fence {found} != {fence}"


CHAOS = ChaosProof(
    mix=(0.0, 0.7), sample=_chaos_sample, naive=_naive_charge,
    effect_calls=("charge",), lookup_calls=("find_charges",), after_effect=("after_charge",),
    gather=_gather_orders, count=_count_charges, fenced=_order_fenced,
)
"""Most of the chaos mix: a charge per order, judged by the gateway's own charges."""


JOB_TYPE = JobType(
    name="charge_payment",
    queue=Queue.HEAVY,
    payload=ChargeRequest,
    handler=charge_payment,
    side_effect=True,
    keying=Keying(key_for=formatted("payment:{order_id}"), resource_id=formatted("{order_id}")),
    running=Running(max_runtime_seconds=300),
    calls=Calls(clients=(GATEWAY,), lookup=lookup_charges),
    # no customer in the payload; an order's versions share it
    flow=FlowControl(concurrency=Concurrency("order:{order_id}", limit=1)),
    upkeep=Upkeep(
        checks=("charged_not_confirmed", "double_charged", "paid_without_charge"),
        reconcile=reconcile_payments,
        watches=(WATCHES,),
        unique=(("orders", ("charge_id",)),),
        chaos=CHAOS,
    ),
    presentation=Presentation(
        description="Charge an order once at the payment gateway (key payment:{order_id}).",
        result_fields=("charge_id", "reference"),
    ),
)
