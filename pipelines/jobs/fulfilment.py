"""``fulfill_order``: start, reserve, ship; resume from the last recovery point after a crash.

Key ``fulfil:{order_id}``. Each phase is one transaction that holds the order's row lock, makes
its effect, writes its outbox event (deterministic event ids, so a resumed phase emits nothing
twice) and records its recovery point with ``store.checkpoint(..., conn=conn)``: a crash leaves
a phase's effect and its recovery point both committed or both absent. A retry or takeover
starts after the last committed point. Every order write is fenced with the claim's fence.

Fulfilment states (``orders.fulfilment_status``), written here beside their transitions::

    new / needs_compensation --- start (outbox order.fulfilment_started) ---> processing
    processing --- reserve (cart order:{id}) --------------------------------> reserved
    reserved --- ship (shipments row, outbox order.shipped) + complete ------> fulfilled
    processing / reserved --- a phase failed permanently --------------------> needs_compensation

``needs_compensation`` is what reconciliation looks for: a failed fulfilment may hold
reservations that must be released (or be resumed by a replay of the same key). A transient
failure leaves the status alone: the key is ``retryable`` and the retry or replay resumes from
the recovery point and needs the reservations it holds. Compensation re-checks the key itself
(:func:`reconcile_fulfilments`), and ``Inventory.ship`` refuses released reservations, so a
resumed run never marks an order fulfilled without moving stock.
"""

from __future__ import annotations

import functools
import logging
import time
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text
from sqlalchemy.engine import Connection

from engine import (
    Check,
    JobContext,
    JobType,
    Keying,
    Presentation,
    Queue,
    Reconciling,
    Running,
    Tally,
    Upkeep,
    fenced_update,
    formatted,
    require_str,
)
from engine.upkeep.reconciliation import NotGivenUp, given_up, record_only
from pipelines.domain.inventory import Inventory, Items
from resources.errors import FencedWriteRejected, LeaseLost
from resources.locks import lock_row
from resources.outbox import write_event
from resources.retry import ErrorClass, classify

logger = logging.getLogger(__name__)


class FulfilmentStatus(StrEnum):
    NEW = "new"
    PROCESSING = "processing"
    RESERVED = "reserved"
    FULFILLED = "fulfilled"
    NEEDS_COMPENSATION = "needs_compensation"


STARTED, RESERVED = "started", "reserved"


class FulfilRequest(BaseModel):
    """An order and its items to fulfil: the key is ``fulfil:{order_id}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"order_id": "o-example-2", "items": [{"sku": "apple", "quantity": 1}]},
    ]})

    order_id: Annotated[str, Check(require_str), Field(
        description="The order to fulfil; the key is fulfil:{order_id}.")]
    items: Items


key_for = formatted("fulfil:{order_id}")


def cart_for(order_id: str) -> str:
    return f"order-{order_id}"


def _set_status(ctx: JobContext, conn: Connection, order_id: str, status: str) -> None:
    fenced_update(
        conn, "orders", "order_id", order_id, fence_column="fulfilment_fence",
        fence=ctx.write_fence,
        assignments="fulfilment_status = :s, updated_at = :now",
        params={"s": status, "now": time.time()},
    )


def _event(ctx: JobContext, conn: Connection, order_id: str, event: str, data: Any) -> None:
    write_event(
        conn, aggregate_type="order", aggregate_id=order_id, event_type=f"order.{event}",
        payload={"order_id": order_id, "key": ctx.key, **data},
        event_id=f"{ctx.key}:{event}",
    )


def fulfill_order(ctx: JobContext, p: FulfilRequest) -> dict[str, Any]:
    order_id = p.order_id
    cart = cart_for(order_id)
    point = ctx.claim.recovery_point
    inventory = Inventory(ctx.services.db)
    result = {"order_id": order_id, "cart_id": cart, "status": str(FulfilmentStatus.FULFILLED)}
    try:
        if point is None:
            with ctx.locked_row("orders", "order_id", order_id, "start") as (conn, row):
                if row is None:
                    now = time.time()
                    conn.execute(
                        text(
                            "INSERT INTO orders (order_id, payment_status, fulfilment_status,"
                            " created_at, updated_at)"
                            " VALUES (:o, 'payment_pending', 'new', :now, :now)"
                        ),
                        {"o": order_id, "now": now},
                    )
                    ctx.attempt.status_before = str(FulfilmentStatus.NEW)
                else:
                    ctx.attempt.status_before = row.fulfilment_status
                    if row.fulfilment_status == FulfilmentStatus.FULFILLED:
                        ctx.complete(result, conn=conn)
                        ctx.attempt.status_after = row.fulfilment_status
                        return result
                _set_status(ctx, conn, order_id, FulfilmentStatus.PROCESSING)
                lines = [item.model_dump() for item in p.items]
                _event(ctx, conn, order_id, "fulfilment_started", {"items": lines})
                ctx.checkpoint(STARTED, None, conn=conn)
            point = STARTED
            ctx.crash_point("after_start")
        else:
            ctx.attempt.status_before = f"resumed:{point}"

        if point == STARTED:
            with ctx.locked_row("orders", "order_id", order_id, "reserve") as (conn, _):
                reservations = inventory.reserve(conn, cart, p.items, fence=ctx.fence)
                _set_status(ctx, conn, order_id, FulfilmentStatus.RESERVED)
                ctx.checkpoint(RESERVED, {r.sku: r.quantity for r in reservations}, conn=conn)
            point = RESERVED
            ctx.crash_point("after_reserve")

        with ctx.locked_row("orders", "order_id", order_id, "ship") as (conn, _):
            inventory.ship(conn, cart)
            conn.execute(
                text(
                    "INSERT INTO shipments (order_id, shipped_at, fence) VALUES (:o, :t, :f)"
                    " ON CONFLICT (order_id) DO NOTHING"
                ),
                {"o": order_id, "t": time.time(), "f": ctx.fence},
            )
            _set_status(ctx, conn, order_id, FulfilmentStatus.FULFILLED)
            _event(ctx, conn, order_id, "shipped", {})
            ctx.complete(result, conn=conn)
        ctx.attempt.status_after = str(FulfilmentStatus.FULFILLED)
        return result
    except (LeaseLost, FencedWriteRejected):
        raise  # a newer holder owns the order now: it must not be marked by us
    except Exception as exc:
        if classify(exc) is ErrorClass.PERMANENT:  # transient: the retry resumes, keep stock
            _mark_needs_compensation(ctx, order_id, exc)
        raise


def _mark_needs_compensation(ctx: JobContext, order_id: str, exc: Exception) -> None:
    try:
        with ctx.services.db.transaction() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM orders WHERE order_id = :o"), {"o": order_id}
            ).first()
            if exists is None:
                return
            _set_status(ctx, conn, order_id, FulfilmentStatus.NEEDS_COMPENSATION)
            write_event(
                conn, aggregate_type="order", aggregate_id=order_id,
                event_type="order.needs_compensation",
                payload={"order_id": order_id, "key": ctx.key, "error": type(exc).__name__,
                         "reason": str(exc)[:500]},
                event_id=f"{ctx.key}:needs_compensation:{ctx.fence}",
            )
        ctx.attempt.status_after = str(FulfilmentStatus.NEEDS_COMPENSATION)
    except Exception:  # noqa: BLE001 - the original error matters more; reconciliation finds it
        logger.exception("could not mark order %s as needing compensation", order_id)


def reconcile_fulfilments(rec: Reconciling, report: Tally) -> None:
    """``needs_compensation``: a fulfilment failed half-way and was given up: its key
    ``fulfil:{o}`` failed permanently (or is absent), or it is ``retryable`` and its DLQ record
    was discarded. Fix: cancel its reservation (``compensate:cancel-reservation:{cart}``) and,
    if it was paid, mark a refund pending. A key that is retryable or in progress is left alone
    (a retry or replay resumes from its recovery point and needs the reservations); the release
    re-checks this inside its transaction, holding the order's row lock the job's phases
    take."""
    with rec.db.statement() as conn:
        # 'fulfil:' || order_id is fulfilment.key_for: in-flight orders given up in the DLQ
        orders = conn.execute(
            text(
                "SELECT order_id, payment_status, charge_id FROM orders o"
                " WHERE fulfilment_status = 'needs_compensation'"
                " OR (fulfilment_status IN ('processing', 'reserved') AND EXISTS ("
                "SELECT 1 FROM dlq_records d WHERE d.status = 'discarded'"
                " AND d.idempotency_key = 'fulfil:' || o.order_id))"
                " ORDER BY order_id"
            )
        ).all()
    inventory = Inventory(rec.db)
    for order in orders:
        key = key_for({"order_id": order.order_id})
        with rec.db.statement() as conn:
            if not given_up(conn, key):
                continue  # a retry or replay may still resume it: not ours to undo
        cart = cart_for(order.order_id)
        cancel = f"compensate:cancel-reservation:{cart}"
        refund = f"compensate:refund-pending:{order.order_id}:{order.charge_id}"
        todo = [
            k
            for k in (cancel, refund if order.payment_status == "paid" else None)
            if k is not None and not rec.done(k)
        ]
        if not todo:
            continue
        report.found["needs_compensation"] += 1
        fixed = False
        if cancel in todo:
            fixed |= rec.act(
                report,
                cancel,
                "cancel_reservation",
                order.order_id,
                functools.partial(
                    _release, inventory=inventory, cart_id=cart, order_id=order.order_id,
                    key=key,
                ),
            )
        if refund in todo:
            fixed |= rec.act(
                report,
                refund,
                "refund_pending",
                order.order_id,
                record_only({"refund_charge_id": order.charge_id}),
            )
        report.fixed["needs_compensation"] += int(fixed)


def _release(
    conn: Connection, *, inventory: Inventory, cart_id: str, order_id: str, key: str
) -> dict[str, Any]:
    """Release the cart, re-checking in this transaction that its fulfilment was given up. The
    order's row lock is the one every fulfilment phase holds, so no phase runs meanwhile."""
    lock_row(conn, "orders", "order_id", order_id)
    if not given_up(conn, key, lock=True):
        raise NotGivenUp(key)
    return {"released": inventory.release(conn, cart_id)}


WATCHES = (
    "EXISTS (SELECT 1 FROM orders o WHERE o.order_id = reconciliation_actions.subject"
    " AND o.fulfilment_status IN ('needs_compensation', 'processing', 'reserved'))"
)
"""The compensation check reads orders given up or in flight: their actions stay meanwhile."""


JOB_TYPE = JobType(
    name="fulfill_order",
    queue=Queue.HEAVY,
    payload=FulfilRequest,
    handler=fulfill_order,
    side_effect=True,
    keying=Keying(key_for=key_for, resource_id=formatted("{order_id}")),
    running=Running(max_runtime_seconds=900),
    upkeep=Upkeep(
        checks=("needs_compensation",),
        reconcile=reconcile_fulfilments,
        watches=(WATCHES,),
        unique=(("reservations", ("cart_id", "sku")), ("shipments", ("order_id",))),
    ),
    presentation=Presentation(
        description="Start, reserve and ship an order, resuming from recovery points.",
        result_fields=("order_id", "status"),
    ),
)
