"""Fulfilment, compensation and retry/replay together, on SQLite and Postgres: a transient
failure after the reservation, a reconciliation pass, then the retry or replay of the same key.
The order either ships with its stock moved exactly once or the job refuses; it never ends
"fulfilled" with no stock moved (review finding 1).

The transient failure is a real database error: a trigger makes the shipments INSERT (inside
the ship transaction) fail until the test drops it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.upkeep.reconciliation import Reconciler
from pipelines import ops
from pipelines.domain.inventory import Inventory, ReservationsNotHeld
from resources.dlq import DlqStore, FailureClass
from resources.idempotency import IdempotencyStore, Status
from resources.storage.db import Database
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

PAYLOAD = {"order_id": "o-1", "items": [{"sku": "apple", "quantity": 4}]}
KEY, CART = "fulfil:o-1", "order-o-1"


@pytest.fixture(scope="module")
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


# A transient database error is injected with a trigger raising SQLSTATE 40001 (serialization
# failure). SQLite has no transient error a trigger can raise (its RAISE is a constraint abort,
# correctly classified permanent), so the tests built on a transient blip run on Postgres.
ON_POSTGRES = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def _break_shipments(db: Database) -> None:
    """A DB blip in the ship transaction: the shipments INSERT fails (a transient error)."""
    assert db.is_postgres
    with db.transaction() as conn:
        conn.execute(text(
            "CREATE FUNCTION blip() RETURNS trigger AS $$ BEGIN"
            " RAISE EXCEPTION 'db blip' USING ERRCODE = '40001'; END $$ LANGUAGE plpgsql"
        ))
        conn.execute(text(
            "CREATE TRIGGER blip BEFORE INSERT ON shipments FOR EACH ROW EXECUTE FUNCTION blip()"
        ))


def _heal_shipments(db: Database) -> None:
    with db.transaction() as conn:
        conn.execute(text("DROP TRIGGER blip ON shipments"))


def _run(
    db_url: str, redis_url: str, namespace: str, instance: dg.DagsterInstance
) -> dg.ExecuteInProcessResult:
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace,
        retry={"max_attempts": 1, "budget_enabled": False},  # give up at once: DLQ, replay later
    )
    return ops.fulfill_order_job.execute_in_process(
        run_config={"ops": {"fulfill_order_op": {"config": {"payload": PAYLOAD}}}},
        resources=resources, instance=instance, raise_on_error=False,
    )


def _reconcile(db: Database) -> None:
    Reconciler(db, store=IdempotencyStore(db), dlq=DlqStore(db), grace_seconds=0).run()


def _state(db: Database) -> dict[str, Any]:
    with db.statement() as conn:
        status = conn.execute(
            text("SELECT fulfilment_status FROM orders WHERE order_id = 'o-1'")
        ).scalar()
        shipments = conn.execute(text("SELECT COUNT(*) FROM shipments")).scalar()
        shipped_events = conn.execute(
            text("SELECT COUNT(*) FROM outbox WHERE event_type = 'order.shipped'")
        ).scalar()
    inventory = Inventory(db)
    return {
        "status": status, "shipments": shipments, "shipped_events": shipped_events,
        "stock": inventory.stock("apple"),
        "reservations": [r.status for r in inventory.reservations(CART)],
    }


def _fail_after_reserve(
    db: Database, db_url: str, redis_url: str, namespace: str, instance: dg.DagsterInstance
) -> None:
    """Step 1 of the review's timeline: reserved, then the ship transaction fails transiently."""
    Inventory(db).set_stock("apple", 10)
    _break_shipments(db)
    assert not _run(db_url, redis_url, namespace, instance).success
    _heal_shipments(db)
    record = IdempotencyStore(db).get(KEY)
    assert record is not None and record.status is Status.RETRYABLE
    assert record.recovery_point == "reserved"
    assert Inventory(db).stock("apple") == (10, 4)


@ON_POSTGRES
def test_transient_failure_then_reconciliation_then_replay_moves_stock_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    instance: dg.DagsterInstance,
) -> None:
    """Regression caught: a transient ship failure marked needs_compensation, reconciliation
    released the reservations under the retryable key, and the replay shipped nothing yet
    marked the order fulfilled (shipment row, order.shipped event, stock never moved)."""
    _fail_after_reserve(db, db_url, redis_url, namespace, instance)
    assert _state(db)["status"] == "reserved"  # transient: not handed to compensation

    _reconcile(db)  # step 2
    assert Inventory(db).stock("apple") == (10, 4)

    assert _run(db_url, redis_url, namespace, instance).success  # step 3: the replay
    assert _state(db) == {
        "status": "fulfilled", "shipments": 1, "shipped_events": 1, "stock": (6, 0),
        "reservations": ["shipped"],
    }


@ON_POSTGRES
def test_compensation_leaves_a_retryable_fulfilment_alone(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    instance: dg.DagsterInstance,
) -> None:
    """Regression caught: the compensation released reservations whose fulfilment key was
    still retryable (an order marked needs_compensation by an older worker, or by hand)."""
    _fail_after_reserve(db, db_url, redis_url, namespace, instance)
    with db.transaction() as conn:
        conn.execute(text(
            "UPDATE orders SET fulfilment_status = 'needs_compensation' WHERE order_id = 'o-1'"
        ))
    _reconcile(db)
    assert Inventory(db).stock("apple") == (10, 4)
    assert [r.status for r in Inventory(db).reservations(CART)] == ["reserved"]

    assert _run(db_url, redis_url, namespace, instance).success
    state = _state(db)
    assert state["status"] == "fulfilled" and state["stock"] == (6, 0)
    assert state["shipments"] == state["shipped_events"] == 1


@ON_POSTGRES
def test_run_after_a_given_up_fulfilment_was_compensated_is_refused(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    instance: dg.DagsterInstance,
) -> None:
    """Regression caught: a run resumed at 'reserved' after the compensation released the cart
    shipped 0 items and still recorded the order fulfilled. Now the compensation runs only once
    the request was given up (its DLQ record discarded) and the late run is refused."""
    _fail_after_reserve(db, db_url, redis_url, namespace, instance)
    dlq = DlqStore(db)
    (record,) = dlq.list_records()  # the failure path wrote it where it gave the request up
    assert record.idempotency_key == KEY and record.error_class == FailureClass.TRANSIENT
    dlq.discard([record.id], actor="test", reason="customer cancelled")
    _reconcile(db)
    assert Inventory(db).stock("apple") == (10, 0)
    assert [r.status for r in Inventory(db).reservations(CART)] == ["released"]

    result = _run(db_url, redis_url, namespace, instance)  # a late relaunch of the same key
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "ReservationsNotHeld" in str(failure.event_specific_data)
    state = _state(db)
    assert state["status"] != "fulfilled" and state["shipments"] == 0
    assert state["shipped_events"] == 0 and state["stock"] == (10, 0)
    record = IdempotencyStore(db).get(KEY)
    assert record is not None and record.status is Status.FAILED


def test_reserve_and_ship_refuse_released_reservations(db: Database) -> None:
    """Regression caught: ship() skipped released rows and returned 0; reserve() returned the
    released rows as if they still held stock."""
    inventory = Inventory(db)
    inventory.set_stock("apple", 10)
    with db.transaction() as conn:
        inventory.reserve(conn, CART, [{"sku": "apple", "quantity": 4}])
    with db.transaction() as conn:
        assert inventory.release(conn, CART) == 1
    for attempt in (
        lambda conn: inventory.ship(conn, CART),
        lambda conn: inventory.reserve(conn, CART, [{"sku": "apple", "quantity": 4}]),
        lambda conn: inventory.ship(conn, "order-never-reserved"),
    ):
        with pytest.raises(ReservationsNotHeld), db.transaction() as conn:
            attempt(conn)
    assert inventory.stock("apple") == (10, 0)
