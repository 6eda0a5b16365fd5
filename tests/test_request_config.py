"""The typed launch config of the per-request jobs: every job opens on a valid example, Dagster
refuses bad values before a run exists (naming the field), and the intake and DLQ replays make
config that fits, including from run configs stored in the old free-form shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine.contract import PayloadField
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore
from pipelines import ops
from pipelines.ops import charge_payment_job
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sensors.intake import IntakeMode, IntakePolicy, evaluate_intake
from tests.job_workers import dagster_resources, replay_sensor

pytestmark = pytest.mark.dagster


def _names(fields: tuple[PayloadField, ...]) -> set[str]:
    return {f.name for f in fields}


@pytest.mark.parametrize("job", ops.all_jobs, ids=lambda j: j.name)
def test_every_job_opens_on_a_valid_example_its_validate_accepts(job: dg.JobDefinition) -> None:
    """Catches: a launch form that opens on "Missing required config entry", an example the
    job type itself would refuse, and declared fields drifting from what validate accepts."""
    jt = JOB_TYPES[job.name]
    resolved = dg.validate_run_config(job, None)
    assert resolved["ops"][jt.op_name]["config"]["payload"] == jt.presentation.example
    clean = jt.validate(dict(jt.presentation.example))
    assert set(clean) == _names(jt.presentation.fields)
    assert set(jt.presentation.result_fields)


BAD = [
    ("charge_payment", {"order_id": "o-1", "amount_cents": "lots"}, "amount_cents"),
    ("charge_payment", {"amount_cents": 5}, "order_id"),
    ("charge_payment", {"order_id": "o-1", "amount_cents": 5, "colour": "red"}, "colour"),
    ("send_email", {"template": "nope", "user_id": "u", "date": "2026-11-29", "to": "a@b.c"},
     "template"),
    ("send_email", {"template": "welcome", "user_id": "u", "date": "2026-11-29", "to": "a@b.c",
                    "context": {"n": {"deep": 1}}}, "context"),
    ("reserve_inventory", {"cart_id": "c", "items": [{"sku": "s", "quantity": "x"}]}, "quantity"),
    ("rebuild_report_cache", {"report": "everything", "as_of": "t"}, "report"),
]


@pytest.mark.parametrize(("job_type", "payload", "field"), BAD)
def test_bad_values_are_refused_before_launch_naming_the_field(
    job_type: str, payload: dict[str, Any], field: str
) -> None:
    """Catches: a free-form payload map that launches anything and fails only inside the run."""
    job = next(j for j in ops.all_jobs if j.name == job_type)
    with pytest.raises(dg.DagsterInvalidConfigError) as refused:
        dg.validate_run_config(
            job, {"ops": {f"{job_type}_op": {"config": {"payload": payload}}}}
        )
    assert field in str(refused.value)


def test_a_run_config_stored_in_the_old_free_form_shape_still_replays(
    db: Database, db_url: str, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Catches: a DLQ record of a run launched before the typed config (a number for
    ``order_id``, a lower-case currency: the job type accepted both) refused by the new class
    and left unreplayable."""
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    try:
        old = {"payload": {"order_id": 4711, "amount_cents": 990, "currency": "eur"}}
        key = "payment:4711"
        store = DlqStore(db)
        idem = IdempotencyStore(db)
        clean = {"order_id": "4711", "amount_cents": 990, "currency": "EUR"}
        idem.fail(idem.begin(key, payload=clean), "gateway down", "transient")
        recorded = store.record_failure(
            FailureInfo(
                job_type="charge_payment", dedupe_key=f"key:charge_payment:{key}",
                error_type="GatewayUnavailable", message="503", run_id="r-old",
                idempotency_key=key, payload=old["payload"],
                run_config={"ops": {"charge_payment_op": {"config": old}}},
                tags={"sekali/correlation_id": "corr-old"},
            )
        )
        store.request_replay([recorded.record.id], actor="test", idempotency=idem)
        instance = dg.DagsterInstance.ephemeral()
        sensor = replay_sensor(name="replay_old", max_per_tick=5, per_second=5.0)
        context = dg.build_sensor_context(
            instance=instance, resources={"dlq": DlqResource(database_url=db_url)}
        )
        (rr,) = sensor.evaluate_tick(context).run_requests or []
        config = rr.run_config["ops"]["charge_payment_op"]["config"]
        assert set(config) == {"request_id"}  # no payload value in the run's config
        row = RequestStore(db).get(config["request_id"])  # the replay made it a request first
        assert row is not None and row.payload == clean and row.key == key
        result = charge_payment_job.execute_in_process(
            run_config=rr.run_config, tags=rr.tags, instance=instance,
            resources=dagster_resources(
                db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url
            ),
        )
        assert result.success
        assert len(gateway.charges()) == 1
        sensor.evaluate_tick(
            dg.build_sensor_context(
                instance=instance, resources={"dlq": DlqResource(database_url=db_url)}
            )
        )
        assert store.get(recorded.record.id).status is DlqStatus.RESOLVED
    finally:
        gateway.stop()


def test_the_intake_fails_a_request_that_cannot_make_a_valid_run_and_launches_the_rest(
    db: Database,
) -> None:
    """Catches: one stored payload the typed config refuses failing every intake tick (nothing
    else launched, the request neither run nor dead-lettered)."""
    requests = RequestStore(db)
    bad = requests.enqueue(
        "charge_payment", "payment:o-bad", {"order_id": "o-bad", "amount_cents": "lots"},
        queue="heavy",
    ).request
    good = requests.enqueue(
        "charge_payment", "payment:o-good", {"order_id": "o-good", "amount_cents": 5},
        queue="heavy",
    ).request
    context = dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral())
    result = evaluate_intake(context, requests,
                             IntakePolicy(default_mode=IntakeMode.PER_REQUEST))
    (rr,) = result.run_requests or []
    assert rr.run_key == "intake:payment:o-good"
    dg.validate_run_config(charge_payment_job, rr.run_config)
    failed = requests.get(bad.id)
    assert failed is not None and failed.status is RequestStatus.FAILED
    assert "amount_cents" in (failed.last_error or "") and failed.error_class == "permanent"
    launched = requests.get(good.id)
    assert launched is not None and launched.status is RequestStatus.LAUNCHED
