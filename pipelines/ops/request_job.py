"""The per-request Dagster job of a job type: one op that runs
:func:`pipelines.runtime.execute_request` and turns its failures into Dagster retries.

Run config (launchable from the UI's launchpad)::

    ops:
      charge_payment_op:
        config:
          payload: {order_id: o-1, amount_cents: 1250, currency: EUR}   # an object (map)
          key: null            # optional; default derived from the payload
          request_id: null     # optional; the intake's job_requests.id
          correlation_id: null # optional; default the run tag sekali/correlation_id, else run id

``payload`` is a free-form map: Dagster checks the shape of the config, and the job type's
``validate`` checks the payload itself, naming the bad field in a permanent failure.

Failures: :func:`resources.retry.to_dagster` decides. Transient -> ``RetryRequested`` with our
capped, jittered delay; permanent, or out of attempts/time/retry budget ->
``Failure(allow_retries=False)``. The jobs carry ``dagster/retry_on_asset_or_op_failure:
"false"`` so the run-retry daemon does not retry what the op gave up on (the DLQ does).
"""

# No ``from __future__ import annotations`` here: Dagster reads the op's config annotation
# (``RequestConfig``) at definition time and cannot resolve it from a string.
import time
from typing import Any

import dagster as dg

from pipelines.attempts import Outcome
from pipelines.jobs.base import JobType
from pipelines.requests import RequestStore
from pipelines.runtime import execute_request
from pipelines.services import Services
from resources.dagster_resources import to_dagster
from resources.retry import ErrorClass, classify

BASE_RESOURCES = frozenset({"idempotency", "app_db", "retry"})
EXTRA_RESOURCES: dict[str, frozenset[str]] = {
    "charge_payment": frozenset({"gateway"}),
    "send_email": frozenset({"mailer"}),
    "rebuild_report_cache": frozenset({"cache"}),
}


class RequestConfig(dg.Config):
    """One request: the payload (a map) and optional key, request id and correlation id."""

    payload: dict[str, Any]
    key: str | None = None
    request_id: int | None = None
    correlation_id: str | None = None


def job_tags(jt: JobType) -> dict[str, str]:
    return {
        "sekali/queue": jt.queue,
        "sekali/job_type": jt.name,
        "dagster/max_runtime": str(int(jt.max_runtime_seconds)),
        "dagster/retry_on_asset_or_op_failure": "false",
    }


def _first_attempt_started(services: Any, run_id: str, step: str) -> float | None:
    from sqlalchemy import text  # noqa: PLC0415

    with services.db.statement() as conn:
        value = conn.execute(
            text("SELECT MIN(started_at) FROM job_attempts WHERE run_id = :r AND step = :s"),
            {"r": run_id, "s": step},
        ).scalar()
    return None if value is None else float(value)


def _request_store(services: Any) -> Any:
    """The intake's request table on the app database: the op moves its own request's status,
    so a request follows every run that serves it (intake, UI launch with a request id, DLQ
    replay), not only the runs the intake sensor launched."""

    return RequestStore(services.db)


def request_op(jt: JobType) -> dg.OpDefinition:
    @dg.op(
        name=jt.op_name,
        description=jt.description,
        required_resource_keys=set(BASE_RESOURCES | EXTRA_RESOURCES.get(jt.name, frozenset())),
        tags={"sekali/queue": jt.queue},
    )
    def _op(context: dg.OpExecutionContext, config: RequestConfig) -> dict[str, Any]:

        services = Services.from_context(context)
        run_id = context.run_id
        step = jt.op_name
        correlation_id = (
            config.correlation_id or context.run.tags.get("sekali/correlation_id") or run_id
        )
        decided: list[BaseException] = []

        def decide(exc: BaseException) -> str:
            first = _first_attempt_started(services, run_id, step)
            decision = to_dagster(
                exc,
                attempt=context.retry_number,
                policy=services.retry_policy,
                elapsed=0.0 if first is None else max(0.0, time.time() - first),
                budget=services.retry_budget if jt.downstream else None,
                downstream=jt.downstream,
            )
            decided.append(decision)
            if isinstance(decision, dg.RetryRequested):
                return Outcome.RETRIED
            if classify(exc) is ErrorClass.PERMANENT:
                return Outcome.FAILED_PERMANENT
            return Outcome.DEAD_LETTERED

        requests = _request_store(services) if config.request_id is not None else None
        if requests is not None:
            requests.mark_running(config.request_id, run_id=run_id)
        try:
            outcome = execute_request(
                jt.name,
                dict(config.payload),
                services=services,
                key=config.key,
                run_id=run_id,
                step=step,
                attempt=context.retry_number,
                correlation_id=correlation_id,
                request_id=config.request_id,
                decide=decide,
            )
        except Exception as exc:
            if not decided:  # failures recorded without a decision (lease lost, unknown type)
                decide(exc)
            decision = decided[-1]
            context.log.warning(
                f"{jt.name} attempt {context.retry_number} failed: {type(exc).__name__}: {exc}"
            )
            if requests is not None and not isinstance(decision, dg.RetryRequested):
                requests.mark_failed(
                    config.request_id, f"{type(exc).__name__}: {exc}"[:2000], run_id=run_id
                )
            raise decision from exc
        if requests is not None:
            requests.mark_completed(config.request_id, run_id=run_id)
        context.log.info(
            f"{jt.name} {outcome.status} key={outcome.key} fence={outcome.fence} "
            f"attempt_id={outcome.attempt_id} correlation_id={correlation_id}"
        )
        context.add_output_metadata(
            {"status": outcome.status, "key": outcome.key, "fence": outcome.fence,
             "attempt_id": outcome.attempt_id}
        )
        return {"status": outcome.status, "key": outcome.key, "result": outcome.result}

    return _op


def request_job(jt: JobType) -> dg.JobDefinition:
    """The Dagster job ``jt.name``: one op, in-process executor, queue and runtime tags."""
    op_def = request_op(jt)

    @dg.job(
        name=jt.name,
        description=jt.description,
        executor_def=dg.in_process_executor,
        tags=job_tags(jt),
    )
    def _job() -> None:
        op_def()

    return _job
