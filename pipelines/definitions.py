"""The code location: assembles what the other modules export. Nothing is configured here."""

from __future__ import annotations

import dagster as dg

from pipelines.assets import dead_letters, observability, reconciliation, warming
from pipelines.ops import all_jobs, dlq_ops
from pipelines.ops.batch import BATCH_JOBS
from pipelines.profile import resource_defs
from sensors import dlq as dlq_sensors
from sensors import outbox as outbox_sensors
from sensors.intake import INTAKE_SENSORS

defs = dg.Definitions(
    jobs=[*all_jobs, *BATCH_JOBS, *observability.jobs, *dlq_ops.jobs],
    sensors=[
        *INTAKE_SENSORS, *dlq_sensors.sensors, *outbox_sensors.sensors, *observability.sensors
    ],
    schedules=[reconciliation.reconciliation_schedule, warming.cache_warming_schedule],
    assets=[
        *observability.assets, *dead_letters.assets, reconciliation.reconciliation,
        warming.cache_warming,
    ],
    asset_checks=[
        *observability.asset_checks, *dead_letters.asset_checks,
        reconciliation.dlq_retention_check,
    ],
    resources=resource_defs(),
)
