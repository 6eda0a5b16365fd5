"""Health that stays fresh: ``health_sensor`` (running by default) publishes the metrics and every
checklist check without a run, and each publication is what the UI shows as current.

Real Dagster instance (SQLite storage), real app database, real Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine.health.diagnosis import CHECKS
from pipelines.assets.observability import HEALTH_INTERVAL_SECONDS, METRICS_ASSET, health_sensor
from pipelines.definitions import defs
from pipelines.profile import ObservabilityResource
from resources.dagster_resources import (
    CacheResource,
    DatabaseResource,
    IdempotencyResource,
    LockResource,
)
from resources.storage.db import Database
from resources.storage.migrations import upgrade

pytestmark = pytest.mark.dagster


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


def _resources(url: str, redis_url: str, namespace: str) -> dict[str, Any]:
    return {
        "app_db": DatabaseResource(database_url=url),
        "idempotency": IdempotencyResource(database_url=url, lease_seconds=60),
        "locks": LockResource(redis_url=redis_url),
        "cache": CacheResource(redis_url=redis_url, namespace=namespace),
        "observability": ObservabilityResource(),
    }


def _tick(instance: dg.DagsterInstance, resources: dict[str, Any]) -> None:
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        health_sensor.evaluate_tick(context)


def test_the_health_sensor_runs_by_default_and_keeps_every_check_current(
    tmp_path: Path, redis_url: str, namespace: str, instance: dg.DagsterInstance
) -> None:
    """Catches: checks "Not Evaluated" until someone materialises the metrics by hand, and a
    pass that stays on screen long after it was true (a stopped schedule)."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    try:
        sensor = defs.get_repository_def().get_sensor_def("health_sensor")
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
        assert sensor.minimum_interval_seconds == HEALTH_INTERVAL_SECONDS <= 300
        resources = _resources(url, redis_url, namespace)
        key = dg.AssetKey(METRICS_ASSET)

        stamps: list[float] = []
        for _ in range(2):
            _tick(instance, resources)
            latest = instance.get_latest_materialization_event(key)
            assert latest is not None
            for check in CHECKS:
                record = instance.get_latest_asset_check_evaluation_record(
                    dg.AssetCheckKey(key, check.name)
                )
                assert record is not None and record.evaluation is not None
                # the UI takes an evaluation as the latest materialisation's when both belong
                # to one run (runless events share one)
                assert record.run_id == latest.run_id
                assert record.create_timestamp >= int(latest.timestamp)
            stamps.append(latest.timestamp)
        assert stamps[1] > stamps[0]
        assert instance.get_runs() == []  # published without launching a run
    finally:
        db.dispose()
