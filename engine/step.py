"""The step entry: what one delivery of one request runs, wherever it is delivered.

The per-request Dagster op (:mod:`pipelines.ops.request_job`) is a thin adapter over
:func:`run_step`, and the chaos harness's workers call the same function for each delivery, so
the proof exercises the path that ships: the validation boundary, the request's status, the
claim, the concurrency slots (taken by the handler through its context), the handler, the one
failure decision (:class:`engine.failures.FailurePath` with the services' :class:`RetryPolicy`
and the shared :class:`RetryBudget`), and the request settled from that decision. No lock is
taken around it: the idempotency claim and its fence are the only mutual exclusion.

Nothing here raises for a failed attempt. :class:`StepResult` carries the error and the
decision already recorded, and the caller turns it into its own signal (Dagster's
``RetryRequested`` / ``Failure``, or a broker's requeue / dead letter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.attempts import Outcome
from engine.failures import FailurePath
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore
from engine.runtime import RequestOutcome, execute_request
from engine.services import Services
from engine.validation import ValidationError, admit, check_id
from resources.errors import RequestCancelled
from resources.retry import RetryDecision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepAttempt:
    """Which attempt this is: the run (a Dagster run, a broker's delivery), the step, and the
    0-based attempt number (Dagster's ``retry_number``). The policy's time budget counts from
    the first recorded attempt of the same run and step."""

    run_id: str
    step: str
    attempt: int = 0


@dataclass(frozen=True)
class StepResult:
    """How a step's attempt ended: ``outcome`` on success; else the ``error``, the path's
    ``decision`` on it (retry with a delay, or give up with a reason) and the attempt's
    recorded outcome (retried, dead_lettered or failed_permanent)."""

    outcome: RequestOutcome | None = None
    error: BaseException | None = None
    decision: RetryDecision | None = None
    recorded: Outcome | None = None
    path: FailurePath | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def failure_path(services: Services, job_type: str, at: StepAttempt) -> FailurePath:
    """The failure path of this attempt: the services' policy and budget, the job type's
    downstream (an unknown type fails in the runtime, naming the field), and the step's first
    attempt for the time budget."""
    known = JOB_TYPES.get(job_type)
    return FailurePath(
        attempt=at.attempt,
        policy=services.retry_policy,
        budget=services.retry_budget,
        downstream=known.downstream if known is not None else None,
        first_started=lambda: services.attempts.first_started(at.run_id, at.step),
    )


def _failed(
    path: FailurePath, exc: BaseException,
    on_failure: Callable[[StepResult], None] | None = None,
) -> StepResult:
    """The path's decision on ``exc``, told to ``on_failure`` first."""
    result = StepResult(error=exc, decision=path.decide(exc), recorded=path.outcome(exc),
                        path=path)
    if on_failure is not None:
        on_failure(result)
    return result


def admit_step(
    services: Services,
    at: StepAttempt,
    *,
    job_type: str,
    payload: Any,
    key: Any,
    source: str,
    request_id: Any = None,
    correlation_id: Any = None,
) -> StepResult | None:
    """The validation boundary before a step runs a request it did not get from ``enqueue``
    (a run's config, a delivery, a request read back by a batch step). None: admitted. A
    refusal runs nothing: it is kept in ``job_rejections``, recorded as a ``failed_permanent``
    attempt, the request row (if any) is marked failed, and the result says so (permanent,
    never retried). ``job_type`` is the step's own, never the caller's input."""
    requests = RequestStore(services.db)
    if callable(getattr(payload, "model_dump", None)):  # a typed run config's payload model
        payload = payload.model_dump(mode="json")
    try:
        admit(requests, job_type, payload, key, source=source, request_id=request_id,
              correlation_id=correlation_id, kept_elsewhere=True)
    except ValidationError as exc:
        path = failure_path(services, job_type, at)
        row_id = request_id if request_id is not None and _is_row_id(request_id) else None
        try:
            record = services.attempts.new(  # the refused attempt is recorded (invariant 6)
                job_type, attempt=at.attempt, run_id=at.run_id, step=at.step, request_id=row_id,
            )
            services.attempts.finish(
                record, path.outcome(exc), error=exc,
                error_kind=str(path.decide(exc).error_class),
            )
            if row_id is not None:
                path.settle_request(requests, row_id, exc, run_id=at.run_id)
        except Exception:  # noqa: BLE001 - the store is away: the refusal stays permanent
            logger.warning("refused %s: its attempt and request rows not written now",
                           job_type, exc_info=True)
        return _failed(path, exc)
    return None


def execute_step(
    services: Services,
    at: StepAttempt,
    *,
    job_type: str,
    payload: dict[str, Any],
    key: str | None,
    request_id: int | None = None,
    requests: RequestStore | None = None,
    correlation_id: str | None = None,
    on_failure: Callable[[StepResult], None] | None = None,
) -> StepResult:
    """Execute an admitted request once (:func:`engine.runtime.execute_request`) and settle its
    request row from the outcome: completed, or failed (for the DLQ) unless a retry follows.
    ``on_failure`` hears a failed attempt's result before the request row is settled."""
    path = failure_path(services, job_type, at)
    try:
        outcome = execute_request(
            job_type, payload, services=services, key=key, run_id=at.run_id, step=at.step,
            attempt=at.attempt, correlation_id=correlation_id, request_id=request_id,
            decide=path.outcome,
        )
    except RequestCancelled as exc:  # stopped at a cancel point: not a failure
        if requests is not None and request_id is not None:
            path.settle_request(requests, request_id, exc, run_id=at.run_id)
        return StepResult(outcome=cancelled(exc.key, exc.detail))
    except Exception as exc:  # noqa: BLE001 - every failure goes through the one path
        result = _failed(path, exc, on_failure)
        if requests is not None and request_id is not None:
            _settle(path, requests, request_id, exc, at)
        return result
    if requests is not None and request_id is not None:
        try:
            requests.mark_completed(request_id, run_id=at.run_id)
        except Exception as exc:  # noqa: BLE001 - the key completed, its row did not move:
            return _failed(path, exc, on_failure)  # a retry: a suppressed duplicate moves it
    return StepResult(outcome=outcome)


def _settle(
    path: FailurePath, requests: RequestStore, request_id: int, exc: BaseException,
    at: StepAttempt,
) -> None:
    """Settle the request row from the decision already made. The row's database may be the
    very thing that failed: the decision stands without it, the row stays ``running`` and the
    intake moves it when the run ends (the DLQ reads the class from the step's failure)."""
    try:
        path.settle_request(requests, request_id, exc, run_id=at.run_id)
    except Exception:  # noqa: BLE001 - the database is away: the decision is the step's answer
        logger.warning("request %s: its row not settled now (%s); the decision stands",
                       request_id, path.decide(exc).reason or "giving up", exc_info=True)


def run_step(
    services: Services,
    at: StepAttempt,
    *,
    job_type: str,
    payload: Any,
    key: str | None = None,
    request_id: int | None = None,
    correlation_id: str | None = None,
    source: str = "run_config",
    on_failure: Callable[[StepResult], None] | None = None,
) -> StepResult:
    """One attempt of one request, as the per-request op runs it: admit (see
    :func:`admit_step`), mark the request row running (when ``request_id`` names one), execute
    and settle (see :func:`execute_step`)."""
    refused = admit_step(
        services, at, job_type=job_type, payload=payload, key=key, source=source,
        request_id=request_id, correlation_id=correlation_id,
    )
    if refused is not None:
        if on_failure is not None:
            on_failure(refused)
        return refused
    if callable(getattr(payload, "model_dump", None)):
        payload = payload.model_dump(mode="json")
    requests = RequestStore(services.db) if request_id is not None else None
    if requests is not None and request_id is not None:
        try:
            taken = requests.mark_running(request_id, run_id=at.run_id)
            request = None if taken else requests.get(request_id)  # nosec B113: a row, not HTTP
        except Exception as exc:  # noqa: BLE001 - the database is away: the path decides
            return _failed(failure_path(services, job_type, at), exc, on_failure)
        if request is not None and request.status is RequestStatus.CANCELLED:
            # cancelled before this run started it: nothing runs (RequestStore.cancel)
            return StepResult(outcome=cancelled(
                request.key, request.cancel_detail or "cancelled before it ran"))
    return execute_step(
        services, at, job_type=job_type, payload=payload, key=key, request_id=request_id,
        requests=requests, correlation_id=correlation_id, on_failure=on_failure,
    )


def cancelled(key: str, detail: str) -> RequestOutcome:
    """The outcome of a step whose request was cancelled: status ``cancelled``, no effect."""
    return RequestOutcome("cancelled", {"detail": detail}, key, 0, "")


def _is_row_id(value: Any) -> bool:
    try:
        check_id("request_id", value)
    except ValidationError:
        return False
    return True
