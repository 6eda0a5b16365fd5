"""The ``dead_letters`` asset follows every kind of DLQ write, on SQLite and Postgres: after a
record is created by the run-failure sensor or by the sweep, counted again, asked for a
replay, claimed, resolved or discarded, the next :func:`publish` reports a materialisation
whose table shows it (the change mark moved), and a publish with nothing changed reports
nothing. Real store, real (ephemeral) Dagster instance."""

from __future__ import annotations

import dagster as dg

from pipelines.assets import dead_letters
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.storage.db import Database


def _table(instance: dg.DagsterInstance) -> dict[int, str]:
    latest = instance.get_latest_materialization_event(dg.AssetKey(dead_letters.DEAD_LETTERS))
    assert latest is not None and latest.asset_materialization is not None
    table = latest.asset_materialization.metadata["records"].value
    return {int(r.data["id"]): f"{r.data['status']}:{r.data['count']}" for r in table.records}


def _failure(dedupe_key: str, run_id: str) -> FailureInfo:
    return FailureInfo(
        job_type="charge_payment", dedupe_key=dedupe_key, error_type="ValidationError",
        message="currency: must be a three-letter ISO code", error_class=FailureClass.PERMANENT,
        run_id=run_id,
    )


def test_each_write_path_is_published_by_the_next_publish(db: Database) -> None:
    """Catches a write that does not move the store's change mark: ``publish`` then skips it
    for good and the asset keeps showing the DLQ as it was before the write."""
    store = DlqStore(db)
    with dg.DagsterInstance.ephemeral() as instance:
        assert dead_letters.publish(instance, store)
        assert _table(instance) == {}
        assert not dead_letters.publish(instance, store)  # nothing changed: nothing reported

        first = store.record_failure(_failure("request:1", "r1"), actor="dlq_sensor").record
        assert dead_letters.publish(instance, store)
        assert _table(instance) == {first.id: "open:1"}

        swept = store.record_failure(_failure("request:2", "r2"), actor="dlq_sweep_sensor").record
        assert dead_letters.publish(instance, store)
        assert _table(instance) == {first.id: "open:1", swept.id: "open:1"}

        store.record_failure(_failure("request:1", "r3"), actor="dlq_sensor")  # failed again
        assert dead_letters.publish(instance, store)
        assert _table(instance)[first.id] == "open:2"

        store.request_replay([first.id], actor="test")
        assert dead_letters.publish(instance, store)
        assert _table(instance)[first.id] == "replay_requested:2"

        assert [r.id for r in store.claim_for_replay(5)] == [first.id]
        assert dead_letters.publish(instance, store)
        assert _table(instance)[first.id] == "replaying:2"

        assert store.resolve(first.id, actor="test")
        assert dead_letters.publish(instance, store)
        assert _table(instance) == {swept.id: "open:1"}

        store.discard([swept.id], actor="test", reason="fixed by hand")
        assert dead_letters.publish(instance, store)
        assert _table(instance) == {}
        assert not dead_letters.publish(instance, store)


def test_a_write_that_commits_after_a_later_one_was_published_is_published_next(
    db: Database,
) -> None:
    """Catches the ordering gap of a mark read from the newest audit id: on Postgres a write
    holding audit id N can commit after N+1 was published; the mark then stays N+1 and the
    asset never shows that write until some other write comes (SQLite's writers are serial,
    so there the late write is simply the newest)."""
    store = DlqStore(db)
    late = store.record_failure(_failure("request:1", "r1"), actor="dlq_sensor").record
    other = store.record_failure(_failure("request:2", "r2"), actor="dlq_sensor").record
    with dg.DagsterInstance.ephemeral() as instance:
        assert dead_letters.publish(instance, store)
        with db.transaction() as conn:
            assert store.supersede(late.id, actor="test", detail="v2", conn=conn)  # id N
            if db.is_postgres:  # a later write commits first: id N+1
                store.request_replay([other.id], actor="test")
                assert dead_letters.publish(instance, store)
                assert _table(instance)[late.id] == "open:1"  # N not committed yet
        assert dead_letters.publish(instance, store)
        assert late.id not in _table(instance)  # discarded: gone from the unresolved table
        assert not dead_letters.publish(instance, store)
