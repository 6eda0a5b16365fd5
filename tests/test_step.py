"""The step entry (:mod:`engine.step`) with its database gone: the failure path still decides.

The decision reads when the step's first attempt began (the time budget) from the attempts'
store; when that store is the very thing that failed, the decision must still end as a retry
(the attempts bound it), not raise out of the step: in Dagster a raise there fails the run
without a retry and dead-letters a request a plain retry would have finished.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine import JobContext, JobType, Keying, Queue, Running
from engine.attempts import AttemptRecorder, Outcome
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.services import Services
from engine.step import StepAttempt, StepResult, run_step
from engine.upkeep.reconciliation import Reconciler
from engine.upkeep.retention import purge_expired
from resources.dlq import DlqStatus, DlqStore
from resources.errors import StoreUnavailable, TransientJobError, ValidationError
from resources.idempotency import IdempotencyStore
from resources.retry import RetryPolicy
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import RetentionSettings
from sandbox.redis_server import free_port


def _step_without_a_database(amount_cents: int, attempt: int = 0) -> StepResult:
    """One charge step (0-based ``attempt`` of 3) whose store is a Postgres address nothing
    listens on."""
    db = Database.from_url(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone")
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(max_attempts=3))
    try:
        return run_step(
            services, StepAttempt(run_id="run-1", step="charge_payment_op", attempt=attempt),
            job_type="charge_payment",
            payload={"order_id": "o-1", "amount_cents": amount_cents, "currency": "EUR"},
            request_id=1,
        )
    finally:
        db.dispose()


def test_a_database_outage_is_retried_by_the_decision_not_raised_out_of_the_step() -> None:
    result = _step_without_a_database(100)
    assert isinstance(result.error, StoreUnavailable), result
    assert result.decision is not None and result.decision.retry, result.decision
    assert result.recorded is Outcome.RETRIED


def test_a_refused_payload_stays_permanent_while_the_database_is_away() -> None:
    """Catches a poison payload retried as transient (and dead-lettered as such when the outage
    outlasts its attempts) because its rejection row could not be written: the refusal does not
    depend on the database, and the step's dead letter keeps the payload."""
    result = _step_without_a_database(-5)
    assert isinstance(result.error, ValidationError), result
    assert result.error.field == "amount_cents"
    assert result.decision is not None and not result.decision.retry, result.decision
    assert result.recorded is Outcome.FAILED_PERMANENT


def _flaky(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    with ctx.services.db.transaction() as conn:  # the request rows' store breaks mid-step
        conn.exec_driver_sql("DROP TABLE request_cancels")
        conn.exec_driver_sql("DROP TABLE job_requests")
    raise TransientJobError("the downstream did not answer")


def test_a_last_attempt_that_cannot_settle_its_row_still_gives_up_classified(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a step whose last attempt fails while the database goes away raising that
    database error out of the step: settling the request row (failed, for the DLQ) needs the
    database too, and the raw error failed the step unclassified, so the run's request was
    dead-lettered as ``unknown`` (a bug) instead of ``transient``: a worker host cut off
    from the store mid-step (``sekali chaos --topology hosts``)."""
    monkeypatch.setitem(JOB_TYPES, "flaky_probe", JobType(
        name="flaky_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=_flaky,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"flaky:{p['n']}", resource_id=lambda p: p['n']),
        running=Running(max_runtime_seconds=60),
    ))
    db = Database.from_url(sqlite_url)
    upgrade(db)
    request = RequestStore(db).enqueue("flaky_probe", "flaky:1", {"n": "1"}, queue="light")
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(max_attempts=3))
    try:
        result = run_step(
            services, StepAttempt(run_id="run-1", step="flaky_probe_op", attempt=2),
            job_type="flaky_probe", payload={"n": "1"}, key=None, request_id=request.id,
        )
    finally:
        db.dispose()
    assert isinstance(result.error, TransientJobError), result
    assert result.decision is not None and not result.decision.retry, result.decision
    assert str(result.decision.error_class) == "transient"
    assert result.recorded is Outcome.DEAD_LETTERED
    assert result.dead_letter is None  # its row and record could not be written: not raised


def test_a_delivery_without_a_key_dead_letters_under_its_key_and_the_purge_keeps_it(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a dead letter of a delivery that named no key (a run's config, a broker's
    message: no ``job_requests`` row) written without the key its job type derives: nothing then
    pins the key, so once another delivery completed it the retention purge drops it while the
    record is open, and the record's replay claims the key afresh, fence 1 (below every fence the
    key wrote: ``sekali chaos`` retention-travel saw a charge completed twice, fences 11 and 1),
    and the reconciliation can never resolve the record (it judges it by its key)."""
    failures = {"left": 1}

    def _once(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
        if failures["left"]:
            failures["left"] -= 1
            raise TransientJobError("the downstream did not answer")
        return {"done": payload["n"]}

    monkeypatch.setitem(JOB_TYPES, "keyed_probe", JobType(
        name="keyed_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=_once,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"keyed:{p['n']}", resource_id=lambda p: p["n"]),
        running=Running(max_runtime_seconds=60),
    ))
    db = Database.from_url(sqlite_url)
    upgrade(db)
    store, dlq = IdempotencyStore(db), DlqStore(db)
    services = Services(db=db, store=store, attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(max_attempts=3))
    try:
        failed = run_step(  # its last attempt: given up, dead-lettered
            services, StepAttempt(run_id="delivery-1", step="keyed_probe_op", attempt=2),
            job_type="keyed_probe", payload={"n": "7"}, request_id=41,
        )
        assert failed.dead_letter is not None, failed
        record = dlq.get(failed.dead_letter.record_id)
        assert record.idempotency_key == "keyed:7", record

        done = run_step(  # the broker delivers it again: the key completes
            services, StepAttempt(run_id="delivery-2", step="keyed_probe_op"),
            job_type="keyed_probe", payload={"n": "7"}, request_id=41,
        )
        assert done.outcome is not None and done.outcome.status == "completed", done
        fence = store.records(["keyed:7"])["keyed:7"].fence

        later = time.time() + 40 * 86400
        reconciler = Reconciler(db, store=store, dlq=dlq, retention=RetentionSettings(),
                                clock=lambda: later)
        purge_expired(db, reconciler.expiries(), RetentionSettings())
        kept = store.records(["keyed:7"])
        assert "keyed:7" in kept, "the key was purged while its dead letter is open"
        assert kept["keyed:7"].fence == fence

        report = Reconciler(db, store=store, dlq=dlq).run()
        assert record.id in report.resolved_dead_letters
        assert dlq.get(record.id).status is DlqStatus.RESOLVED
    finally:
        db.dispose()


_checked: list[dict[str, Any]] = []


def _counting(payload: dict[str, Any]) -> dict[str, Any]:
    _checked.append(dict(payload))
    if not isinstance(payload.get("n"), str):
        raise ValidationError("n", "expected text", payload.get("n"))
    return {**payload, "normalised": True}


def _echo(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    return dict(payload)


@pytest.mark.parametrize("size", [1, 3])
def test_a_step_checks_each_payload_once_and_runs_it_as_admitted(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, size: int,
) -> None:
    """Catches the payload checked again after the step's validation boundary admitted it
    (``execute_request`` validating the raw payload a second time): one check per request, and
    the handler gets the payload as the boundary normalised it, for one request and a batch.
    A direct ``execute_request`` with a plain dict still checks it."""
    from engine.runtime import execute_request
    from engine.step import StepRequest, run_steps

    monkeypatch.setitem(JOB_TYPES, "counted_probe", JobType(
        name="counted_probe", queue=Queue.LIGHT, validate=_counting, handler=_echo,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"counted:{p['n']}", resource_id=lambda p: p["n"]),
        running=Running(max_runtime_seconds=60),
    ))
    db = Database.from_url(sqlite_url)
    upgrade(db)
    store = RequestStore(db)
    rows = [store.enqueue("counted_probe", f"counted:{i}", {"n": str(i)}, queue="light")
            for i in range(size)]
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db))
    _checked.clear()
    try:
        results = run_steps(
            services, StepAttempt(run_id="run-1", step="counted_probe_op", attempt=0),
            [StepRequest("counted_probe", {"n": str(i)}, None, row.id)
             for i, row in enumerate(rows)],
        )
        assert [r.outcome.status for r in results if r.outcome] == ["completed"] * size, results
        assert len(_checked) == size, _checked
        assert all(r.outcome and r.outcome.result["normalised"] for r in results), results
        _checked.clear()
        execute_request("counted_probe", {"n": "direct"}, services=services)
        assert len(_checked) == 1
    finally:
        db.dispose()
