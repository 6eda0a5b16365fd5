"""Metrics and the diagnosis checklist in the Dagster UI.

- ``sekali_metrics``: an asset whose materialisation metadata holds the metrics under short keys:
  each metric without labels as a number (the UI plots it over time, asset page "Plots"), each
  labelled family as one table with a column per label (``attempts``: job_type, outcome, value).
  The Prometheus names (``sekali metrics serve``) are unchanged.
- ``sekali_health``: the checklist items as asset checks on ``sekali_metrics``, each with
  severity WARN or ERROR, the finding as description and the fix in metadata.
- ``health_sensor`` (running by default, every five minutes) publishes both without a run: it
  reports the materialisation and every check's evaluation as runless asset events, so the
  checks never show a pass older than one interval, at the cost of the queries alone (no run
  process). ``sekali_metrics_job`` still materialises them in a run on demand.

Everything here only wires configuration to :mod:`engine.health.observability`, which is shared
with ``sekali doctor`` and ``sekali metrics`` so the CLI reads exactly what the code location
reads.
"""

import math
from collections.abc import Mapping
from typing import Any

import dagster as dg
from dagster import AssetCheckExecutionContext, AssetExecutionContext

from engine import tags as tag
from engine.health.diagnosis import CHECKS, ERROR, Finding
from engine.health.metrics import MetricsSnapshot, Sample
from engine.health.observability import Observability, build_observability
from pipelines.domain.payments import charge_ledger
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
        effect_ledgers=(
            [charge_ledger(obs.gateway_ledger_url)] if obs.gateway_ledger_url else []
        ),
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
    return dg.MaterializeResult(metadata=metrics_metadata(snapshot))


PREFIX = "sekali_"


def short_name(name: str) -> str:
    """The UI key of a metric: its Prometheus name without the ``sekali_`` prefix."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def metrics_metadata(snapshot: MetricsSnapshot) -> dict[str, Any]:
    """Short keys that fit the UI's metadata table: a number per metric without labels, a table
    per labelled family (a column per label, then ``value``). NaN (no data) is left out."""
    metadata: dict[str, Any] = {}
    families: dict[str, list[Sample]] = {}
    for sample in snapshot.samples:
        if math.isnan(sample.value):
            continue
        if sample.labels:
            families.setdefault(sample.name, []).append(sample)
        else:
            metadata[short_name(sample.name)] = dg.MetadataValue.float(sample.value)
    for name, samples in families.items():
        labels = list(dict.fromkeys(k for s in samples for k, _ in s.labels))
        schema = dg.TableSchema(
            columns=[
                *(dg.TableColumn(label, "string") for label in labels),
                dg.TableColumn("value", "float", description=samples[0].help or None),
            ]
        )
        rows = [
            dg.TableRecord({**{label: "" for label in labels}, **dict(s.labels), "value": s.value})
            for s in samples
        ]
        metadata[short_name(name)] = dg.MetadataValue.table(rows, schema)
    if snapshot.missing:
        metadata["missing_sources"] = dg.MetadataValue.text(", ".join(snapshot.missing))
    return metadata


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


def _severity(finding: Finding) -> dg.AssetCheckSeverity:
    return dg.AssetCheckSeverity.ERROR if finding.severity == ERROR else dg.AssetCheckSeverity.WARN


def to_check_result(finding: Finding) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=finding.check,
        asset_key=dg.AssetKey(METRICS_ASSET),
        passed=finding.passed,
        severity=_severity(finding),
        description=finding.found,
        metadata=_metadata(finding),
    )


def to_check_evaluation(finding: Finding) -> dg.AssetCheckEvaluation:
    """The same result, as an event reported without a run."""
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey(METRICS_ASSET),
        check_name=finding.check,
        passed=finding.passed,
        severity=_severity(finding),
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

HEALTH_INTERVAL_SECONDS = 300


def publish_health(instance: dg.DagsterInstance, observability: Observability) -> list[Finding]:
    """Report the metrics materialisation, then every check's evaluation (which the UI then
    reads as evaluated against it), as runless events. Returns the findings."""
    snapshot = observability.collector.collect()
    instance.report_runless_asset_event(
        dg.AssetMaterialization(METRICS_ASSET, metadata=metrics_metadata(snapshot))
    )
    findings = observability.findings()
    for finding in findings:
        instance.report_runless_asset_event(to_check_evaluation(finding))
    return findings


@dg.sensor(
    name="health_sensor",
    minimum_interval_seconds=HEALTH_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    required_resource_keys=_RESOURCE_KEYS,
    description="Every 5 minutes: the metrics and the sekali_health checks, published without a"
    " run, so no check shows an old pass.",
)
def health_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    findings = publish_health(context.instance, observability_from_resources(context.resources))
    failing = [f.check for f in findings if not f.passed]
    return dg.SkipReason(
        f"published {len(findings)} checks; failing: {', '.join(failing) or 'none'}"
    )


assets = [sekali_metrics]
asset_checks = [sekali_health]
jobs = [metrics_job]
sensors = [health_sensor]
