"""The ``sekali_durations`` asset (:mod:`pipelines.assets.durations`) materialised in Dagster
over a real app database and a real instance: its pictures and the numbers behind them."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path

import dagster as dg
import pytest

from engine import tags as tag
from engine.attempts import AttemptRecorder, Outcome
from engine.requests import RequestStore
from pipelines.assets.durations import sekali_durations, workers_per_minute
from pipelines.ops.worker import sekali_worker
from resources.dagster_resources import DatabaseResource, IdempotencyResource
from resources.storage.db import Database
from resources.storage.migrations import upgrade

pytestmark = pytest.mark.dagster

PNG = b"\x89PNG\r\n\x1a\n"


def _png(markdown: str) -> bytes:
    found = re.fullmatch(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert found, markdown[:80]
    return base64.b64decode(found.group(1))


def test_the_asset_shows_each_types_histogram_lease_and_arrivals_against_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches an asset whose pictures the UI cannot show (not a PNG, not markdown), one that
    leaves out the lease in force or why, and a capacity line that ignores the worker runs
    that were alive."""
    monkeypatch.setenv("SEKALI_LEASE_MIN_SAMPLES", "100")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    recorder = AttemptRecorder(db)
    for i in range(150):
        record = recorder.new("send_email")
        record.started_at -= 0.05 + (2.0 if i == 0 else 0.0)
        recorder.finish(record, Outcome.COMPLETED)
    store = RequestStore(db)
    for i in range(30):
        store.enqueue("send_email", f"email:welcome:a{i}:2026-11-29",
                      {"template": "welcome", "user_id": f"a{i}", "date": "2026-11-29",
                       "to": f"a{i}@x.test"}, queue="light")
    instance = dg.DagsterInstance.ephemeral()
    run = instance.create_run_for_job(sekali_worker, tags={tag.QUEUE: "light",
                                                          tag.WORKER: "light/0"})
    instance.report_run_canceled(run)  # ended, never started: not counted
    alive = instance.create_run_for_job(sekali_worker, tags={tag.QUEUE: "light",
                                                            tag.WORKER: "light/1"})
    instance.handle_new_event(dg.EventLogEntry(  # it started: it counts from now on
        error_info=None, level="DEBUG", user_message="", run_id=alive.run_id,
        timestamp=time.time(), dagster_event=dg.DagsterEvent(
            dg.DagsterEventType.RUN_START.value, alive.job_name)))
    now = time.time()
    alive_counts = workers_per_minute(instance, [now - 180, now - 120, now - 60])
    assert alive_counts == {"light": [0, 0, 1]}  # alive in the last minute only
    result = dg.materialize(
        [sekali_durations],
        resources={"app_db": DatabaseResource(database_url=url),
                   "idempotency": IdempotencyResource(database_url=url, lease_seconds=45)},
        instance=instance,
    )
    assert result.success
    [mat] = result.asset_materializations_for_node("sekali_durations")
    meta = {k: v.value for k, v in mat.metadata.items()}
    for key in ("durations", "arrivals_vs_capacity"):
        assert _png(str(meta[key])).startswith(PNG)
    email = meta["leases"]["send_email"]
    assert email["samples"] == 150 and email["lease_observed"] is True
    assert email["lease_why"].startswith("p99.9 ") and email["p999"] >= 2.0
    assert meta["leases"]["charge_payment"]["lease_seconds"] == 45  # declared: no samples
    db.dispose()
