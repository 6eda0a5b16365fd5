"""``reconciliation``: the :class:`engine.upkeep.reconciliation.Reconciler` as a scheduled asset,
and the DLQ retention check beside it."""

from dataclasses import replace
from typing import Any

import dagster as dg

from engine.registry import JOB_TYPES
from engine.services import settle_seconds_of
from engine.upkeep.reconciliation import Reconciler
from pipelines.domain.consumers import default_consumers
from resources.dagster_resources import DlqResource, PlainDocs
from resources.idempotency import IdempotencyStore
from resources.outbox import InAppPublisher, Inbox, OutboxPublisher
from resources.storage.settings import RetentionSettings

CHECKED_CLIENTS = sorted(
    {d.name for jt in JOB_TYPES.values() if jt.upkeep.reconcile is not None
     for d in jt.calls.clients}
)
"""The downstreams the job types' reconciliation checks look effects up at."""


class ReconciliationConfig(PlainDocs, dg.Config):
    """Thresholds: ``grace_seconds`` before an unsettled state counts as inconsistent, the
    payment ``lookback_hours``, the outbox threshold, and the idempotency retention (>= 72 h).
    The other tables' retention comes from ``SEKALI_RETENTION_*_DAYS``
    (:class:`resources.storage.settings.RetentionSettings`); the DLQ's from the ``dlq``
    resource's ``retention_days``."""

    grace_seconds: float = 600.0
    lookback_hours: float = 48.0
    outbox_threshold_seconds: float = 300.0
    idempotency_retention_hours: float = 7 * 24.0


@dg.asset(
    name="reconciliation",
    group_name="operations",
    description="Finds and compensates inconsistencies (payments, fulfilment, stuck claims, "
    "stale outbox rows, expired keys) and purges what retention allows; metadata counts what "
    "it found, fixed and purged.",
    required_resource_keys={"app_db", "idempotency", "dlq", "cache", *CHECKED_CLIENTS},
)
def reconciliation(
    context: dg.AssetExecutionContext, config: ReconciliationConfig
) -> dg.MaterializeResult[Any]:
    db = context.resources.app_db.get_database()
    store = IdempotencyStore(db)
    wired = {name: getattr(context.resources, name) for name in CHECKED_CLIENTS}
    consumers = default_consumers(context.resources.cache.get_cache())
    publisher = OutboxPublisher(db, InAppPublisher(Inbox(db), consumers))
    reconciler = Reconciler(
        db,
        store=store,
        dlq=context.resources.dlq.get_store(),
        clients={name: resource.get_client() for name, resource in wired.items()},
        publisher=publisher,
        settle_seconds=settle_seconds_of(wired.values()),
        grace_seconds=config.grace_seconds,
        lookback_seconds=config.lookback_hours * 3600,
        outbox_threshold_seconds=config.outbox_threshold_seconds,
        idempotency_retention_seconds=config.idempotency_retention_hours * 3600,
        retention=replace(
            RetentionSettings.from_env(), dlq=context.resources.dlq.retention_days * 86400
        ),
    )
    report = reconciler.run()
    return dg.MaterializeResult(metadata=report.metadata())


@dg.asset_check(
    asset=reconciliation,
    name="dlq_retention",
    description="Warns before a retention limit would drop an unresolved DLQ record.",
    required_resource_keys={"dlq"},
)
def dlq_retention_check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    dlq: DlqResource = context.resources.dlq
    at_risk = dlq.get_store().at_retention_risk(dlq.retention_days * 86400, dlq.warn_days * 86400)
    return dg.AssetCheckResult(
        passed=not at_risk,
        severity=dg.AssetCheckSeverity.WARN,
        description=(
            f"{len(at_risk)} unresolved DLQ records are within {dlq.warn_days:g} days of the "
            f"{dlq.retention_days:g}-day retention: replay or discard them"
            if at_risk
            else "no unresolved DLQ record is near the retention limit"
        ),
        metadata={"at_risk": len(at_risk), "oldest_ids": str([r.id for r in at_risk[:20]])},
    )


reconciliation_job = dg.define_asset_job("reconciliation_job", selection=[reconciliation])
reconciliation_schedule = dg.ScheduleDefinition(
    name="reconciliation_schedule",
    job=reconciliation_job,
    cron_schedule="*/15 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
