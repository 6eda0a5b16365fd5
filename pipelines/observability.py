"""Metrics and the diagnosis checklist in the Dagster UI.

- ``sekali_metrics``: an asset whose materialisation metadata holds every metric as a number,
  so the UI plots each one over time (asset page, "Plots"). ``metrics_schedule`` materialises it
  every five minutes (stopped by default: start it in the UI or set the default status).
- ``sekali_health``: the ten checklist items as asset checks on ``sekali_metrics``, each with
  severity WARN or ERROR, the finding as description and the fix in metadata.

Everything here only wires configuration to :mod:`resources.metrics` and
:mod:`resources.diagnosis`; :func:`build_observability` is shared with ``sekali doctor`` and
``sekali metrics`` so the CLI reads exactly what the code location reads.
"""


import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
import redis
from dagster import AssetCheckExecutionContext, AssetExecutionContext

from resources.db import Database, shared_database
from resources.diagnosis import CHECKS, ERROR, DiagnosisSetup, EffectLedger, Finding, diagnose
from resources.metrics import MetricsCollector, redis_lock_stats

METRICS_ASSET = "sekali_metrics"


class ObservabilityResource(dg.ConfigurableResource):
    """What the checks compare against that no other resource knows.

    ``gateway_ledger_url``: the database where the payment downstream records its charges (the
    sandbox gateway's ``gateway_charges`` table); when set, checks 1 and 10 count real effects
    and follow correlation ids into the downstream. ``window_hours`` bounds the evidence read by
    the checks, ``metrics_window_minutes`` the metrics.
    """

    gateway_ledger_url: str | None = None
    window_hours: float = 24.0
    metrics_window_minutes: float = 60.0


@dataclass
class Observability:
    """A collector and a diagnosis set-up built from one configuration."""

    collector: MetricsCollector
    setup: DiagnosisSetup

    def findings(self, only: Sequence[str] | None = None) -> list[Finding]:
        return diagnose(self.setup, only)


def build_observability(
    db: Database,
    *,
    job_types: Mapping[str, Any] | None = None,
    lease_seconds: float = 60.0,
    lock_backend: str = "redis",
    lock_ttl_seconds: float | None = 30.0,
    lock_auto_renew: bool = True,
    redis_url: str | None = None,
    cache_namespaces: Sequence[str] = ("sekali",),
    gateway_ledger_url: str | None = None,
    window_hours: float = 24.0,
    metrics_window_minutes: float = 60.0,
) -> Observability:
    """Build both from plain values. Opens no connection until something is read."""
    if job_types is None:
        from pipelines.registry import JOB_TYPES  # noqa: PLC0415

        job_types = JOB_TYPES
    caches: list[Any] = []
    client = None
    if redis_url:
        from resources.cache_core import StampedeCache  # noqa: PLC0415

        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        caches = [StampedeCache(client, namespace=ns) for ns in cache_namespaces]
    ledgers = []
    if gateway_ledger_url:
        ledgers.append(
            EffectLedger(
                "gateway_charges", shared_database(gateway_ledger_url), "gateway_charges",
                intent_column="reference", correlation_column="correlation_id",
                time_column="created_at",
            )
        )

    def cache_stats() -> dict[str, dict[str, float]]:
        merged: dict[str, dict[str, float]] = {}
        for cache in caches:
            for pattern, row in cache.stats().items():
                target = merged.setdefault(f"{cache.namespace}/{pattern}", {})
                for name, value in row.items():
                    target[name] = target.get(name, 0.0) + float(value)
        return merged

    collector = MetricsCollector(
        db,
        cache_stats=cache_stats if caches else None,
        lock_stats=redis_lock_stats(client) if client is not None else None,
        window_seconds=metrics_window_minutes * 60,
    )
    setup = DiagnosisSetup(
        db=db,
        job_types=job_types,
        lease_seconds=lease_seconds,
        lock_ttl_seconds=None if lock_backend == "none" else lock_ttl_seconds,
        lock_auto_renew=lock_auto_renew,
        caches=caches,
        effect_ledgers=ledgers,
        window_seconds=window_hours * 3600,
    )
    return Observability(collector, setup)


def observability_from_resources(resources: Any) -> Observability:
    """From a Dagster context's resources (or ``profile.resource_defs()`` for the CLI)."""
    from resources.settings import Settings  # noqa: PLC0415 - env read at run time only

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
    tags={"sekali/queue": "light"},
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
