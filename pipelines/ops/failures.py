"""The Dagster side of the one failure path: run a request in a step, and turn a failure into
the attempt's outcome, the request's status and Dagster's signal, all from one decision.

Used by the per-request op (:mod:`pipelines.ops.request_job`) and the fan-out step
(:mod:`pipelines.ops.batch`); the micro-batch step uses the same :class:`FailurePath` with
``retries_here=False``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import dagster as dg

from engine import tags as tag
from engine.attempts import Outcome
from engine.failures import FailurePath
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.runtime import RequestOutcome, execute_request
from engine.services import Services
from engine.validation import ValidationError, admit, check_id
from resources.dagster_resources import dagster_signal
from resources.retry import RetryPolicy
from resources.telemetry.tracing import SpanKind, inject, span, trace_id_of, tracing_enabled


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
    with _run_span(context, job_type, step, request_id, requests):
        return _run(context, services, path, job_type, payload, key, step, request_id,
                    requests, correlation_id, on_failure)


def _run_span(
    context: dg.OpExecutionContext,
    job_type: str,
    step: str,
    request_id: int | None,
    requests: RequestStore | None,
) -> Any:
    """The run's span: it continues the request's trace (the run tag the intake set, else the
    request row), and a run that starts a trace of its own gets its id as a run tag, so the run
    page shows the trace id."""
    if not tracing_enabled():
        return span("sekali.run")
    parent = context.run.tags.get(tag.TRACEPARENT)
    if parent is None and requests is not None and request_id is not None:
        request = requests.get(request_id)
        parent = request.traceparent if request is not None else None
    run_span = span(
        "sekali.run", parent=parent, kind=SpanKind.CONSUMER, run_id=context.run_id,
        job_type=job_type, step=step, attempt=context.retry_number,
    )
    if tag.TRACE_ID not in context.run.tags:
        trace_id = trace_id_of(parent)
        if trace_id is None:
            return _tagged(context, run_span)
        context.instance.add_run_tags(context.run_id, {tag.TRACE_ID: trace_id})
    return run_span


@contextlib.contextmanager
def _tagged(context: dg.OpExecutionContext, run_span: Any) -> Iterator[Any]:
    with run_span as current:
        trace_id = trace_id_of(inject())
        if trace_id:
            context.instance.add_run_tags(context.run_id, {tag.TRACE_ID: trace_id})
        yield current


def _run(
    context: dg.OpExecutionContext,
    services: Services,
    path: FailurePath,
    job_type: str,
    payload: dict[str, Any],
    key: str | None,
    step: str,
    request_id: int | None,
    requests: RequestStore | None,
    correlation_id: str | None,
    on_failure: Callable[[Outcome], None] | None,
) -> RequestOutcome:
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
        with contextlib.suppress(Exception):  # run history only: the refusal stands regardless
            context.instance.add_run_tags(
                context.run_id, {tag.OUTCOME: str(tag.RunOutcome.FAILED)}
            )
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
