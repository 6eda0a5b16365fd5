"""The step entry (:mod:`engine.step`) with its database gone: the failure path still decides.

The decision reads when the step's first attempt began (the time budget) from the attempts'
store; when that store is the very thing that failed, the decision must still end as a retry
(the attempts bound it), not raise out of the step: in Dagster a raise there fails the run
without a retry and dead-letters a request a plain retry would have finished.
"""

from __future__ import annotations

from engine.attempts import AttemptRecorder, Outcome
from engine.services import Services
from engine.step import StepAttempt, StepResult, run_step
from resources.errors import StoreUnavailable, ValidationError
from resources.idempotency import IdempotencyStore
from resources.retry import RetryPolicy
from resources.storage.db import Database
from sandbox.redis_server import free_port


def _step_without_a_database(amount_cents: int) -> StepResult:
    """One charge step whose store is a Postgres address nothing listens on."""
    db = Database.from_url(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone")
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(max_attempts=3))
    try:
        return run_step(
            services, StepAttempt(run_id="run-1", step="charge_payment_op", attempt=0),
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
