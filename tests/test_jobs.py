"""The five job types as real Dagster jobs against real servers: one effect per intent, tags,
validation, and every attempt recorded.

Each test runs ``execute_in_process`` on a shared ephemeral instance with resources pointing at
a real app database (SQLite and Postgres), the real Redis, the sandbox HTTP gateway and the
SMTP sink, and counts effects where they land (gateway ledger, sink, business tables).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.registry import JOB_TYPES, get_job_type
from pipelines import ops
from pipelines.domain.inventory import Inventory
from pipelines.domain.mail import message_id_for
from pipelines.jobs.payment import reference_for
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore, Status
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

JOB_NAMES = ["charge_payment", "send_email", "reserve_inventory", "rebuild_report_cache",
             "fulfill_order"]


@pytest.fixture(scope="module")
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@dataclass
class World:
    db: Database
    db_url: str
    gateway: GatewayServer
    sink: MailSink
    redis_url: str
    namespace: str
    instance: dg.DagsterInstance

    def resources(self, **overrides: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "db_url": self.db_url, "redis_url": self.redis_url, "namespace": self.namespace,
            "gateway_url": self.gateway.url, "smtp_port": self.sink.port,
        }
        spec.update(overrides)
        return dagster_resources(**spec)

    def run(
        self, job_name: str, payload: dict[str, Any], *,
        resources: dict[str, Any] | None = None, **config: Any,
    ) -> dg.ExecuteInProcessResult:
        job = next(j for j in ops.all_jobs if j.name == job_name)
        return job.execute_in_process(
            run_config={"ops": {f"{job_name}_op": {"config": {"payload": payload, **config}}}},
            resources=resources or self.resources(),
            instance=self.instance,
            raise_on_error=False,
        )

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.db.statement() as conn:
            return conn.execute(text(sql), params).scalar()

    def attempts(self, key: str) -> list[dict[str, Any]]:
        return AttemptRecorder(self.db).for_key(key)


@pytest.fixture
def world(
    db: Database, db_url: str, tmp_path: Path, redis_url: str, namespace: str,
    redis_client: Any, instance: dg.DagsterInstance,
) -> Iterator[World]:
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    try:
        yield World(db, db_url, gateway, sink, redis_url, namespace, instance)
    finally:
        gateway.stop()
        sink.stop()


PAYLOADS: dict[str, dict[str, Any]] = {
    "charge_payment": {"order_id": "o-1", "amount_cents": 1250, "currency": "EUR"},
    "send_email": {"template": "welcome", "user_id": "u-7", "date": "2026-11-29",
                   "to": "u7@example.com"},
    "reserve_inventory": {"cart_id": "c-1", "items": [{"sku": "apple", "quantity": 3},
                                                      {"sku": "pear", "quantity": 2}]},
    "rebuild_report_cache": {"report": "stock_levels", "as_of": "2026-11-29T10"},
    "fulfill_order": {"order_id": "o-9", "items": [{"sku": "apple", "quantity": 4}]},
}


def count_effects(world: World, job_name: str) -> int:
    if job_name == "charge_payment":
        return len([c for c in world.gateway.charges()
                    if c["reference"] == reference_for("payment:o-1")])
    if job_name == "send_email":
        return len(world.sink.messages(message_id_for("email:welcome:u-7:2026-11-29")))
    if job_name == "reserve_inventory":
        return int(world.scalar("SELECT COUNT(*) FROM reservations WHERE cart_id = 'c-1'"))
    if job_name == "rebuild_report_cache":
        return int(world.scalar("SELECT COUNT(*) FROM report_snapshots"))
    return int(world.scalar("SELECT COUNT(*) FROM shipments WHERE order_id = 'o-9'"))


def test_each_job_type_launched_twice_has_one_effect(world: World) -> None:
    """Regression caught: any job type whose second run repeats the effect (no claim, a key
    derived from the run instead of the intent, or a completion outside the transaction)."""
    inventory = Inventory(world.db)
    inventory.set_stock("apple", 10)
    inventory.set_stock("pear", 5)
    for name in JOB_NAMES:
        payload = PAYLOADS[name]
        first = world.run(name, payload)
        second = world.run(name, payload)
        assert first.success and second.success, name
        assert first.output_for_node(f"{name}_op")["status"] == "completed", name
        assert second.output_for_node(f"{name}_op")["status"] == "duplicate", name
        assert count_effects(world, name) == (2 if name == "reserve_inventory" else 1), name
        key = get_job_type(name).keying.key_for(get_job_type(name).validate(payload))
        outcomes = [a["outcome"] for a in world.attempts(key)]
        assert outcomes == ["completed", "duplicate_suppressed"], (name, outcomes)

    assert inventory.stock("apple") == (10 - 4, 3)  # 4 shipped by fulfilment, 3 reserved by c-1
    assert inventory.stock("pear") == (5, 2)
    paid = world.scalar("SELECT payment_status FROM orders WHERE order_id = 'o-1'")
    assert paid == "paid"
    fulfilled = world.scalar("SELECT fulfilment_status FROM orders WHERE order_id = 'o-9'")
    assert fulfilled == "fulfilled"
    events = world.scalar("SELECT COUNT(*) FROM outbox WHERE aggregate_id = 'o-9'")
    assert events == 2  # fulfilment_started and shipped, once each


def test_attempt_record_carries_the_observability_fields(world: World) -> None:
    """Regression caught: attempts recorded without the fields the doctor and metrics need."""
    result = world.run("charge_payment", {"order_id": "o-2", "amount_cents": 500},
                       correlation_id="corr-42", request_id=77)
    assert result.success
    [row] = world.attempts("payment:o-2")
    assert row["job_type"] == "charge_payment" and row["resource_id"] == "o-2"
    assert row["run_id"] == result.run_id and row["step"] == "charge_payment_op"
    assert row["attempt"] == 0 and row["fence"] == 1 and row["pid"] > 0 and row["host"]
    assert row["status_before"] == "absent" and row["status_after"] == "paid"
    assert row["correlation_id"] == "corr-42" and row["request_id"] == 77
    assert row["lock_wait_seconds"] is not None and row["lock_wait_seconds"] >= 0
    assert {"claim", "lock_order", "gateway_charge", "confirm"} <= set(row["durations"])
    assert row["ended_at"] >= row["started_at"] and row["outcome"] == "completed"
    [charge] = world.gateway.ledger.by_reference(reference_for("payment:o-2"))
    assert charge["correlation_id"] == "corr-42"  # one request, one job, one effect: linked


def test_permanent_error_runs_once_and_is_not_retried(world: World) -> None:
    """Regression caught: a validation error retried (by the op or the run-retry daemon)."""
    result = world.run("charge_payment", {"order_id": "o-3", "amount_cents": -5})
    assert not result.success
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert retries == []
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "amount_cents" in str(failure.event_specific_data)
    rows = AttemptRecorder(world.db).all("charge_payment")
    assert [(r["outcome"], r["error_class"], r["error_kind"]) for r in rows] == [
        ("failed_permanent", "ValidationError", "permanent")
    ]
    assert world.gateway.charges() == []
    tags = ops.charge_payment_job.tags
    assert tags["dagster/retry_on_asset_or_op_failure"] == "false"


def test_business_refusal_is_permanent_and_stored(world: World) -> None:
    """Regression caught: an oversell retried, or re-executed when launched again."""
    Inventory(world.db).set_stock("plum", 1)
    payload = {"cart_id": "c-2", "items": [{"sku": "plum", "quantity": 5}]}
    first = world.run("reserve_inventory", payload)
    second = world.run("reserve_inventory", payload)
    assert not first.success and not second.success
    for result in (first, second):
        assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    record = IdempotencyStore(world.db).get("inventory-reserve:c-2")
    assert record is not None and record.status is Status.FAILED
    assert record.error_class == "InsufficientStock"
    assert [a["error_class"] for a in world.attempts("inventory-reserve:c-2")] == [
        "InsufficientStock", "StoredFailure"
    ]
    assert world.scalar("SELECT COUNT(*) FROM reservations") == 0
    assert Inventory(world.db).stock("plum") == (1, 0)


def test_failed_fulfilment_needs_compensation(world: World) -> None:
    """Regression caught: a fulfilment that fails mid-way left 'processing' with no trace."""
    Inventory(world.db).set_stock("kiwi", 1)
    payload = {"order_id": "o-5", "items": [{"sku": "kiwi", "quantity": 2}]}
    result = world.run("fulfill_order", payload)
    assert not result.success
    assert world.scalar("SELECT fulfilment_status FROM orders WHERE order_id = 'o-5'") == (
        "needs_compensation"
    )
    types = world.scalar(
        "SELECT COUNT(*) FROM outbox WHERE aggregate_id = 'o-5'"
        " AND event_type IN ('order.fulfilment_started', 'order.needs_compensation')"
    )
    assert types == 2
    assert world.scalar("SELECT COUNT(*) FROM shipments") == 0


def test_jobs_carry_queue_runtime_and_no_run_retry_tags() -> None:
    """Regression caught: a job that can stay STARTED forever or be retried by the daemon."""
    assert {j.name for j in ops.all_jobs} == {*JOB_NAMES, "deliver_webhook"}
    for job in ops.all_jobs:
        jt = JOB_TYPES[job.name]
        assert job.tags["sekali/queue"] == jt.queue in ("heavy", "light")
        # above the engine's own bound: the engine decides a hung handler, not run monitoring
        assert float(job.tags["dagster/max_runtime"]) > jt.running.max_runtime_seconds > 0
        assert job.tags["dagster/retry_on_asset_or_op_failure"] == "false"
        assert job.executor_def.name == dg.in_process_executor.name
    assert all(jt.side_effect for n, jt in JOB_TYPES.items() if n != "rebuild_report_cache")


BAD_INPUT = [
    ("charge_payment", {"order_id": "o", "amount_cents": "12"}, "amount_cents"),
    ("charge_payment", {"amount_cents": 12}, "order_id"),
    ("charge_payment", {"order_id": "o", "amount_cents": 1, "currency": "euro"}, "currency"),
    ("send_email", {"template": "nope", "user_id": "u", "date": "2026-01-01", "to": "a@b.co"},
     "template"),
    ("send_email", {"template": "welcome", "user_id": "u", "date": "01/01/2026", "to": "a@b.co"},
     "date"),
    ("send_email", {"template": "welcome", "user_id": "u", "date": "2026-01-01", "to": "x"}, "to"),
    ("reserve_inventory", {"cart_id": "c", "items": []}, "items"),
    ("reserve_inventory", {"cart_id": "c", "items": [{"sku": "a", "quantity": 0}]},
     "items[0].quantity"),
    ("rebuild_report_cache", {"report": "nope", "as_of": "x"}, "report"),
    ("fulfill_order", {"order_id": "o", "items": [{"sku": "a"}]}, "items[0].quantity"),
    ("fulfill_order", {"order_id": "o", "items": [{"sku": "a", "quantity": 1}], "x": 1}, "x"),
]


@pytest.mark.parametrize(("job_type", "payload", "field"), BAD_INPUT)
def test_validation_names_the_field(job_type: str, payload: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        get_job_type(job_type).validate(payload)
    assert info.value.field == field and info.value.permanent


def test_unknown_job_type_is_a_validation_error() -> None:
    with pytest.raises(ValidationError) as info:
        get_job_type("mine_bitcoin")
    assert info.value.field == "job_type"


def test_keys_name_the_intent() -> None:
    assert get_job_type("charge_payment").keying.key_for({"order_id": "o1"}) == "payment:o1"
    email = get_job_type("send_email").validate(
        {"template": "receipt", "user_id": 5, "date": "2026-11-29", "to": "a@b.co"}
    )
    assert get_job_type("send_email").keying.key_for(email) == "email:receipt:5:2026-11-29"
    reserve = get_job_type("reserve_inventory").keying.key_for
    assert reserve({"cart_id": "c9"}) == "inventory-reserve:c9"


def test_schema_matches_declared_tables(db: Database) -> None:
    """Regression caught: a column declared in code but missing from sql/ (or the reverse)."""
    from sqlalchemy import inspect

    import pipelines.domain.tables  # noqa: F401 - declares the business tables
    from resources.storage.db import metadata

    inspector = inspect(db.engine)
    for name in ("orders", "stock", "reservations", "shipments", "report_snapshots", "outbox",
                 "inbox", "job_attempts"):
        actual = {c["name"] for c in inspector.get_columns(name)}
        declared = {c.name for c in metadata.tables[name].columns}
        assert actual == declared, name
    assert upgrade(db) == []  # applying twice is a no-op
