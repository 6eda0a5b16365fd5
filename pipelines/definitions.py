"""The code location: assembles what the other modules export. Nothing is configured here."""

from __future__ import annotations

import dagster as dg

from pipelines.assets import dead_letters, durations, observability, reconciliation, warming
from pipelines.domain.consumers import default_consumers
from pipelines.ops import all_jobs, dlq_ops, request_ops, tenant_ops
from pipelines.ops.batch import BATCH_JOBS
from pipelines.ops.worker import sekali_worker
from pipelines.profile import resource_defs
from sensors.dlq import dlq_sensors
from sensors.intake import intake_sensors
from sensors.outbox import outbox_sensors
from sensors.workers import worker_sensors

intake_sensor, = intake_sensors(all_jobs, BATCH_JOBS)
worker_supervisor, = worker_sensors([sekali_worker])
dlq_sensor, dlq_sweep_sensor, dlq_replay_sensor = dlq_sensors(all_jobs, dead_letters.publish)
outbox_publisher, = outbox_sensors(default_consumers)

defs = dg.Definitions(
    jobs=[*all_jobs, *BATCH_JOBS, sekali_worker, *observability.jobs, *durations.jobs,
          *dlq_ops.jobs, *tenant_ops.jobs, *request_ops.jobs],
    sensors=[
        intake_sensor, worker_supervisor, dlq_sensor, dlq_sweep_sensor, dlq_replay_sensor,
        outbox_publisher, *observability.sensors,
    ],
    schedules=[reconciliation.reconciliation_schedule, warming.cache_warming_schedule],
    assets=[
        *observability.assets, *durations.assets, *dead_letters.assets,
        reconciliation.reconciliation, warming.cache_warming,
    ],
    asset_checks=[
        *observability.asset_checks, *dead_letters.asset_checks,
        reconciliation.dlq_retention_check,
    ],
    resources=resource_defs(),
)
