"""The DLQ end to end against a real Dagster instance, real job runs and SQLite/Postgres.

Failed runs come from ``execute_in_process(raise_on_error=False)`` of the real per-request jobs;
sensors are evaluated with ``build_run_status_sensor_context`` / ``build_sensor_context`` against
the instance that holds those runs; the CLI is called through ``cli.main.main``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from cli.main import main as cli
from engine.failures import FailurePath
from engine.requests import RequestStore
from pipelines.definitions import dlq_sensor, dlq_sweep_sensor
from pipelines.domain.inventory import Inventory
from pipelines.ops import all_jobs
from resources.dagster_resources import DlqResource
from resources.dlq import (
    DlqStatus,
    DlqStore,
    FailureClass,
    FailureInfo,
    fingerprint,
    normalise_message,
)
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sensors.dlq import sweep
from tests.job_workers import dagster_resources, replay_sensor

JOBS = {job.name: job for job in all_jobs}


def launch(instance: dg.DagsterInstance, request: dg.RunRequest, resources: dict[str, Any]) -> bool:
    """What the daemon would do with a sensor's RunRequest, in process."""
    assert request.job_name is not None
    result = JOBS[request.job_name].execute_in_process(
        run_config=request.run_config,
        tags=request.tags,
        resources=resources,
        instance=instance,
        raise_on_error=False,
    )
    return bool(result.success)


def run_failure_tick(instance: dg.DagsterInstance, run_id: str, dlq: DlqResource) -> None:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    failure = instance.all_logs(run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[-1]
    context = dg.build_run_status_sensor_context(
        sensor_name="dlq_sensor",
        dagster_event=failure.dagster_event,
        dagster_instance=instance,
        dagster_run=run,
        resources={"dlq": dlq},
    )
    dlq_sensor(context.for_run_failure())


def replay_tick(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    dlq: DlqResource,
    cursor: str | None = None,
) -> tuple[list[dg.RunRequest], str | None]:
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"dlq": dlq})
    result = sensor.evaluate_tick(context)
    return list(result.run_requests or []), result.cursor


@pytest.fixture
def instance() -> dg.DagsterInstance:
    return dg.DagsterInstance.ephemeral()


@pytest.fixture
def setup(db: Database, db_url: str, redis_url: str, namespace: str) -> dict[str, Any]:
    return {
        "db": db,
        "url": db_url,
        "dlq": DlqResource(database_url=db_url),
        "store": DlqStore(db),
        "resources": dagster_resources(db_url=db_url, redis_url=redis_url, namespace=namespace),
    }


def _reserve(
    instance: dg.DagsterInstance, s: dict[str, Any], cart: str, request_id: int, key: str
) -> dg.ExecuteInProcessResult:
    return JOBS["reserve_inventory"].execute_in_process(
        run_config={
            "ops": {
                "reserve_inventory_op": {
                    "config": {
                        "payload": {"cart_id": cart, "items": [{"sku": "sku-late", "quantity": 2}]},
                        "request_id": request_id,
                    }
                }
            }
        },
        tags={
            "sekali/key": key,
            "sekali/request_id": str(request_id),
            "sekali/correlation_id": f"corr-{cart}",
        },
        resources=s["resources"],
        instance=instance,
        raise_on_error=False,
    )


def test_permanent_failure_lands_once_and_a_cli_replay_succeeds_once(
    instance: dg.DagsterInstance, setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: one record per run instead of per request, a replay that runs twice, a replay
    that does not reset the failed key (StoredFailure forever), a second replay request acting."""
    s = setup
    requests = RequestStore(s["db"])
    key = "inventory-reserve:cart-1"
    payload = {"cart_id": "cart-1", "items": [{"sku": "sku-late", "quantity": 2}]}
    request = requests.enqueue("reserve_inventory", key, payload, queue="light").request
    result = _reserve(instance, s, "cart-1", request.id, key)
    assert not result.success
    assert requests.get(request.id).status == "failed"  # the request follows its run

    # The run-failure sensor sees the run twice, the sweep once more: one record, one failure.
    for _ in range(2):
        run_failure_tick(instance, result.run_id, s["dlq"])
    sweep(instance, s["store"], None)
    records = s["store"].list_records()
    assert len(records) == 1
    record = records[0]
    assert record.status is DlqStatus.OPEN
    assert record.error_class == FailureClass.PERMANENT
    assert record.error_type == "UnknownSku"
    assert record.failure_count == 1
    assert record.idempotency_key == key and record.request_id == request.id
    assert record.correlation_id == "corr-cart-1"
    assert len(record.fingerprint) == 16
    assert IdempotencyStore(s["db"]).get(key).status == "failed"

    # The cause is fixed; an operator asks for a replay (dry run first: changes nothing).
    Inventory(s["db"]).set_stock("sku-late", 10)
    assert cli(["dlq", "replay", str(record.id), "--url", s["url"], "--dry-run"]) == 0
    assert "would replay" in capsys.readouterr().out
    assert s["store"].get(record.id).status is DlqStatus.OPEN
    assert cli(["dlq", "replay", str(record.id), "--url", s["url"], "--actor", "ops@test"]) == 0
    assert IdempotencyStore(s["db"]).get(key).status == "retryable"
    assert cli(["dlq", "replay", str(record.id), "--url", s["url"]]) == 1  # already requested

    sensor = replay_sensor(name="replay_test", max_per_tick=10, per_second=10.0)
    run_requests, cursor = replay_tick(sensor, instance, s["dlq"])
    assert [r.run_key for r in run_requests] == [f"dlq-replay:{record.id}:1"]
    assert run_requests[0].tags["sekali/key"] == key
    assert launch(instance, run_requests[0], s["resources"])

    again, cursor = replay_tick(sensor, instance, s["dlq"], cursor)
    assert again == []
    assert s["store"].get(record.id).status is DlqStatus.RESOLVED
    # A second replay request of the resolved record does nothing, and nothing is launched.
    assert cli(["dlq", "replay", str(record.id), "--url", s["url"]]) == 1
    assert replay_tick(sensor, instance, s["dlq"], cursor)[0] == []

    assert [r.quantity for r in Inventory(s["db"]).reservations("cart-1")] == [2]
    assert Inventory(s["db"]).stock("sku-late")[1] == 2
    assert requests.get(request.id).status == "completed"  # and the replay that served it
    actions = [a["action"] for a in s["store"].audit(record.id)]
    assert actions == [
        "dead_lettered", "replay_requested", "replay_skipped", "replay_launched", "resolved",
        "replay_skipped",  # every replay asked for is audited, a no-op too (who tried, why not)
    ]

    capsys.readouterr()
    assert cli(["dlq", "show", str(record.id), "--url", s["url"], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "resolved" and shown["audit"][1]["actor"] == "ops@test"
    assert cli(["dlq", "list", "--url", s["url"], "--json", "--status", "all"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [record.id]


def test_a_failed_replay_reopens_the_record_with_its_count_increased(
    instance: dg.DagsterInstance, setup: dict[str, Any]
) -> None:
    """Catches: a failing replay lost (record stuck replaying) or counted as a new record."""
    s = setup
    requests = RequestStore(s["db"])
    key = "inventory-reserve:cart-2"
    payload = {"cart_id": "cart-2", "items": [{"sku": "sku-late", "quantity": 2}]}
    request = requests.enqueue("reserve_inventory", key, payload, queue="light").request
    first = _reserve(instance, s, "cart-2", request.id, key)
    run_failure_tick(instance, first.run_id, s["dlq"])
    (record,) = s["store"].list_records()
    s["store"].request_replay([record.id], actor="test", idempotency=IdempotencyStore(s["db"]))
    sensor = replay_sensor(name="replay_test", max_per_tick=10, per_second=10.0)
    (rr,), cursor = replay_tick(sensor, instance, s["dlq"])
    assert not launch(instance, rr, s["resources"])  # the cause was not fixed
    replay_run = instance.get_runs(dg.RunsFilter(tags={"sekali/dlq_id": str(record.id)}))[0]
    run_failure_tick(instance, replay_run.run_id, s["dlq"])
    replay_tick(sensor, instance, s["dlq"], cursor)  # settling again changes nothing
    after = s["store"].get(record.id)
    assert after.status is DlqStatus.OPEN
    assert (after.failure_count, after.replay_count) == (2, 1)
    assert len(s["store"].list_records(status=[str(x) for x in DlqStatus])) == 1


def test_the_sweep_dead_letters_what_the_run_failure_sensor_missed(
    instance: dg.DagsterInstance, setup: dict[str, Any]
) -> None:
    """Catches: a DLQ fed only by the run-failure sensor (its first tick only sets the cursor,
    a raising tick skips its run), and micro-batch failures that never fail a run."""
    s = setup
    requests = RequestStore(s["db"])
    key = "inventory-reserve:cart-3"
    request = requests.enqueue(
        "reserve_inventory",
        key,
        {"cart_id": "cart-3", "items": [{"sku": "nope", "quantity": 1}]},
        queue="light",
    ).request
    failed = _reserve(instance, s, "cart-3", request.id, key)
    assert not failed.success
    # A batch member that failed without failing its run: only job_requests knows (the failure
    # path marked it failed with the class it decided).
    batch = requests.enqueue("send_email", "email:x:u1:2026-11-29", {"x": 1}, queue="light").request
    FailurePath(retries_here=False).settle_request(
        requests, batch.id, ValidationError("template", "missing"), run_id=None
    )
    # The sensor never saw either (its first tick only set the cursor). One sweep tick:
    context = dg.build_sensor_context(instance=instance, resources={"dlq": s["dlq"]})
    dlq_sweep_sensor(context)
    by_request = {r.request_id: r for r in s["store"].list_records()}
    assert set(by_request) == {request.id, batch.id}
    assert by_request[batch.id].error_class == FailureClass.PERMANENT
    assert by_request[request.id].error_type == "UnknownSku"
    # The next sweep (from its cursor) finds nothing new.
    assert sweep(instance, s["store"], None)[1] == 0
    assert all(r.failure_count == 1 for r in s["store"].list_records())


def test_fingerprint_groups_by_cause_not_by_ids() -> None:
    """Catches: fingerprints that split one cause per order id, uuid or address."""
    a = fingerprint(
        "KeyError",
        "order 1234 missing in 0xdeadbeef00 6f1c2c7e-1b7e-4d0b-9a4e-12ab34cd56ef",
        "payment.py:charge",
    )
    b = fingerprint(
        "KeyError",
        "order 99 missing in 0x1 0b5c2c7e-1b7e-4d0b-9a4e-12ab34cd56ff",
        "payment.py:charge",
    )
    assert a == b
    assert a != fingerprint("KeyError", "order 99 missing", "payment.py:refund")
    assert normalise_message("sku 12 of cart c-7f3a9b2e11") == "sku <n> of cart c-<hex>"


def test_concurrent_record_failure_makes_one_record(db: Database, tmp_path: Path) -> None:
    """Catches: two sensors (or a sensor and the sweep) racing into two records for one request."""
    from concurrent.futures import ThreadPoolExecutor

    store = DlqStore(db)

    def record(i: int) -> bool:
        info = FailureInfo(
            job_type="send_email",
            dedupe_key="request:7",
            error_type="X",
            message="boom",
            run_id=f"run-{i % 5}",
            request_id=7,
        )
        return store.record_failure(info).created

    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(record, range(40)))
    assert sum(created) == 1
    (only,) = store.list_records()
    assert only.failure_count == 5
    assert sorted(store.failures(only.id)) == [f"run-{i}" for i in range(5)]
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM dlq_audit")).scalar() == 5


def test_runs_dagster_will_retry_are_not_dead_lettered(
    instance: dg.DagsterInstance, setup: dict[str, Any]
) -> None:
    """Catches: a record (and a replay) for a run the run-retry daemon is about to retry,
    which would run the request twice at once: its worker died around the request (no step
    decided on it), and the retry decides."""
    s = setup
    requests = RequestStore(s["db"])
    payload = {"cart_id": "cart-r", "items": [{"sku": "none", "quantity": 1}]}
    run = instance.create_run_for_job(
        job_def=JOBS["reserve_inventory"], tags={"dagster/will_retry": "true"},
        run_config={"ops": {"reserve_inventory_op": {"config": {"payload": payload}}}},
    )
    held = requests.record_run("reserve_inventory", "inventory-reserve:cart-r", payload,
                               queue="light", source="launchpad", run_id=run.run_id)
    assert held is not None
    instance.add_run_tags(run.run_id, {"sekali/request_id": str(held.id)})
    instance.report_run_failed(run, "worker killed")
    run_failure_tick(instance, run.run_id, s["dlq"])
    sweep(instance, s["store"], None)
    assert s["store"].list_records() == []
    after = requests.get(held.id)
    assert after is not None and after.status == "running"  # the retry takes it
    # The same run without a retry coming: its request is dead-lettered, transient.
    instance.add_run_tags(run.run_id, {"dagster/will_retry": "false"})
    sweep(instance, s["store"], None)
    (record,) = s["store"].list_records()
    assert record.request_id == held.id and record.error_class == FailureClass.TRANSIENT


def test_a_copys_transient_failure_keeps_the_final_failure_a_record_holds(db: Database) -> None:
    """At-least-once delivery runs copies of a request: one may give up on a transient error
    (the key held by another worker, the database away) after another copy's claim decided the
    key's fate for good (a crash loop). Catches the copy's failure relabelling the record
    transient, which tells the operator to replay a crash loop: it is counted, the error stays;
    a stronger failure still replaces a transient one, and a failed replay of the record
    carries its own error."""
    store = DlqStore(db)

    def failure(run: str, error_type: str, eclass: FailureClass, **extra: Any) -> FailureInfo:
        return FailureInfo(job_type="award_loyalty_points", dedupe_key="request:10",
                           error_type=error_type, message=f"{error_type} in {run}",
                           run_id=run, error_class=eclass, request_id=10, **extra)

    store.record_failure(failure("copy-a", "CrashLoop", FailureClass.CRASH_LOOP))
    after = store.record_failure(
        failure("copy-b", "AlreadyInProgress", FailureClass.TRANSIENT)).record
    assert after.error_class == FailureClass.CRASH_LOOP and after.error_type == "CrashLoop"
    assert after.last_error == "CrashLoop in copy-a" and after.failure_count == 2
    assert sorted(store.failures(after.id)) == ["copy-a", "copy-b"]

    other = failure("first", "StoreUnavailable", FailureClass.TRANSIENT)
    store.record_failure(replace(other, dedupe_key="request:11", request_id=11))
    stronger = store.record_failure(replace(
        failure("second", "CrashLoop", FailureClass.CRASH_LOOP),
        dedupe_key="request:11", request_id=11)).record
    assert stronger.error_class == FailureClass.CRASH_LOOP and stronger.failure_count == 2

    with db.transaction() as conn:  # a replay of the first record under way
        conn.execute(text("UPDATE dlq_records SET status = 'replaying' WHERE id = :i"),
                     {"i": after.id})
    replayed = store.record_failure(failure("replay-1", "StoreUnavailable",
                                            FailureClass.TRANSIENT, dlq_id=after.id)).record
    assert replayed.status == "open" and replayed.error_class == FailureClass.TRANSIENT
