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

Failures go through the one failure path (:mod:`pipelines.ops.failures`). Transient ->
``RetryRequested`` with our capped, jittered delay; permanent, or out of attempts/time/retry
budget -> ``Failure(allow_retries=False)``, and the request is marked failed for the DLQ. The
jobs carry ``dagster/retry_on_asset_or_op_failure:
"false"`` so the run-retry daemon does not retry what the op gave up on (the DLQ does).
"""

# No ``from __future__ import annotations`` here: Dagster reads the op's config annotation
# (``RequestConfig``) at definition time and cannot resolve it from a string.
from typing import Any

import dagster as dg

from pipelines import tags as tag
from pipelines.jobs.base import JobType
from pipelines.ops.failures import admit_run_config, run_request_step
from pipelines.requests import RequestStore
from pipelines.services import Services

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
        tag.QUEUE: jt.queue,
        tag.JOB_TYPE: jt.name,
        tag.MAX_RUNTIME: str(int(jt.max_runtime_seconds)),
        **tag.NO_RUN_RETRY,
    }


def request_op(jt: JobType) -> dg.OpDefinition:
    @dg.op(
        name=jt.op_name,
        description=jt.description,
        required_resource_keys=set(BASE_RESOURCES | EXTRA_RESOURCES.get(jt.name, frozenset())),
        tags={tag.QUEUE: jt.queue},
    )
    def _op(context: dg.OpExecutionContext, config: RequestConfig) -> dict[str, Any]:
        services = Services.from_context(context)
        admit_run_config(context, services, jt.name, config, step=jt.op_name)
        run_id = context.run_id
        correlation_id = (
            config.correlation_id or context.run.tags.get(tag.CORRELATION_ID) or run_id
        )
        requests = RequestStore(services.db) if config.request_id is not None else None
        if requests is not None and config.request_id is not None:
            requests.mark_running(config.request_id, run_id=run_id)
        outcome = run_request_step(
            context,
            services,
            job_type=jt.name,
            payload=dict(config.payload),
            key=config.key,
            step=jt.op_name,
            request_id=config.request_id,
            requests=requests,
            correlation_id=correlation_id,
        )
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
