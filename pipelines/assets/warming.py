"""``cache_warming``: the :class:`engine.upkeep.warming.Warmer` as a scheduled asset."""

from typing import Any

import dagster as dg

from engine.upkeep.warming import Warmer, declared_loaders
from resources.dagster_resources import PlainDocs


class WarmingConfig(PlainDocs, dg.Config):
    """How many hot keys to look at, and how close to expiry a key must be to be refreshed."""

    top_n: int = 50
    refresh_within_seconds: float = 600.0


@dg.asset(
    name="cache_warming",
    group_name="operations",
    description="Refreshes the hottest cache keys before they expire, through the single flight.",
    required_resource_keys={"cache", "app_db"},
)
def cache_warming(
    context: dg.AssetExecutionContext, config: WarmingConfig
) -> dg.MaterializeResult[Any]:
    cache = context.resources.cache.get_cache()
    warmer = Warmer(
        cache,
        declared_loaders(context.resources.app_db.get_database()),
        top_n=config.top_n,
        refresh_within=config.refresh_within_seconds,
    )
    report = warmer.run()
    if report.failed:
        context.log.warning(f"warming failed for {len(report.failed)} keys: {report.failed}")
    return dg.MaterializeResult(metadata=report.metadata())


cache_warming_job = dg.define_asset_job("cache_warming_job", selection=[cache_warming])
cache_warming_schedule = dg.ScheduleDefinition(
    name="cache_warming_schedule",
    job=cache_warming_job,
    cron_schedule="*/5 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
