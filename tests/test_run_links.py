"""Runs and dead letters linked both ways: the failed run names its DLQ record
(``sekali/dlq_id``, ``sekali/outcome=dead_lettered``) and the record names its run.

Real Dagster instance (SQLite run storage), real app database (SQLite and Postgres), real Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from engine import tags as tag
from engine.intake import enqueue
from engine.requests import RequestStatus, RequestStore
from pipelines.ops import charge_payment_job
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sensors.dlq import dead_letter_run, sweep
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


def _launch(
    instance: dg.DagsterInstance, resources: dict[str, object], payload: dict[str, object]
) -> dg.ExecuteInProcessResult:
    return charge_payment_job.execute_in_process(
        run_config={"ops": {"charge_payment_op": {"config": {"payload": payload}}}},
        instance=instance, resources=resources, raise_on_error=False,
    )


def test_a_dead_lettered_run_names_its_record_and_the_record_its_run(
    db: Database, db_url: str, redis_url: str, namespace: str, instance: dg.DagsterInstance
) -> None:
    """Catches: a failed run that keeps ``sekali/outcome=failed`` with no ``sekali/dlq_id`` once
    its DLQ record exists (the runs list cannot say where the failure went), for a permanent
    refusal and a transient failure alike, whichever sensor made the record."""
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace,
        gateway_url="http://127.0.0.1:9",  # nothing listens: transient, every attempt
    )
    refused = _launch(instance, resources, {"order_id": "o-zero", "amount_cents": 0})
    down = _launch(instance, resources, {"order_id": "o-down", "amount_cents": 100})
    assert not refused.success and not down.success
    store = DlqStore(db)

    run = instance.get_run_by_id(refused.run_id)
    assert run is not None
    (recorded,) = dead_letter_run(instance, run, store, actor="test")
    _, created, _ = sweep(instance, store, None)  # the sweep links the other run
    assert created == 0  # both records were written where their failures were decided

    by_run = {r.run_id: r for r in store.list_records()}
    outcomes = {refused.run_id: tag.RunOutcome.FAILED, down.run_id: tag.RunOutcome.DEAD_LETTERED}
    for result in (refused, down):
        tagged = instance.get_run_by_id(result.run_id)
        assert tagged is not None
        record = by_run[result.run_id]
        assert tagged.tags[tag.OUTCOME] == str(outcomes[result.run_id])  # refused / gave up
        assert tagged.tags[tag.DLQ_ID] == str(record.id)
    assert by_run[refused.run_id].id == recorded.record.id
    filtered = instance.get_runs(
        filters=dg.RunsFilter(tags={tag.DLQ_ID: str(recorded.record.id)})
    )
    assert [r.run_id for r in filtered] == [refused.run_id]

    # seen again (the sweep's overlap): nothing changes, the run keeps its link
    sweep(instance, store, None)
    assert len(store.list_records()) == 2


def test_a_launchpad_run_has_its_request_and_a_cancelled_one_runs_nothing(
    db: Database, db_url: str, redis_url: str, namespace: str, instance: dg.DagsterInstance,
    gateway: GatewayServer,
) -> None:
    """Catches: runs launched by hand missing from ``sekali requests`` (no request record, no
    source), and a request cancelled before it ran that a run launched by hand under the same
    key still charges."""
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url,
    )
    store = RequestStore(db)
    done = _launch(instance, resources, {"order_id": "o-hand", "amount_cents": 300})
    assert done.success
    request = store.get_by_key("payment:o-hand")
    assert request is not None
    assert (request.status, request.source, request.run_id) == (
        RequestStatus.COMPLETED, "launchpad", done.run_id)
    run = instance.get_run_by_id(done.run_id)
    assert run is not None and run.tags[tag.REQUEST_ID] == str(request.id)

    payload = {"order_id": "o-stop", "amount_cents": 400, "currency": "EUR"}
    waiting = enqueue("charge_payment", payload, db=db).request
    store.cancel(waiting.id, by="ops@example", reason="ordered twice")
    again = _launch(instance, resources, payload)
    assert again.success
    tags = instance.get_run_by_id(again.run_id).tags  # type: ignore[union-attr]
    assert tags[tag.OUTCOME] == str(tag.RunOutcome.CANCELLED)
    assert tags[tag.CANCELLED_BY] == "ops@example"
    assert len(gateway.charges()) == 1
    assert store.get(waiting.id).status is RequestStatus.CANCELLED  # type: ignore[union-attr]


def test_request_states_say_what_happened(db: Database) -> None:
    """Catches: a dead-lettered request listed as ``failed``, an amended one (a newer version
    carries its intent) read as ``failed`` or ``discarded``, and states written that the
    previous release could not read (they are derived; the stored status stays ``failed``)."""
    store = RequestStore(db)
    ids = [store.enqueue("send_email", f"k{i}", {"n": i}, queue="light").id for i in range(4)]
    kept, amended, plain, waiting = ids
    for request_id in (kept, amended, plain):
        store.mark_running(request_id)
        store.mark_failed(request_id, "SmtpRefused: 550")
    DlqStore(db).record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{kept}", error_type="SmtpRefused",
        message="550", run_id="r", request_id=kept, error_class=FailureClass.PERMANENT))
    with db.transaction() as conn:
        store.supersede(amended, "k1#v2", conn=conn)
    states = store.states(store.get_many(ids))
    assert states == {kept: "dead_lettered", amended: "superseded", plain: "failed",
                      waiting: "pending"}
    assert {r.status for r in store.get_many([kept, amended])} == {RequestStatus.FAILED}
