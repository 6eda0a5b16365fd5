"""The two batched intake jobs: fan-out (a step per request) and micro-batch (a step per N).

Dagster's own cost per step is large (about 170 ms for a trivial in-process run, 25-140 ms per
fanned-out step), so high-volume job types go through ``intake_micro_batch``. Both jobs take the
request ids as run config and read payloads from ``job_requests``, so run config stays small and
the table stays the one record of what was asked.

- ``intake_fan_out``: ``fan_out_requests`` yields a ``DynamicOutput`` per request and
  ``execute_fanned_request`` runs once per request. A failing mapped step does not stop its
  siblings; the run ends FAILURE and the failed request is marked ``failed`` (permanent) or left
  ``running`` for the step's own retry (transient): the one failure path decides
  (:mod:`pipelines.ops.failures`).
- ``intake_micro_batch``: ``execute_request_batch`` handles up to N requests in one step,
  through :func:`engine.runtime.execute_batch`: the keys are claimed and completed in one
  statement each, the attempts recorded together, and the job type's batch handler (if any)
  makes the effects in as few transactions as it allows. Each request keeps every guarantee of
  ``execute_request`` and is recorded and dead-lettered on its own; an error is kept per
  request, recorded (``job_requests.status = failed`` with ``last_error``, for the DLQ) and
  the others go on. **The step succeeds** whatever its requests did, and
  reports ``completed`` / ``duplicate`` / ``failed`` / ``skipped`` counts and the failed keys in
  its output metadata: retrying the whole step would only re-run neighbours that are done.
  The step fails only when the batch cannot be read at all (the store is down): then nothing was
  started, and the run-level failure marks the batch's requests failed through the sensor.

Both jobs run in-process (``in_process_executor``); the sensor tags their runs with the queue.
"""

# No `from __future__ import annotations`: Dagster reads the op config annotations at runtime.
import json
import logging
from collections.abc import Iterator
from typing import Any

import dagster as dg

from engine import tags as tag
from engine.registry import downstreams
from engine.services import Services
from engine.step import run_batch
from pipelines.ops.failures import run_row_step, step_services, unready_signal
from resources.dagster_resources import PlainDocs, expected_failure
from sensors.intake import (
    FAN_OUT_JOB,
    FAN_OUT_OP,
    MICRO_BATCH_JOB,
    MICRO_BATCH_OP,
    RequestsResource,
)

log = logging.getLogger(__name__)


SERVICE_RESOURCE_KEYS = frozenset(
    {"idempotency", "cache", "app_db", "retry", "concurrency", "locks", *downstreams()}
)
"""What :meth:`Services.from_context` reads (every declared downstream's client among it): a
batch may hold requests of any job type."""


class BatchConfig(PlainDocs, dg.Config):
    """The requests of one batch, by id in ``job_requests`` (payloads are read from there)."""

    request_ids: list[int]


@dg.op(
    name=MICRO_BATCH_OP,
    required_resource_keys=set(SERVICE_RESOURCE_KEYS) | {"requests"},
    tags={"kind": "sekali-intake"},
)
def execute_request_batch(context: dg.OpExecutionContext, config: BatchConfig) -> dict[str, Any]:
    """Micro-batch: every request in the batch, each on its own (see the module docstring)."""
    requests: RequestsResource = context.resources.requests
    summary = run_batch(
        requests.get_store(),
        config.request_ids,
        services=Services.from_context(context),
        run_id=context.run_id,
        step=context.op.name,
        attempt=context.retry_number,
    )
    context.add_output_metadata(
        {
            "completed": summary["completed"],
            "duplicate": summary["duplicate"],
            "failed": summary["failed"],
            "skipped": summary["skipped"],
            "cancelled": summary["cancelled"],
            "failed_keys": dg.MetadataValue.json(summary["failures"]),
        }
    )
    return summary


@dg.job(
    name=MICRO_BATCH_JOB,
    executor_def=dg.in_process_executor,
    tags={tag.INTAKE: "micro_batch", **tag.NO_RUN_RETRY},
)
def intake_micro_batch() -> None:
    execute_request_batch()


@dg.op(name=FAN_OUT_OP, out=dg.DynamicOut(int), tags={"kind": "sekali-intake"})
def fan_out_requests(config: BatchConfig) -> Iterator[dg.DynamicOutput[int]]:
    """One dynamic output per request id: one mapped step per request."""
    for request_id in config.request_ids:
        yield dg.DynamicOutput(request_id, mapping_key=f"r{request_id}")


@dg.op(
    required_resource_keys=set(SERVICE_RESOURCE_KEYS) | {"requests"},
    tags={"kind": "sekali-intake"},
)
def execute_fanned_request(context: dg.OpExecutionContext, request_id: int) -> str:
    """One request in its own step. A permanent failure marks it failed and fails the step;
    a transient one raises ``RetryRequested`` with our capped, jittered delay."""

    step = f"{context.op.name}[{context.get_mapping_key()}]"
    services = step_services(context, step)
    try:
        request = context.resources.requests.get_store().get(request_id)  # nosec B113: a row
    except Exception as exc:  # noqa: BLE001 - the database is away: the one path decides
        raise unready_signal(context, step, exc, services) from exc
    if request is None:
        raise expected_failure(f"job request {request_id} does not exist")
    result = run_row_step(context, services, request, step)
    status = "skipped" if result.skipped or result.outcome is None else result.outcome.status
    context.log.info(json.dumps({"request_id": request.id, "key": request.key, "status": status}))
    return status


@dg.job(
    name=FAN_OUT_JOB,
    executor_def=dg.in_process_executor,
    tags={tag.INTAKE: "fan_out", **tag.NO_RUN_RETRY},
)
def intake_fan_out() -> None:
    fan_out_requests().map(execute_fanned_request)


BATCH_JOBS = [intake_micro_batch, intake_fan_out]
