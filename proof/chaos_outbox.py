"""The ``poison-outbox`` fault: outbox events published by the shipped relay while the workers
are struck, one of them poison (its consumer always fails).

The business writes its events in its own transaction (:func:`write_events`, before the run:
``aggregates`` aggregates with ``per`` events each, and one more aggregate whose first event is
poison and whose second waits behind it). Every worker process runs the shipped relay beside its
deliveries (:class:`Relay`: :class:`resources.outbox.OutboxPublisher` into the in-app
consumer, through the inbox, as the ``outbox_publisher`` sensor does), so kills, stops and
server restarts strike the publishers too. After the run one more pass publishes what the dead
publishers' claims held (:func:`drain`), then :func:`judge_outbox` checks from the tables:

- every event of another aggregate consumed once (its inbox row), none lost;
- the poison event in the outbox dead letters (open, with its failures), never consumed;
- the event behind it still in the outbox, unpublished (the ordering rule for its aggregate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from resources.outbox import (
    Consumer,
    InAppPublisher,
    Inbox,
    OutboxEvent,
    OutboxPublisher,
    write_event,
)
from resources.storage.db import Database

CONSUMER = "chaos_consumer"
AGGREGATE = "chaos_order"
POISON_AGGREGATE = "poison"
MAX_FAILURES = 3  # the relay's max_failures in a chaos run (production: 5)


class PoisonEvent(RuntimeError):
    """poison-outbox: the consumer cannot apply this event, however often it is published."""


def _apply(conn: Connection, event: OutboxEvent) -> None:
    if isinstance(event.payload, dict) and event.payload.get("poison"):
        raise PoisonEvent(f"consumer cannot apply {event.event_id}")


def consumer() -> Consumer:
    return Consumer(CONSUMER, frozenset(), _apply)


def write_events(db: Database, *, aggregates: int, per: int) -> list[str]:
    """The business's events, each written in a transaction of its own; returns their ids."""
    ids: list[str] = []
    plan = [(f"a{a}", f"chaos-e{a}-{n}", {"n": n}) for n in range(per) for a in range(aggregates)]
    plan[1:1] = [(POISON_AGGREGATE, "chaos-poison-0", {"poison": True}),
                 (POISON_AGGREGATE, "chaos-poison-1", {"n": 1})]
    for aggregate_id, event_id, payload in plan:
        with db.transaction() as conn:
            ids.append(write_event(conn, aggregate_type=AGGREGATE, aggregate_id=aggregate_id,
                                   event_type="chaos.event", payload=payload,
                                   event_id=event_id))
    return ids


def publisher(db: Database, claim_seconds: float) -> OutboxPublisher:
    return OutboxPublisher(db, InAppPublisher(Inbox(db), [consumer()]), batch_size=10,
                           claim_seconds=claim_seconds, max_failures=MAX_FAILURES)


class Relay(threading.Thread):
    """A worker process's relay: publishes pending events every ``interval`` seconds until the
    process ends (a daemon thread: a kill takes it mid-publication, as it would the sensor)."""

    def __init__(self, db: Database, claim_seconds: float, interval: float = 0.3,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(name="outbox-relay", daemon=True)
        self.publisher = publisher(db, claim_seconds)
        self.interval = interval
        self.on_error = on_error

    def run(self) -> None:
        while True:
            try:
                self.publisher.publish_pending(max_batches=3)
            except Exception as exc:  # noqa: BLE001 - a server restarting: the next tick again
                if self.on_error is not None:
                    self.on_error(exc)
            time.sleep(self.interval)


def _rows(db: Database, sql: str) -> list[Any]:
    with db.statement() as conn:
        return list(conn.execute(text(sql)).all())


def drain(db: Database, claim_seconds: float, deadline: float) -> None:
    """After the run: publish until every event is published, dead-lettered or waiting behind
    a dead letter of its aggregate, or ``deadline`` (monotonic) passed (dead publishers' claims
    expire after ``claim_seconds``)."""
    relay = publisher(db, claim_seconds)
    while time.monotonic() < deadline:
        relay.publish_pending()
        pending = _rows(db, "SELECT o.id FROM outbox o WHERE o.published_at IS NULL"
                            " AND o.dead_letter_id IS NULL AND NOT EXISTS (SELECT 1 FROM outbox"
                            " d WHERE d.aggregate_type = o.aggregate_type AND d.aggregate_id ="
                            " o.aggregate_id AND d.dead_letter_id IS NOT NULL AND d.id < o.id)")
        if not pending:
            return
        time.sleep(0.3)


def judge_outbox(db: Database, written: list[str], purged: set[str] | None = None
                 ) -> tuple[dict[str, int], list[str]]:
    """The outbox invariants over ``written`` (module docstring): (stats, violations).
    ``purged``: events published before a retention purge (retention-travel), which removes
    published rows: gone after publication, not lost."""
    violations: list[str] = []
    rows = {r.event_id: r for r in _rows(
        db, "SELECT event_id, aggregate_id, published_at, dead_letter_id, failures FROM outbox")}
    consumed = {r.event_id for r in _rows(
        db, f"SELECT event_id FROM inbox WHERE consumer = '{CONSUMER}'")}  # nosec B608: constant
    dead = {r.event_id: r for r in _rows(
        db, "SELECT event_id, status, failures FROM outbox_dead_letters")}
    poison, behind = "chaos-poison-0", "chaos-poison-1"
    for event_id in written:
        if event_id not in rows and event_id not in dead and event_id not in (purged or ()):
            violations.append(f"outbox event lost: {event_id}")
    others = [e for e in written if e not in (poison, behind)]
    unconsumed = [e for e in others if e not in consumed]
    if unconsumed:
        violations.append(f"outbox events of other aggregates not consumed behind the poison "
                          f"event: {unconsumed[:10]} ({len(unconsumed)})")
    got = dead.get(poison)
    if got is None or got.status != "open" or poison in consumed:
        violations.append(f"poison outbox event not in the outbox dead letters (open, never "
                          f"consumed): {got}")
    if behind in consumed or (behind in rows and rows[behind].published_at is not None):
        violations.append("the event behind the poison event of its aggregate was published "
                          "before it (the ordering rule)")
    stats = {
        "outbox_events": len(written),
        "outbox_consumed": len(consumed & set(written)),
        "outbox_dead_lettered": sum(1 for e in written if e in dead),
        "outbox_waiting": int(behind in rows and rows[behind].published_at is None),
        "poison-outbox": int(not violations),
    }
    return stats, violations
