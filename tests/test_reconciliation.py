"""Reconciliation against SQLite/Postgres, the sandbox payment gateway (real HTTP) and real
processes: every planted inconsistency is found and fixed exactly once, a second pass finds
nothing, and reconcilers racing in threads and processes still compensate each thing once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy import text

from engine.requests import RequestStore
from engine.upkeep.reconciliation import Reconciler, checks
from pipelines.assets.reconciliation import dlq_retention_check, reconciliation
from pipelines.domain.inventory import Inventory
from pipelines.domain.payments import HttpPaymentGateway
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStore, FailureInfo, RetentionTooShort
from resources.idempotency import IdempotencyStore
from resources.outbox import write_event
from resources.outbox.publisher import Consumer, InAppPublisher, Inbox, OutboxPublisher
from resources.storage.db import Database
from sandbox.gateway import GatewayServer

ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600.0


def _order(
    db: Database,
    order_id: str,
    *,
    payment: str,
    fulfilment: str = "new",
    reference: str | None = None,
    charge_id: str | None = None,
) -> None:
    old = time.time() - HOUR
    with db.transaction() as conn:
        conn.execute(
            text(
                "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                " payment_reference, charge_id, fulfilment_status, created_at, updated_at)"
                " VALUES (:o, 1000, 'EUR', :p, :r, :c, :f, :t, :t)"
            ),
            {
                "o": order_id,
                "p": payment,
                "r": reference,
                "c": charge_id,
                "f": fulfilment,
                "t": old,
            },
        )


def plant(db: Database, gateway_url: str) -> None:
    """One of each inconsistency the reconciler knows."""
    gw = HttpPaymentGateway(gateway_url)
    # 1. charged at the gateway, never confirmed here
    gw.charge(reference="ref-cnc", amount_cents=1000, currency="EUR", idempotency_key="k-cnc")
    _order(db, "o-cnc", payment="charged_not_confirmed", reference="ref-cnc")
    # 2. charged twice (two keys), paid here with the first
    first = gw.charge(reference="ref-dbl", amount_cents=1000, currency="EUR", idempotency_key="a")
    gw.charge(reference="ref-dbl", amount_cents=1000, currency="EUR", idempotency_key="b")
    _order(db, "o-dbl", payment="paid", reference="ref-dbl", charge_id=first.charge_id)
    # 3. the reverse: paid here, no such charge at the gateway
    _order(db, "o-ghost", payment="paid", reference="ref-ghost", charge_id="ch_ghost")
    # 4. a fulfilment that failed after reserving stock
    inventory = Inventory(db)
    inventory.set_stock("sku-c", 5)
    _order(db, "o-comp", payment="payment_pending", fulfilment="needs_compensation")
    with db.transaction() as conn:
        inventory.reserve(conn, "order-o-comp", [{"sku": "sku-c", "quantity": 3}])
    # 5. a claim whose worker died two hours ago, for a queued request
    payload = {"cart_id": "c-stuck", "items": [{"sku": "sku-c", "quantity": 1}]}
    RequestStore(db).enqueue(
        "reserve_inventory", "inventory-reserve:c-stuck", payload, queue="light"
    )
    IdempotencyStore(db, lease_seconds=60, clock=lambda: time.time() - 2 * HOUR).begin(
        "inventory-reserve:c-stuck", payload=payload
    )
    # 6. an outbox row nobody published for an hour
    with db.transaction() as conn:
        write_event(
            conn,
            aggregate_type="order",
            aggregate_id="o-cnc",
            event_type="order.paid",
            payload={},
            event_id="ev-stale",
            now=time.time() - HOUR,
        )
    # 7. a completed key long past its retention
    old = IdempotencyStore(db, retention_seconds=7 * 86400, clock=lambda: time.time() - 30 * 86400)
    claim = old.begin("email:welcome:u1:2026-10-30")
    old.complete(claim, {"sent": True})


def reconciler(db: Database, gateway_url: str, consumed: list[str] | None = None) -> Reconciler:
    sink = consumed if consumed is not None else []
    consumer = Consumer("test", frozenset(), lambda _c, e: sink.append(e.event_id))
    publisher = OutboxPublisher(db, InAppPublisher(Inbox(db), [consumer]))
    return Reconciler(
        db,
        store=IdempotencyStore(db),
        dlq=DlqStore(db),
        clients={"payment_gateway": HttpPaymentGateway(gateway_url)},
        publisher=publisher,
        grace_seconds=600,
        idempotency_retention_seconds=7 * 86400,
    )


def test_each_planted_inconsistency_is_fixed_once_and_a_second_pass_finds_nothing(
    db: Database, gateway: GatewayServer
) -> None:
    """Catches: a compensation that runs on every pass (stock released twice, refunds marked
    twice), a check that keeps finding what it fixed, a stuck claim never dead-lettered."""
    plant(db, gateway.url)
    consumed: list[str] = []
    first = reconciler(db, gateway.url, consumed).run()
    assert first.found == dict.fromkeys(checks(), 1), first.found
    assert first.fixed == dict.fromkeys(checks(), 1), first.fixed
    second = reconciler(db, gateway.url, consumed).run()
    assert second.total_found == 0 and second.total_fixed == 0, second.found

    with db.statement() as conn:
        paid = conn.execute(
            text("SELECT payment_status, charge_id FROM orders WHERE order_id = 'o-cnc'")
        ).one()
        kinds = sorted(
            r.kind for r in conn.execute(text("SELECT kind FROM reconciliation_actions"))
        )
    charges = {c["reference"]: c["charge_id"] for c in gateway.charges()}
    assert paid.payment_status == "paid" and paid.charge_id == charges["ref-cnc"]
    assert kinds == sorted(
        [
            "confirm_charge",
            "refund_pending",
            "paid_without_charge",
            "cancel_reservation",
            "stuck_claim_to_dlq",
        ]
    )
    assert Inventory(db).stock("sku-c") == (5, 0)
    assert [r.status for r in Inventory(db).reservations("order-o-comp")] == ["released"]
    (record,) = DlqStore(db).list_records()
    assert record.idempotency_key == "inventory-reserve:c-stuck"
    assert record.job_type == "reserve_inventory" and record.error_type == "LeaseExpired"
    assert record.run_config == {}  # a replay serves its request by id, read from the row
    stuck = RequestStore(db).get_by_key(record.idempotency_key)
    assert stuck is not None and record.request_id == stuck.id
    assert consumed == ["ev-stale"]
    assert IdempotencyStore(db).get("email:welcome:u1:2026-10-30") is None
    # the compensation keys are themselves completed idempotency records
    assert (
        IdempotencyStore(db).get("compensate:cancel-reservation:order-o-comp").status == "completed"
    )


def _race_worker(url: str, gateway_url: str) -> None:
    db = Database.from_url(url)
    report = reconciler(db, gateway_url).run()
    print(json.dumps(report.fixed))


def test_racing_reconcilers_compensate_each_inconsistency_once(
    db: Database, db_url: str, gateway: GatewayServer
) -> None:
    """Catches: check-then-act races between reconcilers (two schedules, a manual run) that
    would release a reservation twice or dead-letter a claim twice."""
    plant(db, gateway.url)
    code = (
        "import sys; from tests.test_reconciliation import _race_worker;"
        " _race_worker(sys.argv[1], sys.argv[2])"
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, db_url, gateway.url],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    fixed: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fixed.append(reconciler(db, gateway.url).run().fixed)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()[-2000:]
        fixed.append(json.loads(out.decode().strip().splitlines()[-1]))
    assert not errors, errors
    for check in (
        "double_charged",
        "paid_without_charge",
        "needs_compensation",
        "stuck_claims",
        "charged_not_confirmed",
    ):
        assert sum(f[check] for f in fixed) == 1, (check, fixed)
    assert Inventory(db).stock("sku-c") == (5, 0)
    assert len(DlqStore(db).list_records()) == 1
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM reconciliation_actions")).scalar() == 5
    assert reconciler(db, gateway.url).run().total_found == 0


def test_the_reaper_refuses_a_retention_shorter_than_a_weekend(db: Database) -> None:
    """Catches: a reaper that would purge keys before a weekend's failures can be replayed."""
    with pytest.raises(RetentionTooShort):
        Reconciler(
            db,
            store=IdempotencyStore(db),
            dlq=DlqStore(db),
            idempotency_retention_seconds=24 * HOUR,
        )


def test_asset_metadata_counts_and_retention_check_warns(
    db: Database, db_url: str, redis_url: str, namespace: str, gateway: GatewayServer
) -> None:
    """Catches: metadata that does not carry the counts; an open DLQ record about to be dropped
    by a retention limit without a warning."""
    from pipelines.profile import DownstreamResource
    from resources.dagster_resources import CacheResource, DatabaseResource, IdempotencyResource

    plant(db, gateway.url)
    old = DlqStore(db, clock=lambda: time.time() - 29 * 86400)
    old.record_failure(
        FailureInfo(
            job_type="send_email", dedupe_key="request:99", error_type="X", message="m", run_id="r"
        )
    )
    resources = {
        "app_db": DatabaseResource(database_url=db_url),
        "idempotency": IdempotencyResource(database_url=db_url),
        "dlq": DlqResource(database_url=db_url, retention_days=30, warn_days=3),
        "payment_gateway": DownstreamResource(downstream="payment_gateway", address=gateway.url),
        "cache": CacheResource(redis_url=redis_url, namespace=namespace),
    }
    result = dg.materialize(
        [reconciliation, dlq_retention_check],
        resources=resources,
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    (mat,) = result.asset_materializations_for_node("reconciliation")
    assert mat.metadata["found_needs_compensation"].value == 1
    assert mat.metadata["fixed_total"].value == len(checks())
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    assert check.metadata["at_risk"].value == 1
