"""The Dagster side of the one failure path: a thin adapter over :mod:`engine.step`.

The step entry decides (admit, execute, settle, the retry decision with the policy and the
shared budget); this module adds what only Dagster has: the run's span and tags, the step's
log, and Dagster's signal for the decision (``RetryRequested`` with our delay, or
``Failure(allow_retries=False)``). Used by the per-request op (:mod:`pipelines.ops.request_job`)
and the fan-out step (:mod:`pipelines.ops.batch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dagster as dg

from engine import tags as tag
from engine.attempts import Outcome
from engine.failures import FailurePath
from engine.privacy import mask_text
from engine.requests import JobRequest, RequestStore
from engine.runtime import RequestOutcome
from engine.services import Services
from engine.step import (
    Retry,
    StepAttempt,
    StepRequest,
    StepResult,
    admit_step,
    failure_path,
    run_step,
    run_steps,
)
from resources.dagster_resources import dagster_signal, expected_failure
from resources.errors import ValidationError
from resources.retry import RetryDecision, RetryPolicy
from resources.telemetry.redact import loggable
from resources.telemetry.tracing import SpanKind, inject, span, trace_id_of, tracing_enabled


def step_attempt(context: Any, step: str) -> StepAttempt:
    """This Dagster step's attempt: its run, step name and ``retry_number``."""
    return StepAttempt(run_id=context.run_id, step=step, attempt=context.retry_number)


def replay_of(context: Any) -> int | None:
    """The DLQ record a replay run serves (its tags), so a failure reopens that record."""
    tags = _run_tags(context)
    if tag.DLQ_REPLAY in tags and tag.DLQ_ID in tags:
        try:
            return int(tags[tag.DLQ_ID])
        except ValueError:
            return None
    return None


def _run_tags(context: Any) -> Mapping[str, str]:
    """The run's tags (none for a context without a run: a test's stand-in)."""
    return getattr(getattr(context, "run", None), "tags", None) or {}


def run_op_step(
    context: dg.OpExecutionContext,
    services: Services,
    *,
    job_type: str,
    payload: Any,
    key: str | None,
    step: str,
    request_id: int | None = None,
    correlation_id: str | None = None,
    on_failure: Callable[[Outcome], None] | None = None,
) -> RequestOutcome:
    """The per-request op's attempt: :func:`engine.step.run_step` in the run's span; a failure
    is logged, ``on_failure`` hears the recorded outcome, the run is linked to its dead letter,
    and Dagster's signal is raised."""
    at = step_attempt(context, step)
    requests = RequestStore(services.db) if request_id is not None else None
    with _run_span(context, job_type, step, request_id, requests):
        result = run_step(
            services, at, job_type=job_type, payload=payload, key=key, request_id=request_id,
            correlation_id=correlation_id, replay_of=replay_of(context),
            on_failure=_heard(context, on_failure),
        )
    return _signalled(result)


def run_row_step(
    context: dg.OpExecutionContext, services: Services, row: JobRequest, step: str
) -> StepResult:
    """One request row in a step of its own (a fanned-out step): :func:`engine.step.run_steps`
    with Dagster retrying the step; a failure raises Dagster's signal, a row another run took
    first comes back ``skipped``."""
    request = StepRequest.of(row)
    with _run_span(context, row.job_type, step, row.id, RequestStore(services.db)):
        result = run_steps(services, step_attempt(context, step), [request], retry=Retry.IN_STEP,
                           source="fan_out", on_failure=_heard(context, None))[0]
    if result.error is not None:
        _signalled(result)
    return result


def _heard(
    context: dg.OpExecutionContext, on_failure: Callable[[Outcome], None] | None,
) -> Callable[[StepResult], None]:
    def heard(result: StepResult) -> None:
        exc = result.error
        assert exc is not None and result.decision is not None and result.request is not None
        request = result.request
        context.log.warning(failure_line(
            request.job_type, request.key, request.payload, context.retry_number, exc,
            result.decision,
        ))
        if on_failure is not None and result.recorded is not None:
            on_failure(result.recorded)
        if result.dead_letter is not None:
            link_dead_letter(context, result.dead_letter.record_id)

    return heard


def link_dead_letter(context: dg.OpExecutionContext, record_id: int) -> None:
    """The run names the DLQ record its request went to (``sekali/dlq_id``); the record names
    the run back. Its outcome stays what its attempt was (``failed``: refused for good;
    ``dead_lettered``: given up on a sick downstream). A replay run names the record it serves
    already."""
    if tag.DLQ_REPLAY in _run_tags(context):
        return
    with contextlib.suppress(Exception):  # run history only: the record stands regardless
        context.instance.add_run_tags(context.run_id, {tag.DLQ_ID: str(record_id)})


def _signalled(result: StepResult) -> RequestOutcome:
    if result.error is not None:
        assert result.path is not None
        raise signal(result.path, result.error) from result.error
    assert result.outcome is not None
    return result.outcome


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
        request = requests.get(request_id)  # nosec B113: the request store, not HTTP
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


def failure_line(
    job_type: str, key: str | None, payload: Any, attempt: int, exc: BaseException,
    decision: RetryDecision,
) -> str:
    """The one line a failed attempt prints (``sekali dev``'s console, the run's log): the job
    type, the key, the error and its class, and what happens next (a retry and when, or the
    DLQ, whose record the failure path then names in a line of its own). Personal values are
    masked."""
    if callable(getattr(payload, "model_dump", None)):  # a typed run config's payload model
        payload = payload.model_dump(mode="json")
    message = mask_text(str(exc).strip().splitlines()[0] if str(exc).strip() else "", job_type,
                        payload)
    shown_key = loggable(str(key)) if key else "(derived)"
    what = (f"{job_type} key={shown_key} attempt {attempt} failed "
            f"({decision.error_class}): {type(exc).__name__}: {loggable(message[:300])}")
    if decision.retry:
        return f"{what}; retrying in {decision.delay or 0:.1f} s"
    return f"{what}; {decision.reason or 'giving up'}: to the DLQ (sekali dlq list)"


def tag_cancelled(
    context: dg.OpExecutionContext, services: Services, request_id: int | None, detail: str
) -> None:
    """A step that ended cancelled (its request never ran, or stopped at a cancel point): the
    run is tagged ``sekali/outcome=cancelled`` with who cancelled; it succeeds, so nothing is
    dead-lettered or retried."""
    request = RequestStore(services.db).get(request_id) if request_id is not None else None
    run_tags = {tag.OUTCOME: str(tag.RunOutcome.CANCELLED), tag.CANCEL: "cancelled"}
    if request is not None and request.cancel_by:
        run_tags[tag.CANCELLED_BY] = request.cancel_by
    context.instance.add_run_tags(context.run_id, run_tags)
    context.log.info(detail)


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
    """:func:`engine.step.admit_step` in a step: a refusal tags the run ``failed`` (and links
    its dead letter) and fails the step without a retry (``Failure(allow_retries=False)``)."""
    refused = admit_step(
        services, step_attempt(context, step),
        StepRequest(job_type, payload, key, request_id, correlation_id,
                    replay_of=replay_of(context)),
        source=source,
    )
    if refused is None:
        return
    with contextlib.suppress(Exception):  # run history only: the refusal stands regardless
        context.instance.add_run_tags(context.run_id, {tag.OUTCOME: str(tag.RunOutcome.FAILED)})
    if refused.dead_letter is not None:
        link_dead_letter(context, refused.dead_letter.record_id)
    _signalled(refused)


def step_services(context: dg.OpExecutionContext, step: str) -> Services:
    """The step's services. When they cannot be had (their database is away at the step's
    start: a process checks the schema at its first use), Dagster's signal from the one
    failure path is raised (:func:`unready_signal`), never the raw error."""
    try:
        return Services.from_context(context)
    except Exception as exc:  # noqa: BLE001 - the database is away: the one path decides
        raise unready_signal(context, step, exc) from exc


def unready_signal(
    context: dg.OpExecutionContext, step: str, exc: BaseException,
    services: Services | None = None, job_type: str = "",
) -> Exception:
    """Dagster's signal for a step that could not get going (its services, or its request's
    row, out of reach): nothing has run, and the one failure path decides as for any failed
    attempt (transient: this step again after the policy's delay; given up: the DLQ, whose
    record says transient). A raw error would fail the step unclassified and unretried (the
    jobs turn Dagster's run retry off for step failures)."""
    at = step_attempt(context, step)
    if services is not None:
        path = failure_path(services, job_type, at)
    else:  # no services: the retry resource's policy alone (no budget: no downstream called)
        try:
            retry = context.resources.retry
        except Exception:  # noqa: BLE001 - a job without the retry resource: the default
            retry = None
        path = FailurePath(attempt=at.attempt,
                           policy=retry.get_policy() if retry is not None else RetryPolicy())
    decision = path.decide(exc)
    what = f"retrying in {decision.delay or 0:.1f} s" if decision.retry else decision.reason
    context.log.warning(f"{step} could not start ({decision.error_class}): "
                        f"{type(exc).__name__}: {exc}; {what}")
    return signal(path, exc)


def signal(path: FailurePath, exc: BaseException) -> Exception:
    """Dagster's signal for the path's decision on ``exc``."""
    return dagster_signal(exc, path.decide(exc), path.policy or RetryPolicy())


def refused_input(exc: ValidationError) -> dg.Failure:
    """An operations job's config refused: the step fails at once, naming the field in one line
    (:func:`resources.dagster_resources.expected_failure`), never retried (nothing was done)."""
    return expected_failure(str(exc), metadata={"field": exc.field})
