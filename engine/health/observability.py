"""Metrics and the diagnosis checklist built from one configuration (no Dagster needed).

The Dagster side (asset, checks, schedule) is ``pipelines.assets.observability``:

- ``sekali_metrics``: an asset whose materialisation metadata holds the metrics under short
  keys (numbers the UI plots, a table per labelled family). ``health_sensor`` publishes it and
  the checks every five minutes (running by default).
- ``sekali_health``: the checklist items as asset checks on ``sekali_metrics``, each with
  severity WARN or ERROR, the finding as description and the fix in metadata.

Everything here only wires configuration to :mod:`engine.health.metrics` and
:mod:`engine.health.diagnosis`; :func:`build_observability` is shared with ``sekali doctor`` and
``sekali metrics`` so the CLI reads exactly what the code location reads.
"""


from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.health.diagnosis import DiagnosisSetup, EffectLedger, Finding, diagnose
from engine.health.metrics import MetricsCollector, redis_lock_stats
from engine.registry import JOB_TYPES
from resources.cache import StampedeCache
from resources.storage.db import Database
from resources.storage.redis import redis_client
from resources.storage.settings import RetentionSettings


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
    effect_ledgers: Sequence[EffectLedger] = (),
    window_hours: float = 24.0,
    metrics_window_minutes: float = 60.0,
    retention: RetentionSettings | None = None,
) -> Observability:
    """Build both from plain values. Opens no connection until something is read.
    ``effect_ledgers``: where downstreams record their effects (the checks count real
    duplicates there and follow correlation ids into them)."""
    if job_types is None:
        job_types = JOB_TYPES
    caches: list[Any] = []
    client = None
    if redis_url:
        client = redis_client(redis_url)
        caches = [StampedeCache(client, namespace=ns) for ns in cache_namespaces]

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
        leases=(job_types, lease_seconds),
    )
    setup = DiagnosisSetup(
        db=db,
        job_types=job_types,
        lease_seconds=lease_seconds,
        lock_ttl_seconds=None if lock_backend == "none" else lock_ttl_seconds,
        lock_auto_renew=lock_auto_renew,
        caches=caches,
        effect_ledgers=list(effect_ledgers),
        redis=client,
        window_seconds=window_hours * 3600,
        retention=retention or RetentionSettings.from_env(),
    )
    return Observability(collector, setup)
