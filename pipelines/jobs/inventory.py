"""``reserve_inventory``: reserve a cart's items once, key ``inventory-reserve:{cart_id}``.

One transaction locks the stock rows, checks availability, writes the reservations and completes
the key, so the reservation and the "done" mark commit together. The primary key
``reservations(cart_id, sku)`` and the CHECK ``reserved <= on_hand`` are the guarantee; the
claim and the row locks only keep workers from colliding on it. So it declares no exclusive
resource (``Running.exclusive``): a cart spans several SKUs, whose rows its one transaction
already locks in SKU order, and a lock per SKU would add round trips and guarantee nothing the
database does not; its writes carry the claim's fence.

States: ``unreserved -> reserved`` (see ``resources/inventory.py`` for release and ship).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text
from sqlalchemy.engine import Connection

from engine import (
    ChaosCase,
    ChaosCount,
    ChaosProof,
    Check,
    Concurrency,
    FlowControl,
    JobContext,
    JobType,
    Keying,
    NaiveRun,
    Presentation,
    Queue,
    Running,
    Upkeep,
    formatted,
    require_str,
)
from pipelines.domain.inventory import Inventory, Items, merge_items
from resources.storage.db import Database


class ReserveRequest(BaseModel):
    """A cart's items to reserve: the key is ``inventory-reserve:{cart_id}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"cart_id": "c-example-1", "items": [{"sku": "apple", "quantity": 1}]},
    ]})

    cart_id: Annotated[str, Check(require_str), Field(
        description="The cart; the key is inventory-reserve:{cart_id}.")]
    items: Items


key_for = formatted("inventory-reserve:{cart_id}")


def reserve_inventory(ctx: JobContext, p: ReserveRequest) -> dict[str, Any]:
    inventory = Inventory(ctx.services.db)
    with ctx.concurrency_slot(JOB_TYPE), ctx.transaction("reserve") as conn:
        result = _reserve(ctx, p, inventory, conn)
        ctx.crash_point("before_commit_reservation")
        ctx.complete(result, conn=conn)
    ctx.attempt.status_after = "reserved"
    return result


def reserve_inventories(items: Sequence[tuple[JobContext, ReserveRequest]]) -> list[Any]:
    """A micro-batch of carts in one transaction: every cart's stock rows are locked first, in
    sku order (two batches never deadlock); each cart reserves inside its own savepoint, so a
    cart that fails (no stock, unknown sku) rolls back alone; the reserved carts' keys complete
    in the same transaction. If a cart's lease was taken over meanwhile, the transaction is
    rolled back whole and each cart runs on its own (the lost one then stops with LeaseLost)."""
    if not items:
        return []
    services = items[0][0].services
    inventory = Inventory(services.db)
    results: list[Any] = [None] * len(items)
    try:
        with services.db.transaction() as conn:
            inventory.lock_stock(
                conn, {sku for _, p in items for sku in merge_items(p.items)}
            )
            done = []
            for i, (ctx, p) in enumerate(items):
                try:
                    ctx.check_lease()
                    with ctx.timed("reserve"), conn.begin_nested():
                        results[i] = _reserve(ctx, p, inventory, conn)
                    done.append(i)
                except Exception as exc:  # noqa: BLE001 - this cart's failure, not the batch's
                    results[i] = exc
            items[0][0].crash_point("before_commit_reservation")
            lost = services.store.complete_many(
                [(items[i][0].claim, results[i]) for i in done], conn=conn
            )
            if any(lost):
                raise _TakenOver
    except _TakenOver:
        return [_one(ctx, p) for ctx, p in items]
    except Exception as exc:  # noqa: BLE001 - the batch's transaction failed: every cart did
        return [exc] * len(items)
    for i in done:
        items[i][0].completed = True
        items[i][0].attempt.status_after = "reserved"
    return results


class _TakenOver(Exception):
    """A cart's lease was taken over mid-batch: roll the batch back and go one by one."""


def _one(ctx: JobContext, p: ReserveRequest) -> Any:
    try:
        return reserve_inventory(ctx, p)
    except Exception as exc:  # noqa: BLE001 - returned as this cart's outcome
        return exc


def _reserve(
    ctx: JobContext, p: ReserveRequest, inventory: Inventory, conn: Connection
) -> dict[str, Any]:
    before = inventory.reservations(p.cart_id, conn)
    ctx.attempt.status_before = "reserved" if before else "unreserved"
    reservations = inventory.reserve(conn, p.cart_id, p.items, fence=ctx.fence)
    return {"cart_id": p.cart_id, "reserved": {r.sku: r.quantity for r in reservations}}


# -- what the chaos proof needs (engine.chaos) ------------------------------------------------


def _chaos_sample(i: int, poison: bool) -> dict[str, Any]:
    """Request ``i`` of the chaos mix: a cart of its own with one SKU of its own; poison
    reserves none of it."""
    return {"cart_id": f"c{i}", "items": [{"sku": f"sku-c{i}",
                                           "quantity": 0 if poison else 1 + i % 3}]}


def _seed_stock(db: Database, payloads: Sequence[Mapping[str, Any]]) -> None:
    """Every SKU a valid reservation names, plenty of it."""
    inventory = Inventory(db)
    for payload in payloads:
        for item in payload["items"]:
            inventory.set_stock(item["sku"], 1000)


def _naive_reserve(run: NaiveRun, clean: dict[str, Any], key: str, correlation_id: str) -> None:
    """The reservation with no lock, no fence and no key: the stock counter moves on every
    delivery."""
    run.point("before_effect")
    with run.db.transaction() as conn:
        for item in clean["items"]:
            conn.execute(
                text("UPDATE stock SET reserved = reserved + :q, updated_at = :now"
                     " WHERE sku = :sku"),
                {"q": item["quantity"], "sku": item["sku"], "now": time.time()},
            )
            conn.execute(
                text("INSERT INTO reservations (cart_id, sku, quantity, status, fence,"
                     " created_at, updated_at) VALUES (:c, :s, :q, 'reserved', 0, :now,"
                     " :now) ON CONFLICT DO NOTHING"),
                {"c": clean["cart_id"], "s": item["sku"], "q": item["quantity"],
                 "now": time.time()},
            )
    run.point("after_effect")


@dataclass(frozen=True)
class _Stock:
    reserved: dict[str, int]  # sku -> units reserved
    fences: dict[str, set[int]]  # cart -> the fences on its reservation rows


def _gather_stock(db: Database) -> _Stock:
    fences: dict[str, set[int]] = defaultdict(set)
    with db.statement() as conn:
        reserved = {str(r.sku): int(r.reserved) for r in conn.execute(
            text("SELECT sku, reserved FROM stock"))}
        for r in conn.execute(text("SELECT cart_id, fence FROM reservations")):
            fences[str(r.cart_id)].add(int(r.fence))
    return _Stock(reserved, fences)


def _count_reservations(stock: _Stock, case: ChaosCase) -> ChaosCount:
    """The cart's reservations, counted in the stock itself: units reserved over the cart's
    quantity (each SKU is the cart's own)."""
    items = case.payload["items"]
    quantity = sum(i["quantity"] for i in items) or 1
    return ChaosCount(sum(stock.reserved.get(i["sku"], 0) for i in items) // quantity)


def _reservation_fenced(stock: _Stock, payload: Mapping[str, Any], fence: int) -> str | None:
    fences = stock.fences.get(payload["cart_id"], set())
    return None if fences == {fence} else f"reservation fences {sorted(fences)} != {fence}"


CHAOS = ChaosProof(
    mix=(0.85, 1.0), sample=_chaos_sample, seed=_seed_stock, naive=_naive_reserve,
    after_effect=("before_commit_reservation",), gather=_gather_stock,
    count=_count_reservations, fenced=_reservation_fenced,
)
"""Part of the chaos mix, judged by the stock and the reservation rows."""


JOB_TYPE = JobType(
    name="reserve_inventory",
    queue=Queue.LIGHT,
    payload=ReserveRequest,
    handler=reserve_inventory,
    side_effect=True,
    keying=Keying(key_for=key_for, resource_id=formatted("{cart_id}")),
    running=Running(max_runtime_seconds=120, handler_many=reserve_inventories),
    flow=FlowControl(concurrency=Concurrency("cart:{cart_id}", limit=1)),
    upkeep=Upkeep(unique=(("reservations", ("cart_id", "sku")),), chaos=CHAOS),
    presentation=Presentation(
        description="Reserve a cart's items in one transaction with row locks (one at a time "
                    "per cart:{cart_id}).",
        result_fields=("cart_id", "reserved"),
    ),
)
validate = JOB_TYPE.validate
