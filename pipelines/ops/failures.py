"""The Dagster side of the one failure path: run a request in a step, and turn a failure into
the attempt's outcome, the request's status and Dagster's signal, all from one decision.

Used by the per-request op (:mod:`pipelines.ops.request_job`) and the fan-out step
(:mod:`pipelines.ops.batch`); the micro-batch step uses the same :class:`FailurePath` with
``retries_here=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dagster as dg

from pipelines.attempts import Outcome
from pipelines.failures import FailurePath
from pipelines.registry import JOB_TYPES
from pipelines.requests import RequestStore
from pipelines.runtime import RequestOutcome, execute_request
from pipelines.services import Services
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
    on_failure: Callable[[Outcome], None] | None = None,
) -> RequestOutcome:
    """Execute one request in this step. On failure: the request is marked ``failed`` unless a
    retry follows, ``on_failure`` hears the outcome decided (retried, dead_lettered or
    failed_permanent), and Dagster's ``RetryRequested`` or ``Failure(allow_retries=False)`` is
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
        if on_failure is not None:
            on_failure(path.outcome(exc))
        raise signal(path, exc) from exc
    if requests is not None and request_id is not None:
        requests.mark_completed(request_id, run_id=context.run_id)
    return outcome


def signal(path: FailurePath, exc: BaseException) -> Exception:
    """Dagster's signal for the path's decision on ``exc``."""
    return dagster_signal(exc, path.decide(exc), path.policy or RetryPolicy())
