"""A DLQ replay-sensor tick does a bounded amount of work whatever the number of open records,
on SQLite and Postgres: the records it materialises and the statements it runs are the same at
1,000 and at 3,000 open records (counted on the real store and driver, not timed), and paging
through its cursor still reaches every record (one whose key completed is resolved wherever
it sits). ``benchmarks/dlq_sensor.py`` measures time and memory at 10k-500k."""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest
from sqlalchemy import event, text

from benchmarks.dlq_sensor import fill_open_records
from pipelines.assets import dead_letters
from resources.dagster_resources import DlqResource
from resources.dlq import DlqRecord, DlqStore
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sensors.dlq import build_dlq_replay_sensor


class Work:
    """Counts the DLQ records a tick materialises and the statements it runs on the store."""

    def __init__(self, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records = 0
        self.statements = 0
        original = DlqRecord.from_row.__func__  # type: ignore[attr-defined]

        def counted(cls: Any, row: Any) -> DlqRecord:
            self.records += 1
            return original(cls, row)  # type: ignore[no-any-return]

        monkeypatch.setattr(DlqRecord, "from_row", classmethod(counted))
        event.listen(db.engine, "before_cursor_execute", self._statement)
        self.db = db

    def _statement(self, *args: Any) -> None:
        self.statements += 1

    def close(self) -> None:
        event.remove(self.db.engine, "before_cursor_execute", self._statement)


def ticks(
    db_url: str, db: Database, monkeypatch: pytest.MonkeyPatch, n: int
) -> list[tuple[int, int]]:
    """(records materialised, statements run) by each of three ticks (publishing, steady,
    steady) at ``n`` open records."""
    sensor = build_dlq_replay_sensor([], dead_letters.publish, name="bounded_replay_sensor")
    out = []
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = None
        work = Work(DlqResource(database_url=db_url).get_store().db, monkeypatch)
        try:
            for _ in range(3):
                work.records = work.statements = 0
                result = sensor.evaluate_tick(
                    dg.build_sensor_context(
                        instance=instance, cursor=cursor,
                        resources={"dlq": DlqResource(database_url=db_url)},
                    )
                )
                cursor = result.cursor
                out.append((work.records, work.statements))
        finally:
            work.close()
    return out


def test_a_tick_reads_the_same_whatever_the_number_of_open_records(
    db: Database, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a tick that lists every unresolved record (to publish ``dead_letters``, to
    settle replays, to look for completed keys): its work grows with the DLQ until a tick
    passes Dagster's sensor timeout."""
    fill_open_records(db, 0, 1_000)
    small = ticks(db_url, db, monkeypatch, 1_000)
    fill_open_records(db, 1_000, 2_000)
    large = ticks(db_url, db, monkeypatch, 3_000)
    assert [r for r, _ in large] == [r for r, _ in small], (small, large)
    assert max(n for _, n in small + large) <= 20, (small, large)  # pages, not records
    assert max(records for records, _ in large) <= dead_letters.MAX_ROWS + dead_letters.STUCK_IDS


def test_paging_reaches_a_completed_key_at_the_end_of_a_long_dlq(
    db: Database, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches paging that only ever looks at the first page: the newest of 1,200 open
    records, whose key completed, is resolved within a few ticks."""
    fill_open_records(db, 0, 1_200)
    with db.statement() as conn:
        last_id, key = conn.execute(
            text("SELECT id, idempotency_key FROM dlq_records ORDER BY id DESC LIMIT 1")
        ).one()
    ledger = IdempotencyStore(db)
    claim = ledger.begin(key, payload={"bench": True})
    ledger.complete(claim, {"ok": True})  # type: ignore[arg-type]
    sensor = build_dlq_replay_sensor([], dead_letters.publish, name="paging_replay_sensor")
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = None
        for _ in range(4):
            result = sensor.evaluate_tick(
                dg.build_sensor_context(
                    instance=instance, cursor=cursor,
                    resources={"dlq": DlqResource(database_url=db_url)},
                )
            )
            cursor = result.cursor
    assert str(DlqStore(db).get(last_id).status) == "resolved"
