"""``execute_request``: the one code path every job runs through (per-request op, intake batch
ops, DLQ replay, chaos harness).

For one request it: validates the payload (a :class:`ValidationError` names the field and is
permanent), derives the idempotency key, claims it (a completed key returns its stored result:
``duplicate``), runs the job type's handler under a lease keeper that heartbeats, lets the
handler complete the key inside its final business transaction, and records the attempt in
``job_attempts`` with its outcome. On failure it records the error on the claim
(``store.fail(claim, exc, "permanent" | "transient")``; transient releases the key for the
retry), records the attempt with the outcome its :class:`pipelines.failures.FailurePath` decided,
and raises the original exception: the caller's failure path says how it is retried. The
attempt is recorded before the step succeeds or fails, never after: the record is the evidence
the ack relies on.

A holder whose lease was taken over while it worked (it was paused past its lease, another worker
took the key) raises :class:`LeaseLost`, chained to whatever it was failing with: its own error
means nothing now, the retry finds the key completed by the new owner (a suppressed duplicate)
or still in progress, and nothing is dead-lettered in the new owner's name.

Outcomes recorded: completed, duplicate_suppressed, retried, failed_permanent, dead_lettered
(via ``decide``), lease_lost, in_progress_elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines.attempts import Attempt, Outcome
from pipelines.failures import FailurePath
from pipelines.jobs.base import JobContext
from pipelines.privacy import personal_values
from pipelines.registry import get_job_type
from pipelines.services import Services
from resources.errors import AlreadyInProgress, LeaseLost, StoredFailure
from resources.idempotency import Completed
from resources.retry import ErrorClass, classify
from resources.telemetry.tracing import inject, set_attributes, span, tracing_enabled

logger = logging.getLogger(__name__)

Decide = Callable[[BaseException], str]
"""Maps a failure to the outcome to record: ``retried``, ``dead_lettered`` or
``failed_permanent``: :meth:`pipelines.failures.FailurePath.outcome`."""


@dataclass(frozen=True)
class RequestOutcome:
    """How a request ended without an exception."""

    status: str  # "completed" | "duplicate"
    result: Any
    key: str
    fence: int
    attempt_id: str


def execute_request(
    job_type: str,
    payload: dict[str, Any],
    *,
    services: Services,
    key: str | None = None,
    run_id: str | None = None,
    step: str | None = None,
    attempt: int = 0,
    correlation_id: str | None = None,
    request_id: int | None = None,
    decide: Decide | None = None,
    traceparent: str | None = None,
) -> RequestOutcome:
    """Run one request of ``job_type`` once per key. See the module docstring.

    The whole attempt is the ``sekali.execute`` span (key, resource, attempt, worker, fence,
    outcome): a child of ``traceparent`` (the request's own trace, in a batch of many) or else
    of the caller's current span (the run's).
    """
    with span(
        "sekali.execute", parent=traceparent, job_type=job_type, idempotency_key=key,
        run_id=run_id, step=step, attempt=attempt, request_id=request_id,
        correlation_id=correlation_id,
        worker=f"{socket.gethostname()}:{os.getpid()}",
    ):
        return _execute_request(
            job_type, payload, services=services, key=key, run_id=run_id, step=step,
            attempt=attempt, correlation_id=correlation_id, request_id=request_id, decide=decide,
        )


def _execute_request(
    job_type: str,
    payload: dict[str, Any],
    *,
    services: Services,
    key: str | None = None,
    run_id: str | None = None,
    step: str | None = None,
    attempt: int = 0,
    correlation_id: str | None = None,
    request_id: int | None = None,
    decide: Decide | None = None,
) -> RequestOutcome:
    jt = get_job_type(job_type)
    decide = decide or FailurePath(attempt=attempt).outcome
    personal = personal_values(jt, payload)
    record = services.attempts.new(
        jt.name,
        attempt=attempt,
        run_id=run_id,
        step=step or jt.op_name,
        correlation_id=correlation_id,
        request_id=request_id,
        idempotency_key=key,
        traceparent=inject(),
        personal=personal,
    )
    try:
        clean = jt.validate(dict(payload or {}))
        key = key or jt.key_for(clean)
        record.idempotency_key = key
        record.resource_id = jt.resource_id(clean)
        set_attributes(idempotency_key=key, resource_id=record.resource_id)
        started = time.perf_counter()
        with span("ledger.claim", idempotency_key=key):
            claimed = services.store.begin(key, payload=clean)
        record.add_duration("claim", time.perf_counter() - started)
    except AlreadyInProgress as exc:
        _finish(services, record, Outcome.IN_PROGRESS_ELSEWHERE, exc)
        raise
    except StoredFailure as exc:
        _finish(services, record, Outcome.FAILED_PERMANENT, exc)
        raise
    except Exception as exc:
        _finish(services, record, decide(exc), exc)
        raise

    if isinstance(claimed, Completed):
        set_attributes(fence=claimed.fence)
        if tracing_enabled():
            original = services.attempts.effect_traceparent(key)
            with span("sekali.duplicate", links=[original] if original else None):
                set_attributes(fence=claimed.fence)
        record.fence = claimed.fence
        record.claim_attempt = claimed.attempt
        record.status_before = record.status_after = "completed"
        _finish(services, record, Outcome.DUPLICATE_SUPPRESSED)
        return RequestOutcome("duplicate", claimed.result, key, claimed.fence, record.attempt_id)

    record.fence = claimed.fence
    record.claim_attempt = claimed.attempt
    record.takeover = claimed.takeover
    set_attributes(fence=claimed.fence, takeover=claimed.takeover)
    services.attempts.start(record)
    ctx = JobContext(
        services=services, claim=claimed, attempt=record, payload=clean,
        correlation_id=correlation_id,
    )
    try:
        with services.store.keep_alive(claimed) as keeper:
            ctx.keeper = keeper
            result = jt.handler(ctx, clean)
            if not ctx.completed:  # once completed, a late heartbeat's "lost" means nothing
                keeper.check()
                started = time.perf_counter()
                with span("ledger.complete", idempotency_key=key, fence=claimed.fence):
                    services.store.complete(claimed, result)
                record.add_duration("complete", time.perf_counter() - started)
    except LeaseLost as exc:
        _finish(services, record, Outcome.LEASE_LOST, exc)
        raise
    except Exception as exc:
        kind = "permanent" if classify(exc) is ErrorClass.PERMANENT else "transient"
        try:
            services.store.fail(claimed, exc, kind)
        except LeaseLost as lost:
            _finish(services, record, Outcome.LEASE_LOST, exc)
            raise lost from exc
        except Exception:  # noqa: BLE001 - the store is down: the lease expires on its own
            logger.exception("could not record the failure of %s on its claim", key)
        _finish(services, record, decide(exc), exc)
        raise
    _finish(services, record, Outcome.COMPLETED)
    if jt.downstream and services.retry_budget is not None:
        with contextlib.suppress(Exception):
            services.retry_budget.refund(jt.downstream)
    return RequestOutcome("completed", result, key, claimed.fence, record.attempt_id)


def _finish(
    services: Services, record: Attempt, outcome: str, error: BaseException | None = None
) -> None:
    set_attributes(outcome=outcome)
    kind = str(classify(error)) if error is not None else None
    services.attempts.finish(record, outcome, error=error, error_kind=kind)
