"""What a failed run's page shows, read where the UI reads it: the ``STEP_FAILURE`` and
``RUN_FAILURE`` events in a real Dagster instance's event log (SQLite run storage in a temporary
Dagster home), from real runs of the per-request jobs.

A classified failure (a refused payload, a downstream that kept failing until the attempts ran
out) is expected: its events carry the class and the reason in one line, with no stack trace
and no chained error. An ``unknown`` one is a bug: its events keep the stack traces.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine import JobContext, JobType, Keying, Queue, Running
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from pipelines import ops
from pipelines.ops.request_job import request_job
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "dagster")) as inst:
        yield inst


def failure_errors(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any]:
    """The error each failure event of the run carries, as the event log stores it."""
    errors: dict[str, Any] = {}
    for kind in (dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE):
        (record,) = instance.all_logs(run_id, of_type=kind)
        assert record.dagster_event is not None
        data: Any = record.dagster_event.event_specific_data
        errors[kind.value] = data.error
    return errors


def assert_one_line(error: Any, first: str) -> None:
    """The class and the reason in one line, then Dagster's ``Error ID ...`` sentence; no
    frame, no cause, no context."""
    assert error is not None
    assert error.stack == [] and error.cause is None and error.context is None, error
    ours, dagsters = error.message.splitlines()
    assert ours.startswith("dagster._core.definitions.events.Failure: "), ours
    assert first in ours, ours
    assert dagsters.startswith("Error ID "), dagsters


def test_a_refused_payload_fails_the_run_in_one_line(
    instance: dg.DagsterInstance, sqlite_url: str, redis_url: str, namespace: str
) -> None:
    """Catches the run page of a permanent failure showing about 20 lines of Dagster frames and
    the validation error's own stack trace under one plain ``currency: must be ...``."""
    result = ops.charge_payment_job.execute_in_process(
        run_config={"ops": {"charge_payment_op": {"config": {"payload": {
            "order_id": "o-page-1", "amount_cents": 500, "currency": "EURO"}}}}},
        resources=dagster_resources(db_url=sqlite_url, redis_url=redis_url,
                                    namespace=namespace),
        instance=instance, raise_on_error=False,
    )
    assert not result.success
    for kind, error in failure_errors(instance, result.run_id).items():
        assert_one_line(error, "Failure: permanent: ValidationError: currency: "), kind


def test_attempts_exhausted_on_a_sick_downstream_fail_the_run_in_one_line(
    instance: dg.DagsterInstance, sqlite_url: str, redis_url: str, namespace: str,
    tmp_path: Path,
) -> None:
    """Catches a transient failure given up on (the gateway answered 503 every time) reading as
    a crash: stack traces of the HTTP client under the run's failure."""
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}", error_rate=1.0).start()
    try:
        result = ops.charge_payment_job.execute_in_process(
            run_config={"ops": {"charge_payment_op": {"config": {"payload": {
                "order_id": "o-page-2", "amount_cents": 500, "currency": "EUR"}}}}},
            resources=dagster_resources(
                db_url=sqlite_url, redis_url=redis_url, namespace=namespace,
                gateway_url=gateway.url,
                retry={"max_attempts": 2, "base_delay": 0.01, "max_delay": 0.02}),
            instance=instance, raise_on_error=False,
        )
    finally:
        gateway.stop()
    assert not result.success
    for kind, error in failure_errors(instance, result.run_id).items():
        assert_one_line(error, "Failure: transient: ")
        assert "(given up at attempt 2: attempts exhausted)" in error.message, kind


def test_a_run_naming_no_stored_request_fails_in_one_line(
    instance: dg.DagsterInstance, sqlite_url: str, redis_url: str, namespace: str
) -> None:
    """Catches an operator's mistake (a ``request_id`` that names no request) read as a crash."""
    result = ops.charge_payment_job.execute_in_process(
        run_config={"ops": {"charge_payment_op": {"config": {"request_id": 987654}}}},
        resources=dagster_resources(db_url=sqlite_url, redis_url=redis_url,
                                    namespace=namespace),
        instance=instance, raise_on_error=False,
    )
    assert not result.success
    for kind, error in failure_errors(instance, result.run_id).items():
        assert error is not None and error.stack == [] and error.cause is None, kind
        assert "request_id: job request 987654 does not exist" in error.message, kind


def _bug(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    return {"n": payload["missing"]}  # a KeyError: our own code met data it did not expect


BUGGY = JobType(
    name="page_bug_probe",
    queue=Queue.LIGHT,
    validate=dict,
    handler=_bug,
    side_effect=False,
    keying=Keying(key_for=lambda p: f"bug:{p['n']}", resource_id=lambda p: str(p["n"])),
    running=Running(max_runtime_seconds=60),
)


def test_an_unknown_failure_keeps_its_stack_traces(
    instance: dg.DagsterInstance, sqlite_url: str, redis_url: str, namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches the one-line form hiding a bug: an ``unknown`` error keeps the frames that say
    where it happened."""
    monkeypatch.setitem(JOB_TYPES, BUGGY.name, BUGGY)
    db = Database.from_url(sqlite_url)
    try:
        upgrade(db)
        request = RequestStore(db).enqueue(BUGGY.name, "bug:1", {"n": "1"}, queue="light")
    finally:
        db.dispose()
    result = request_job(BUGGY).execute_in_process(
        run_config={"ops": {BUGGY.op_name: {"config": {"request_id": request.id}}}},
        resources=dagster_resources(db_url=sqlite_url, redis_url=redis_url,
                                    namespace=namespace,
                                    retry={"max_attempts": 1, "max_unknown_attempts": 1}),
        instance=instance, raise_on_error=False,
    )
    assert not result.success
    for kind, error in failure_errors(instance, result.run_id).items():
        assert error is not None, kind
        assert "Failure: unknown: KeyError" in error.message and "Error ID" not in error.message
        assert error.stack and error.cause is not None, kind
        assert any("_bug" in frame for frame in error.cause.stack), error.cause.stack
