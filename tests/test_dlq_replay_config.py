"""DLQ replays of records that carry no per-request run config, and canceled replay runs.

- A micro-batch failure is dead-lettered with ``run_config={}`` (the batch run names request
  ids, not the request). Its replay is built from the record (payload, key, request id) into a
  valid run of the per-request job, which succeeds once.
- A record whose run cannot be built (a ``run:`` record of a batch run, no payload) goes back
  to ``open`` with an audit entry saying why, instead of staying ``replaying`` forever.
- A replay run canceled by an operator reopens its record with its count increased.

Real Dagster instance, real job runs, SQLite and Postgres.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from engine.requests import RequestStore
from pipelines.domain.inventory import Inventory
from pipelines.ops import reserve_inventory_job, send_email_job
from pipelines.ops.batch import intake_micro_batch
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sensors.dlq import sweep
from sensors.intake import RequestsResource
from tests.job_workers import dagster_resources, replay_sensor


def _tick(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, url: str, cursor: str | None
) -> tuple[list[dg.RunRequest], str | None]:
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"dlq": DlqResource(database_url=url)}
    )
    result = sensor.evaluate_tick(context)
    return list(result.run_requests or []), result.cursor


def _status(requests: RequestStore, request_id: int) -> str:
    request = requests.get(request_id)
    assert request is not None
    return str(request.status)


def test_a_micro_batch_failure_replays_as_a_valid_per_request_run_once(
    db: Database, db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: a replay emitted with the record's empty run config (invalid for the job, the
    record stuck ``replaying`` and re-emitted every 600 s)."""
    instance = dg.DagsterInstance.ephemeral()
    resources: dict[str, Any] = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace
    )
    resources["requests"] = RequestsResource(database_url=db_url)
    requests = RequestStore(db)
    key = "inventory-reserve:cart-mb"
    payload = {"cart_id": "cart-mb", "items": [{"sku": "sku-mb", "quantity": 2}]}
    request = requests.enqueue(
        "reserve_inventory", key, payload, queue="light", correlation_id="corr-mb"
    ).request
    batch = intake_micro_batch.execute_in_process(
        run_config={"ops": {"execute_request_batch": {"config": {"request_ids": [request.id]}}}},
        resources=resources,
        instance=instance,
    )
    assert batch.success  # the step succeeds; only job_requests knows the request failed
    assert _status(requests, request.id) == "failed"
    store = DlqStore(db)
    sweep(instance, store, None)
    (record,) = store.list_records()
    assert record.run_config == {} and record.job_type == "reserve_inventory"

    Inventory(db).set_stock("sku-mb", 10)  # the cause is fixed
    store.request_replay([record.id], actor="test", idempotency=IdempotencyStore(db))
    sensor = replay_sensor(name="replay_cfg", max_per_tick=10, per_second=10.0)
    (rr,), cursor = _tick(sensor, instance, db_url, None)
    assert rr.job_name == "reserve_inventory"
    config = dg.validate_run_config(reserve_inventory_job, rr.run_config)
    op_config = config["ops"]["reserve_inventory_op"]["config"]
    assert op_config["payload"] is None and op_config["request_id"] == request.id  # no value
    stored = requests.get(request.id)  # the op reads the request it serves from its row
    assert stored is not None and (stored.payload, stored.key) == (payload, key)
    assert stored.correlation_id == "corr-mb"
    result = reserve_inventory_job.execute_in_process(
        run_config=rr.run_config, tags=rr.tags, resources=resources, instance=instance
    )
    assert result.success

    again, _ = _tick(sensor, instance, db_url, cursor)
    assert again == []
    assert store.get(record.id).status is DlqStatus.RESOLVED
    assert _status(requests, request.id) == "completed"
    assert [r.quantity for r in Inventory(db).reservations("cart-mb")] == [2]
    assert Inventory(db).stock("sku-mb")[1] == 2


def test_a_record_whose_run_cannot_be_built_goes_back_to_open(db: Database, db_url: str) -> None:
    """Catches: a record left ``replaying`` for good because its RunRequest is invalid (a batch
    job the sensor does not target, no payload to build a per-request run from)."""
    store = DlqStore(db)
    recorded = store.record_failure(
        FailureInfo(
            job_type="intake_micro_batch",
            dedupe_key="run:r-batch:",
            error_type="RunFailure.RUN_FAILURE",
            message="worker died",
            run_id="r-batch",
        )
    )
    store.request_replay([recorded.record.id], actor="test")
    sensor = replay_sensor(name="replay_cfg", max_per_tick=10, per_second=10.0)
    instance = dg.DagsterInstance.ephemeral()
    requests, _ = _tick(sensor, instance, db_url, None)
    assert requests == []
    after = store.get(recorded.record.id)
    assert after.status is DlqStatus.OPEN
    last = store.audit(after.id)[-1]
    assert (last["action"], last["from_status"], last["to_status"]) == (
        "replay_refused",
        "replaying",
        "open",
    )
    assert "intake_micro_batch" in last["detail"]


def test_a_later_failure_fills_an_empty_run_config_and_tags(db: Database) -> None:
    """Catches: a record first seen without run config (batch, sweep) never getting one."""
    store = DlqStore(db)
    base: dict[str, Any] = {
        "job_type": "send_email",
        "dedupe_key": "request:77",
        "error_type": "SMTPServerDisconnected",
        "message": "gone",
        "request_id": 77,
    }
    first = store.record_failure(FailureInfo(**base, run_id="r1")).record
    assert (first.run_config, first.tags) == ({}, {})
    run_config = {"ops": {"send_email_op": {"config": {"payload": {"x": 1}}}}}
    tags = {"sekali/key": "email:x"}
    second = store.record_failure(
        FailureInfo(**base, run_id="r2", run_config=run_config, tags=tags)
    ).record
    assert (second.run_config, second.tags) == (run_config, tags)
    other = {"ops": {"send_email_op": {"config": {"payload": {"x": 2}}}}}
    third = store.record_failure(FailureInfo(**base, run_id="r3", run_config=other)).record
    assert third.run_config == run_config  # a stored config is kept


def test_a_canceled_replay_run_reopens_its_record_with_its_count_increased(
    db: Database, db_url: str
) -> None:
    """Catches: settling only SUCCESS and FAILURE replay runs, so a replay an operator canceled
    leaves its record ``replaying`` forever (and it can never be replayed again)."""
    store = DlqStore(db)
    payload = {"template": "welcome", "user_id": "u5", "date": "2026-11-29", "to": "u5@a.example"}
    run_config = {"ops": {"send_email_op": {"config": {"payload": payload, "request_id": 5}}}}
    recorded = store.record_failure(
        FailureInfo(
            job_type="send_email",
            dedupe_key="request:5",
            error_type="SMTPServerDisconnected",
            message="gone",
            run_id="r-first",
            request_id=5,
            idempotency_key="email:welcome:u5:2026-11-29",
            payload=payload,
            run_config=run_config,
        )
    )
    record_id = recorded.record.id
    store.request_replay([record_id], actor="test")
    sensor = replay_sensor(name="replay_cancel", max_per_tick=10, per_second=10.0)
    instance = dg.DagsterInstance.ephemeral()
    (rr,), cursor = _tick(sensor, instance, db_url, None)
    run = instance.create_run_for_job(
        job_def=send_email_job, run_config=rr.run_config, tags=rr.tags
    )
    instance.report_run_canceled(run, message="canceled by an operator")
    canceled = instance.get_run_by_id(run.run_id)
    assert canceled is not None and canceled.status == dg.DagsterRunStatus.CANCELED

    assert _tick(sensor, instance, db_url, cursor)[0] == []
    after = store.get(record_id)
    assert after.status is DlqStatus.OPEN
    assert (after.failure_count, after.replay_count) == (2, 1)
    assert after.error_type == "RunEndedAroundRequest" and "ended CANCELED" in after.last_error
    assert store.audit(record_id)[-1]["action"] == "replay_failed"
    # It can be replayed again, under a new run key.
    assert store.request_replay([record_id], actor="test")[0].replay
    (rr2,), _ = _tick(sensor, instance, db_url, cursor)
    assert rr2.run_key == f"dlq-replay:{record_id}:2"
