"""Outcomes in run history: each run of a job type is tagged with its key and how it ended, a
duplicate points at the run that made the effect, and the runs list filters on those tags.

Real Dagster instance (run storage on SQLite, filtered as the UI's runs list filters), real app
database, real Redis, the sandbox gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from engine import tags as tag
from pipelines.ops import charge_payment_job
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

EXAMPLE_KEY = "payment:o-example-1"


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


def _runs(instance: dg.DagsterInstance, **tags: str) -> list[str]:
    return [r.run_id for r in instance.get_runs(filters=dg.RunsFilter(tags=tags))]


def _output_metadata(result: dg.ExecuteInProcessResult) -> dict[str, object]:
    (event,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    return {k: v.value for k, v in event.step_output_data.metadata.items()}


def test_effect_and_duplicate_are_tagged_linked_and_filterable(
    sqlite_url: str, redis_url: str, namespace: str, tmp_path: Path,
    instance: dg.DagsterInstance,
) -> None:
    """Catches: a duplicate and the run that charged both showing as a plain success, Launchpad
    runs without ``sekali/key`` (filtering by key finds nothing), and a duplicate that does not
    say which run made the effect or what it was."""
    db = Database.from_url(sqlite_url)
    upgrade(db)
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    try:
        resources = dagster_resources(
            db_url=sqlite_url, redis_url=redis_url, namespace=namespace,
            gateway_url=gateway.url,
        )
        # launched as the launch form opens: the job's default config, no key given
        first = charge_payment_job.execute_in_process(instance=instance, resources=resources)
        second = charge_payment_job.execute_in_process(instance=instance, resources=resources)
        assert first.success and second.success
        assert len(gateway.charges()) == 1

        assert _runs(instance, **{tag.OUTCOME: "effect"}) == [first.run_id]
        assert _runs(instance, **{tag.OUTCOME: "duplicate"}) == [second.run_id]
        assert set(_runs(instance, **{tag.KEY: EXAMPLE_KEY})) == {first.run_id, second.run_id}
        duplicate = instance.get_run_by_id(second.run_id)
        assert duplicate is not None and duplicate.tags[tag.ORIGINAL_RUN] == first.run_id

        m1, m2 = _output_metadata(first), _output_metadata(second)
        charge_id = gateway.charges()[0]["charge_id"]
        assert m1["outcome"] == "effect" and m1["charge_id"] == charge_id
        assert m2["outcome"] == "duplicate" and m2["charge_id"] == charge_id
        assert m2["original_run"] == f"/runs/{first.run_id}"
    finally:
        gateway.stop()
        db.dispose()


def test_failures_are_tagged_failed_or_dead_lettered(
    sqlite_url: str, redis_url: str, namespace: str, instance: dg.DagsterInstance
) -> None:
    """Catches: failed runs that do not say whether they were refused for good (``failed``) or
    gave up on a sick downstream (``dead_lettered``), and a ``retried`` tag left on a run whose
    last attempt ended otherwise."""
    db = Database.from_url(sqlite_url)
    upgrade(db)
    try:
        resources = dagster_resources(
            db_url=sqlite_url, redis_url=redis_url, namespace=namespace,
            gateway_url="http://127.0.0.1:9",  # nothing listens: transient, every attempt
        )

        def launch(payload: dict[str, object]) -> dg.ExecuteInProcessResult:
            return charge_payment_job.execute_in_process(
                run_config={"ops": {"charge_payment_op": {"config": {"payload": payload}}}},
                instance=instance, resources=resources, raise_on_error=False,
            )

        refused = launch({"order_id": "o-zero", "amount_cents": 0})
        down = launch({"order_id": "o-down", "amount_cents": 100})
        assert not refused.success and not down.success
        assert _runs(instance, **{tag.OUTCOME: "failed"}) == [refused.run_id]
        assert _runs(instance, **{tag.OUTCOME: "dead_lettered"}) == [down.run_id]
        assert _runs(instance, **{tag.KEY: "payment:o-down"}) == [down.run_id]
        assert _runs(instance, **{tag.OUTCOME: "retried"}) == []
    finally:
        db.dispose()
