"""The DLQ in the Dagster UI: the ``dead_letters`` table and its check, published by the DLQ
sensors without a run; records resolved when their key completes elsewhere; ``dlq_operations``
with typed filters and a dry run that says what would happen to each record.

Real Dagster instance (SQLite storage), real app database (SQLite and Postgres).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine import tags as tag
from engine.requests import RequestStore
from pipelines.assets.dead_letters import CHECK_NAME, DEAD_LETTERS
from pipelines.ops import charge_payment_job
from pipelines.ops.dlq_ops import dlq_operations
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sensors.dlq import dead_letter_run
from tests.job_workers import replay_sensor

pytestmark = pytest.mark.dagster

KEY = dg.AssetKey(DEAD_LETTERS)


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


def _record(store: DlqStore, i: int, error_class: FailureClass, **extra: Any) -> int:
    info = FailureInfo(
        job_type="charge_payment", dedupe_key=f"request:{i}", error_type="GatewayRejected",
        message=f"card declined for order o-{i}", run_id=f"r-{i}", request_id=i,
        idempotency_key=f"payment:o-{i}", error_class=error_class, **extra,
    )
    return store.record_failure(info).record.id


def _tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, url: str) -> None:
    sensor.evaluate_tick(
        dg.build_sensor_context(instance=instance, resources={"dlq": DlqResource(database_url=url)})
    )


def _materializations(instance: dg.DagsterInstance) -> list[dict[str, Any]]:
    records = instance.fetch_materializations(KEY, limit=100).records
    return [
        {k: v.value for k, v in r.asset_materialization.metadata.items()}  # type: ignore[union-attr]
        for r in records
    ]


def _check(instance: dg.DagsterInstance) -> Any:
    record = instance.get_latest_asset_check_evaluation_record(dg.AssetCheckKey(KEY, CHECK_NAME))
    assert record is not None and record.evaluation is not None
    return record.evaluation


def test_the_sensors_publish_the_table_and_the_check_only_when_it_changes(
    db: Database, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Catches: a DLQ visible only from the CLI, a check that stays green while a permanent
    failure waits, and a publication every tick (an event per 30 s for nothing)."""
    store = DlqStore(db)
    permanent = _record(store, 1, FailureClass.PERMANENT)
    _record(store, 2, FailureClass.TRANSIENT)
    sensor = replay_sensor(name="replay_pub", max_per_tick=5, per_second=5.0)

    _tick(sensor, instance, db_url)
    (latest,) = _materializations(instance)
    table = latest["records"]
    assert [c.name for c in table.schema.columns] == [
        "id", "status", "job_type", "class", "reason", "count", "age", "key"
    ]
    rows = {r.data["id"]: r.data for r in table.records}
    assert rows[permanent]["class"] == "permanent" and rows[permanent]["key"] == "payment:o-1"
    assert rows[permanent]["reason"] == "GatewayRejected: card declined for order o-1"
    assert latest["unresolved"] == 2 and latest["class/permanent"] == 1
    evaluation = _check(instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert f"ids {permanent}" in evaluation.description

    _tick(sensor, instance, db_url)
    assert len(_materializations(instance)) == 1  # nothing changed: nothing published

    store.discard([permanent], actor="test", reason="order cancelled")
    _tick(sensor, instance, db_url)
    newest = _materializations(instance)[0]
    assert [r.data["id"] for r in newest["records"].records] == [permanent + 1]
    assert _check(instance).passed


def test_a_record_is_resolved_when_its_key_completes_elsewhere(
    db: Database, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Catches: a record left open (and replayable) after a late retry or a run launched by
    hand completed its key; and the opposite mistake, resolving a failure that came after the
    key completed (a conflicting payload under a used key: someone must look at it)."""
    store = DlqStore(db)
    idem = IdempotencyStore(db)
    conflict_key = "payment:o-2"
    idem.complete(idem.begin(conflict_key, payload={"a": 1}), {"charge_id": "ch_2"})
    late = _record(store, 1, FailureClass.TRANSIENT, failed_at=time.time() - 60)
    conflict = _record(store, 2, FailureClass.PERMANENT, failed_at=time.time() + 1)
    idem.complete(idem.begin("payment:o-1", payload={"a": 1}), {"charge_id": "ch_1"})

    _tick(replay_sensor(name="replay_res"), instance, db_url)
    assert store.get(late).status is DlqStatus.RESOLVED
    assert "completed elsewhere" in store.audit(late)[-1]["detail"]
    assert store.get(conflict).status is DlqStatus.OPEN


def test_a_run_that_died_before_tagging_its_outcome_is_tagged_dead_lettered(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches: a run killed mid-step showing no outcome in the runs list, and its request
    (taken ``running`` by the op, no decision made) left in no state a person can act on."""
    run = instance.create_run_for_job(
        job_def=charge_payment_job, tags={tag.KEY: "payment:o-9", tag.JOB_TYPE: "charge_payment"}
    )
    held = RequestStore(db).record_run(  # what the op writes first, as a Launchpad run's does
        "charge_payment", "payment:o-9", {"order_id": "o-9", "amount_cents": 5, "currency": "EUR"},
        queue="heavy", source="launchpad", run_id=run.run_id,
    )
    assert held is not None
    instance.add_run_tags(run.run_id, {tag.REQUEST_ID: str(held.id)})
    instance.report_run_failed(run, "worker killed")
    failed = instance.get_run_by_id(run.run_id)
    assert failed is not None
    (recorded,) = dead_letter_run(instance, failed, DlqStore(db), actor="test")
    tagged = instance.get_run_by_id(run.run_id)
    assert tagged is not None and tagged.tags[tag.OUTCOME] == "dead_lettered"
    assert tagged.tags[tag.DLQ_ID] == str(recorded.record.id)
    assert recorded.record.request_id == held.id and recorded.record.error_class == "transient"
    assert recorded.record.error_type == "RunEndedAroundRequest"
    after = RequestStore(db).get(held.id)
    assert after is not None and after.status == "failed"


def _ops(url: str, **config: Any) -> dg.ExecuteInProcessResult:
    return dlq_operations.execute_in_process(
        run_config={"ops": {"dlq_operation": {"config": config}}},
        resources={"dlq": DlqResource(database_url=url)},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def test_dlq_operations_dry_run_says_what_would_happen_to_each_record(
    db: Database, db_url: str
) -> None:
    """Catches: a dry run that only counts, and a job type filter that takes any string (a typo
    selects nothing and looks like an empty DLQ)."""
    store = DlqStore(db)
    first = _record(store, 1, FailureClass.TRANSIENT)
    second = _record(store, 2, FailureClass.TRANSIENT)
    store.request_replay([second], actor="test")

    result = _ops(db_url, action="replay", ids=[first, second])
    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    table = event.step_output_data.metadata["records"].value
    decisions = {r.data["id"]: r.data["decision"] for r in table.records}
    assert decisions[first].startswith("would replay [unknown: payment_gateway cannot answer")
    assert decisions[second].startswith("not replayed: status is replay_requested [")
    # the verdict: no gateway runs here, so whether the charge happened is unknown
    assert store.get(first).status is DlqStatus.OPEN

    with pytest.raises(dg.DagsterInvalidConfigError, match="job_type"):
        _ops(db_url, action="list", job_type="charge_paymnet")


def test_dlq_operations_says_what_a_listing_did(db: Database, db_url: str) -> None:
    """Catches: a listing that showed its record reported as "0 of 1 selected records:
    listed"."""
    _record(DlqStore(db), 1, FailureClass.PERMANENT)
    instance = dg.DagsterInstance.ephemeral()
    result = dlq_operations.execute_in_process(
        run_config={"ops": {"dlq_operation": {"config": {"action": "list"}}}},
        resources={"dlq": DlqResource(database_url=db_url)}, instance=instance,
    )
    said = [e.user_message for e in instance.all_logs(result.run_id)]
    assert "listed 1 selected records" in said
    assert not [m for m in said if "0 of 1" in m]
