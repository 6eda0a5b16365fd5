"""``reserve_inventory``: reserve a cart's items once, key ``inventory-reserve:{cart_id}``.

One transaction locks the stock rows, checks availability, writes the reservations and completes
the key, so the reservation and the "done" mark commit together. The primary key
``reservations(cart_id, sku)`` and the CHECK ``reserved <= on_hand`` are the guarantee; the
claim and the row locks only keep workers from colliding on it.

States: ``unreserved -> reserved`` (see ``resources/inventory.py`` for release and ship).
"""

from __future__ import annotations

from typing import Any

from pipelines.domain.inventory import Inventory
from pipelines.jobs.base import (
    ITEMS,
    JobContext,
    JobType,
    PayloadField,
    reject_unknown,
    require_items,
    require_str,
)


def validate(payload: dict[str, Any]) -> dict[str, Any]:
    reject_unknown(payload, {"cart_id", "items"})
    return {"cart_id": require_str(payload, "cart_id"), "items": require_items(payload)}


def key_for(payload: dict[str, Any]) -> str:
    return f"inventory-reserve:{payload['cart_id']}"


def reserve_inventory(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    inventory = Inventory(ctx.services.db)
    with ctx.concurrency_slot(JOB_TYPE), ctx.transaction("reserve") as conn:
        before = inventory.reservations(p["cart_id"], conn)
        ctx.attempt.status_before = "reserved" if before else "unreserved"
        reservations = inventory.reserve(conn, p["cart_id"], p["items"], fence=ctx.fence)
        ctx.crash_point("before_commit_reservation")
        result = {
            "cart_id": p["cart_id"],
            "reserved": {r.sku: r.quantity for r in reservations},
        }
        ctx.complete(result, conn=conn)
    ctx.attempt.status_after = "reserved"
    return result


JOB_TYPE = JobType(
    name="reserve_inventory",
    queue="light",
    validate=validate,
    key_for=key_for,
    max_runtime_seconds=120,
    side_effect=True,
    handler=reserve_inventory,
    resource_id=lambda p: str(p["cart_id"]),
    lock="db-transaction",
    description="Reserve a cart's items in one transaction with row locks (one at a time per "
    "cart:{cart_id}).",
    concurrency_key="cart:{cart_id}",
    concurrency_limit=1,
    fields=(
        PayloadField("cart_id", str, "The cart; the key is inventory-reserve:{cart_id}."),
        ITEMS,
    ),
    example={"cart_id": "c-example-1", "items": [{"sku": "apple", "quantity": 1}]},
    result_fields=("cart_id", "reserved"),
)
