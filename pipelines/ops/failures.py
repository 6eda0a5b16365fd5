"""The Dagster side of the one failure path: run a request in a step, and turn a failure into
the attempt's outcome, the request's status and Dagster's signal, all from one decision.

Used by the per-request op (:mod:`pipelines.ops.request_job`) and the fan-out step
(:mod:`pipelines.ops.batch`); the micro-batch step uses the same :class:`FailurePath` with
``retries_here=False``.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from pipelines.failures import FailurePath
from pipelines.registry import JOB_TYPES
from pipelines.requests import RequestStore
from pipelines.runtime import RequestOutcome, execute_request
from pipelines.services import Services
from pipelines.validation import ValidationError, admit, check_id
from resources.dagster_resources import dagster_signal
from resources.retry import RetryPolicy


def failure_path(
    context: dg.OpExecutionContext, services: Services, job_type: str, step: str
) -> FailurePath:
    """The failure path of this step's current attempt: the services' policy and budget, the
    job type's downstream, and the step's first attempt for the time budget."""
    run_id = context.run_id
    known = JOB_TYPES.get(job_type)  # an unknown type fails in execute_request, naming the field
    return FailurePath(
        attempt=context.retry_number,
        policy=services.retry_policy,
        budget=services.retry_budget,
        downstream=known.downstream if known is not None else None,
        first_started=lambda: services.attempts.first_started(run_id, step),
    )


def run_request_step(
    context: dg.OpExecutionContext,
    services: Services,
    *,
    job_type: str,
    payload: dict[str, Any],
    key: str | None,
    step: str,
    request_id: int | None = None,
    requests: RequestStore | None = None,
    correlation_id: str | None = None,
) -> RequestOutcome:
    """Execute one request in this step. On failure: the request is marked ``failed`` unless a
    retry follows, and Dagster's ``RetryRequested`` or ``Failure(allow_retries=False)`` is
    raised from the error."""
    path = failure_path(context, services, job_type, step)
    try:
        outcome = execute_request(
            job_type,
            payload,
            services=services,
            key=key,
            run_id=context.run_id,
            step=step,
            attempt=context.retry_number,
            correlation_id=correlation_id,
            request_id=request_id,
            decide=path.outcome,
        )
    except Exception as exc:
        context.log.warning(
            f"{job_type} attempt {context.retry_number} failed: {type(exc).__name__}: {exc}"
        )
        if requests is not None and request_id is not None:
            path.settle_request(requests, request_id, exc, run_id=context.run_id)
        raise signal(path, exc) from exc
    if requests is not None and request_id is not None:
        requests.mark_completed(request_id, run_id=context.run_id)
    return outcome


def admit_run_config(
    context: dg.OpExecutionContext, services: Services, job_type: str, config: Any, step: str
) -> None:
    """:func:`admit_step_request` for a per-request op's run config (the Launchpad's, or the
    one a sensor built): its ``payload`` (a map, or a typed config's payload model), ``key``,
    ``request_id`` and ``correlation_id``, whatever config class carries them."""
    admit_step_request(
        context,
        services,
        job_type=job_type,
        payload=getattr(config, "payload", None),
        key=getattr(config, "key", None),
        step=step,
        source="run_config",
        request_id=getattr(config, "request_id", None),
        correlation_id=getattr(config, "correlation_id", None),
    )


def admit_step_request(
    context: dg.OpExecutionContext,
    services: Services,
    *,
    job_type: str,
    payload: Any,
    key: Any,
    step: str,
    source: str,
    request_id: Any = None,
    correlation_id: Any = None,
) -> None:
    """The validation boundary before a step runs a request it did not get from ``enqueue`` (a
    run's config, a request read back by a batch step). A refusal runs nothing: it is kept in
    ``job_rejections``, recorded as a ``failed_permanent`` attempt, the request (if any) is
    marked failed, and the step fails without a retry (``Failure(allow_retries=False)`` through
    the one failure path). ``job_type`` is the step's own (never the caller's input)."""
    requests = RequestStore(services.db)
    if callable(getattr(payload, "model_dump", None)):  # a typed run config's payload model
        payload = payload.model_dump(mode="json")
    try:
        admit(
            requests,
            job_type,
            payload,
            key,
            source=source,
            request_id=request_id,
            correlation_id=correlation_id,
        )
    except ValidationError as exc:
        path = failure_path(context, services, job_type, step)
        row_id = request_id if request_id is not None and _is_row_id(request_id) else None
        record = services.attempts.new(  # the refused attempt is recorded too (invariant 6)
            job_type, attempt=context.retry_number, run_id=context.run_id, step=step,
            request_id=row_id,
        )
        services.attempts.finish(
            record, path.outcome(exc), error=exc, error_kind=str(path.decide(exc).error_class)
        )
        if row_id is not None:
            path.settle_request(requests, row_id, exc, run_id=context.run_id)
        raise signal(path, exc) from exc


def _is_row_id(value: Any) -> bool:
    try:
        check_id("request_id", value)
    except ValidationError:
        return False
    return True


def signal(path: FailurePath, exc: BaseException) -> Exception:
    """Dagster's signal for the path's decision on ``exc``."""
    return dagster_signal(exc, path.decide(exc), path.policy or RetryPolicy())
