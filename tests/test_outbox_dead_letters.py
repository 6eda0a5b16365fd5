"""Outbox dead letters on SQLite and Postgres: an event whose consumer always fails stops being
retried after ``max_failures`` failures and is kept whole as a dead letter; later events of
other aggregates are published, later events of its own aggregate wait behind it until it is
replayed (then delivered first, in order) or discarded (then they go on); ``sekali outbox``
shows, replays and discards it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from sqlalchemy import text

from cli.main import main
from engine.upkeep.reconciliation import Reconciler
from resources.dlq import DlqStore
from resources.idempotency import IdempotencyStore
from resources.outbox import DeadLetterStatus, OutboxDeadLetters, write_event
from resources.outbox.publisher import OutboxEvent, OutboxPublisher
from resources.storage.db import Database
from tests.test_outbox import AGGREGATES, RecordingPublisher, consumed, make_tables, write_events

POISON = "ev-00000"  # the first event of aggregate o0; ev-00008 is o0's second


class Poisoned:
    """Fails every publication of the events in ``poison``; delivers the rest."""

    def __init__(self, db: Database, poison: set[str]) -> None:
        self.inner = RecordingPublisher(db)
        self.poison = poison
        self.tries = 0

    def publish(self, event: OutboxEvent) -> None:
        if event.event_id in self.poison:
            self.tries += 1
            raise RuntimeError(f"consumer cannot handle {event.event_id}")
        self.inner.publish(event)


def drain(publisher: OutboxPublisher, rounds: int = 10) -> None:
    for _ in range(rounds):
        publisher.publish_batch()


def cli(db_url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = main(["outbox", *argv, "--json", "--url", db_url])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_a_poison_event_is_dead_lettered_and_blocks_only_its_own_aggregate(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a poison event retried forever, one that blocks other aggregates, one skipped
    (its aggregate's later events published before it), or one lost when given up on."""
    make_tables(db)
    write_events(db, 2 * AGGREGATES)
    target = Poisoned(db, {POISON})
    publisher = OutboxPublisher(db, target, batch_size=100, max_failures=3)
    drain(publisher)

    assert target.tries == 3  # then no more tries
    delivered = {r.event_id for r in consumed(db)}
    assert delivered == {f"ev-{i:05d}" for i in range(2 * AGGREGATES)} - {POISON, "ev-00008"}
    (dead,) = OutboxDeadLetters(db).page()
    assert (dead.event_id, dead.aggregate_id, dead.failures) == (POISON, "o0", 3)
    assert dead.payload == {"i": 0} and "cannot handle" in (dead.last_error or "")

    code, shown = cli(db_url, capsys, "dead")
    assert code == 0 and [d["event_id"] for d in shown] == [POISON]
    assert shown[0]["status"] == "open" and shown[0]["failures"] == 3

    target.poison.clear()  # the consumer is fixed
    code, answer = cli(db_url, capsys, "replay", str(dead.id))
    assert code == 0 and answer == {"replayed": [dead.id], "not_open": []}
    drain(publisher)
    rows = [r for r in consumed(db) if r.aggregate_id == "o0"]
    assert [r.event_id for r in rows] == [POISON, "ev-00008"]  # in order, after the replay
    code, again = cli(db_url, capsys, "replay", str(dead.id))
    assert code == 1 and again == {"replayed": [], "not_open": [dead.id]}
    assert OutboxDeadLetters(db).page() == []
    with db.statement() as conn:
        assert conn.execute(
            text("SELECT COUNT(*) FROM outbox WHERE published_at IS NULL")
        ).scalar() == 0


def test_a_discarded_dead_event_lets_its_aggregate_go_on_and_is_kept(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a discard that loses the event or leaves its aggregate blocked, and a replayed
    event that fails again staying out of sight (the same dead letter opens again)."""
    make_tables(db)
    write_events(db, AGGREGATES + 1)  # o0: ev-00000, ev-00008
    target = Poisoned(db, {POISON})
    publisher = OutboxPublisher(db, target, batch_size=100, max_failures=2)
    drain(publisher)
    store = OutboxDeadLetters(db)
    (dead,) = store.page()
    assert store.replay([dead.id], actor="test") == [dead.id]
    drain(publisher)  # still poisonous: dead again
    (again,) = store.page()
    assert (again.id, again.deaths, again.status) == (dead.id, 2, DeadLetterStatus.OPEN)
    assert "ev-00008" not in {r.event_id for r in consumed(db)}

    code, answer = cli(db_url, capsys, "discard", str(dead.id), "--reason", "bad payload")
    assert code == 0 and answer["discarded"] == [dead.id]
    drain(publisher)
    assert "ev-00008" in {r.event_id for r in consumed(db)}
    kept = store.get(dead.id)
    assert kept is not None and kept.status is DeadLetterStatus.DISCARDED
    assert kept.payload == {"i": 0} and "bad payload" in (kept.detail or "")
    code, shown = cli(db_url, capsys, "dead", "--status", "all")
    assert [d["status"] for d in shown] == ["discarded"]


def test_a_dead_lettered_event_is_not_a_stale_outbox_event(db: Database) -> None:
    """Catches the reconciliation's ``stale_outbox`` check counting a dead-lettered event (and
    the later event of its aggregate that waits behind it) as a stuck publisher, a finding no
    run can fix: only live events count there; the held ones are counted on their own
    (``dead_outbox``, ``outbox_behind_dead``) and wait for `sekali outbox replay|discard`."""
    make_tables(db)
    write_events(db, AGGREGATES + 1)  # o0: ev-00000 (poison), ev-00008 behind it
    drain(OutboxPublisher(db, Poisoned(db, {POISON}), batch_size=100, max_failures=2))
    with db.transaction() as conn:
        write_event(conn, aggregate_type="order", aggregate_id="o-live", event_type="e",
                    payload={}, event_id="ev-live")  # live, never published: a stuck publisher
    later = time.time() + 3600
    reconciler = Reconciler(db, store=IdempotencyStore(db), dlq=DlqStore(db),
                            outbox_threshold_seconds=300, clock=lambda: later)
    report = reconciler.run()
    assert report.found["stale_outbox"] == 1, report.found
    assert (report.dead_outbox, report.outbox_behind_dead) == (1, 1)
    meta = report.metadata()
    assert (meta["found_stale_outbox"], meta["dead_outbox"], meta["outbox_behind_dead"]) == (
        1, 1, 1)


def test_the_doctor_reports_outbox_events_waiting_for_an_operator(db: Database) -> None:
    """Catches a dead-lettered outbox event nobody is told about: nothing retries it, and the
    later events of its aggregate wait behind it until someone replays or discards it."""
    from engine.health.diagnosis import DiagnosisSetup, check_outbox_dead_letters

    setup = DiagnosisSetup(db=db, job_types={}, lease_seconds=30.0)
    make_tables(db)
    write_events(db, AGGREGATES + 1)  # o0: ev-00000 (poison), ev-00008 behind it
    assert check_outbox_dead_letters(setup).passed
    drain(OutboxPublisher(db, Poisoned(db, {POISON}), batch_size=100, max_failures=2))
    finding = check_outbox_dead_letters(setup)
    assert not finding.passed
    assert (finding.evidence["dead_lettered"], finding.evidence["waiting_behind"]) == (1, 1)
    assert "sekali outbox replay" in finding.fix
    (dead,) = OutboxDeadLetters(db).page()
    OutboxDeadLetters(db).discard([dead.id], actor="test", reason="bad payload")
    assert check_outbox_dead_letters(setup).passed
