"""Metrics and the diagnosis checklist in the Dagster UI.

- ``sekali_metrics``: an asset whose materialisation metadata holds every metric as a number,
  so the UI plots each one over time (asset page, "Plots"). ``metrics_schedule`` materialises it
  every five minutes.
- ``sekali_health``: the checklist items as asset checks on ``sekali_metrics``, each with
  severity WARN or ERROR, the finding as description and the fix in metadata.

Everything here only wires configuration to :mod:`pipelines.observability`, which is shared
with ``sekali doctor`` and ``sekali metrics`` so the CLI reads exactly what the code location
reads.
"""

import math
from collections.abc import Mapping
from typing import Any

import dagster as dg
from dagster import AssetCheckExecutionContext, AssetExecutionContext

from pipelines import tags as tag
from pipelines.diagnosis import CHECKS, ERROR, Finding
from pipelines.observability import Observability, build_observability
from resources.storage.db import shared_database
from resources.storage.settings import Settings

METRICS_ASSET = "sekali_metrics"


def observability_from_resources(resources: Any) -> Observability:
    """From a Dagster context's resources (or ``profile.resource_defs()`` for the CLI)."""
    settings = Settings.from_env()
    def get(name: str) -> Any:
        return resources[name] if isinstance(resources, Mapping) else getattr(resources, name)

    app_db = get("app_db")
    idem = get("idempotency")
    locks = get("locks")
    cache = get("cache")
    obs = get("observability")
    db = app_db.get_database() if app_db is not None else shared_database(settings.database_url)
    return build_observability(
        db,
        lease_seconds=idem.lease_seconds,
        lock_backend=locks.backend,
        lock_ttl_seconds=locks.ttl_seconds,
        lock_auto_renew=locks.auto_renew,
        redis_url=cache.redis_url or settings.redis_url,
        cache_namespaces=[cache.namespace],
        gateway_ledger_url=obs.gateway_ledger_url,
        window_hours=obs.window_hours,
        metrics_window_minutes=obs.metrics_window_minutes,
    )


_RESOURCE_KEYS = {"app_db", "idempotency", "locks", "cache", "observability"}


@dg.asset(
    name=METRICS_ASSET,
    group_name="observability",
    required_resource_keys=_RESOURCE_KEYS,
    description="Queue depth and lag, processing percentiles, retries, duplicate detection, "
    "locks, lease takeovers, cache and DLQ rates, as numeric metadata the UI plots.",
)
def sekali_metrics(context: AssetExecutionContext) -> dg.MaterializeResult:
    snapshot = observability_from_resources(context.resources).collector.collect()
    if snapshot.missing:
        context.log.warning(f"metrics sources missing: {snapshot.missing}")
    metadata: dict[str, Any] = {
        key: dg.MetadataValue.float(value) for key, value in snapshot.flat().items()
    }
    return dg.MaterializeResult(metadata=metadata)


def _metadata(finding: Finding) -> dict[str, Any]:
    out: dict[str, Any] = {
        "found": dg.MetadataValue.text(finding.found),
        "fix": dg.MetadataValue.text(finding.fix),
    }
    for key, value in finding.evidence.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)) and not math.isnan(float(value)):
            out[key] = dg.MetadataValue.float(float(value))
        else:
            out[key] = dg.MetadataValue.json(_jsonable(value))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    return value


def to_check_result(finding: Finding) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=finding.check,
        asset_key=dg.AssetKey(METRICS_ASSET),
        passed=finding.passed,
        severity=(
            dg.AssetCheckSeverity.ERROR if finding.severity == ERROR
            else dg.AssetCheckSeverity.WARN
        ),
        description=finding.found,
        metadata=_metadata(finding),
    )


@dg.multi_asset_check(
    specs=[
        dg.AssetCheckSpec(name=c.name, asset=METRICS_ASSET, description=c.title) for c in CHECKS
    ],
    name="sekali_health",
    required_resource_keys=_RESOURCE_KEYS,
)
def sekali_health(context: AssetCheckExecutionContext) -> Any:
    """The production diagnosis checklist: one asset check per item."""
    for finding in observability_from_resources(context.resources).findings():
        yield to_check_result(finding)


metrics_job = dg.define_asset_job(
    "sekali_metrics_job",
    selection=dg.AssetSelection.assets(METRICS_ASSET),
    executor_def=dg.in_process_executor,
    tags={tag.QUEUE: "light"},
)

metrics_schedule = dg.ScheduleDefinition(
    name="metrics_schedule",
    job=metrics_job,
    cron_schedule="*/5 * * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
)

assets = [sekali_metrics]
asset_checks = [sekali_health]
jobs = [metrics_job]
schedules = [metrics_schedule]
