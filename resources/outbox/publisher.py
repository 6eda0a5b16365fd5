"""The outbox publisher and the inbox: events leave the database at least once, in order per
aggregate, and each consumer applies each event once.

The writer (``resources/outbox/events.py``) puts events in the business transaction. This module
delivers them:

- :meth:`OutboxPublisher.publish_batch` claims up to ``batch_size`` unpublished rows in one short
  transaction (``FOR UPDATE`` on Postgres, serialised by a transaction-scoped advisory lock;
  ``BEGIN IMMEDIATE`` on SQLite), marking them with its owner id and a claim expiry. A row is
  claimable only if no earlier unpublished row of its aggregate is under someone else's live
  claim, so one holder at a time publishes an aggregate, in id order. Not ``SKIP LOCKED``: an
  earlier row skipped while another publisher's release or claim extension held it would let a
  later row of its aggregate be claimed and published first. Claim extensions and releases
  take the advisory lock too (shared), so no claim reads a snapshot in which one in flight is
  not yet visible, and a claim only ever waits for single-row marks (no deadlock).
- It then publishes each row and marks it published (conditional on still owning the claim).
  A publisher killed after publishing and before marking leaves its claim to expire; the next
  publisher delivers the row again: at-least-once. A publish that raises stops that aggregate for
  this batch (later events wait, so order holds), counts a failure on the row and releases its
  claim. After ``max_failures`` failures in a row (5) the event is dead-lettered
  (:mod:`resources.outbox.dead_letters`): no longer retried, kept whole, shown by ``sekali outbox
  dead`` and replayable. Later events of its own aggregate wait behind it until it is replayed
  or discarded; events of other aggregates never wait for it.
- Consumers drop redeliveries through :class:`Inbox`: the ``inbox`` row (consumer, event id) and
  the consumer's own database change commit in one transaction, so each event's effect is applied
  once per consumer. Effects outside the database (a cache invalidation) must be idempotent.

Timeline of the crash this design survives::

    t=0  publisher A claims e1..e3 of order 7 (claim until t=30)
    t=1  A publishes e1 (consumer commits e1 + inbox row), marks e1 published
    t=2  A publishes e2 (consumer commits), SIGKILL before marking e2
    t=30 A's claim expires; publisher B claims e2, e3
    t=31 B publishes e2: the consumer's inbox already has e2 -> dropped; B marks e2 published
    t=32 B publishes e3: applied once. The consumer saw e1, e2, e3 in order, each once.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.outbox.dead_letters import DEFAULT_MAX_FAILURES, OutboxDeadLetters
from resources.storage.db import Database
from resources.storage.queries import load_dialect_queries
from resources.telemetry.tracing import SpanKind, span

log = logging.getLogger(__name__)

Clock = Callable[[], float]
_CLAIM_LOCK_ID = 0x0B0C5E  # arbitrary, constant: serialises claimers on Postgres
_Q = load_dialect_queries(Path(__file__).with_suffix(".sql"))


@dataclass(frozen=True)
class OutboxEvent:
    """One outbox row, as a publisher hands it to its target."""

    id: int
    event_id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    created_at: float
    attempts: int
    traceparent: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> OutboxEvent:
        m = row._mapping
        return cls(
            id=int(m["id"]),
            event_id=m["event_id"],
            aggregate_type=m["aggregate_type"],
            aggregate_id=m["aggregate_id"],
            event_type=m["event_type"],
            payload=json.loads(m["payload"]),
            created_at=float(m["created_at"]),
            attempts=int(m["attempts"]),
            traceparent=m["traceparent"],
        )

    @property
    def aggregate(self) -> tuple[str, str]:
        return (self.aggregate_type, self.aggregate_id)


@runtime_checkable
class Publisher(Protocol):
    """Where events go: a broker client, a webhook, or in-app consumers. ``publish`` may be
    called more than once for one event (at-least-once); raise to have it retried later."""

    def publish(self, event: OutboxEvent) -> None: ...


Handler = Callable[[Connection, OutboxEvent], None]


@dataclass(frozen=True)
class Consumer:
    """An in-app consumer: a name (its inbox), the event types it wants, and a handler that runs
    inside the inbox transaction (``conn``) so its database change commits with the inbox row."""

    name: str
    event_types: frozenset[str]
    handler: Handler

    def wants(self, event: OutboxEvent) -> bool:
        return not self.event_types or event.event_type in self.event_types


class Inbox:
    """Dedupe by event id per consumer: :meth:`process` applies an event at most once."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock
        self._q = _Q[db.dialect]

    def process(self, consumer: str, event: OutboxEvent, handler: Handler) -> bool:
        """Apply ``handler`` unless ``consumer`` has processed this event; True if applied."""
        with self.db.transaction() as conn:
            inserted = conn.execute(
                text(self._q["inbox_insert"]),
                {"c": consumer, "e": event.event_id, "now": self.clock()},
            ).rowcount
            if not inserted:
                log.debug("inbox %s dropped redelivered event %s", consumer, event.event_id)
                return False
            handler(conn, event)
        return True

    def seen(self, consumer: str, event_id: str) -> bool:
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(self._q["inbox_seen"]),
                    {"c": consumer, "e": event_id},
                ).first()
                is not None
            )


class InAppPublisher:
    """The default target: hands each event to the in-app consumers that want it, each through
    its inbox."""

    def __init__(self, inbox: Inbox, consumers: Iterable[Consumer]) -> None:
        self.inbox = inbox
        self.consumers = list(consumers)
        self.applied = 0
        self.dropped = 0

    def publish(self, event: OutboxEvent) -> None:
        for consumer in self.consumers:
            if consumer.wants(event):
                if self.inbox.process(consumer.name, event, consumer.handler):
                    self.applied += 1
                else:
                    self.dropped += 1


@dataclass
class PublishStats:
    claimed: int = 0
    published: int = 0
    failed: int = 0
    dead_lettered: int = 0
    deferred: int = 0
    lost_claims: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: PublishStats) -> None:
        self.claimed += other.claimed
        self.published += other.published
        self.failed += other.failed
        self.dead_lettered += other.dead_lettered
        self.deferred += other.deferred
        self.lost_claims += other.lost_claims
        self.errors += other.errors


class OutboxPublisher:
    """Claims, publishes and marks outbox rows. One per process or thread is fine; many may run
    at once on one database."""

    def __init__(
        self,
        db: Database,
        publisher: Publisher,
        *,
        batch_size: int = 100,
        claim_seconds: float = 30.0,
        owner: str | None = None,
        max_failures: int = DEFAULT_MAX_FAILURES,
        clock: Clock = time.time,
    ) -> None:
        if claim_seconds <= 0 or batch_size <= 0 or max_failures <= 0:
            raise ValueError("claim_seconds, batch_size and max_failures must be positive")
        self.max_failures = max_failures
        self.dead_letters = OutboxDeadLetters(db, clock=clock)
        self.db = db
        self.publisher = publisher
        self.batch_size = batch_size
        self.claim_seconds = claim_seconds
        self.owner = owner or uuid.uuid4().hex
        self.clock = clock
        self._q = _Q[db.dialect]

    def claim(self) -> list[OutboxEvent]:
        """Claim up to ``batch_size`` publishable rows, oldest first."""
        now = self.clock()
        with self.db.transaction() as conn:
            self.db.sql_dialect.advisory_lock(conn, _CLAIM_LOCK_ID)
            ids = [
                int(r.id)
                for r in conn.execute(
                    text(self._q["claim_ids"]),
                    {"now": now, "me": self.owner, "limit": self.batch_size},
                )
            ]
            if not ids:
                return []
            conn.execute(
                text(self._q["mark_claimed"]).bindparams(bindparam("ids", expanding=True)),
                {"me": self.owner, "until": now + self.claim_seconds, "ids": ids},
            )
            rows = conn.execute(
                text(self._q["events_by_ids"]).bindparams(bindparam("ids", expanding=True)),
                {"ids": ids},
            ).all()
        return [OutboxEvent.from_row(r) for r in rows]

    def publish_batch(self) -> PublishStats:
        """Claim one batch and publish it in order per aggregate."""
        events = self.claim()
        stats = PublishStats(claimed=len(events))
        blocked: set[tuple[str, str]] = set()
        for event in events:
            if event.aggregate in blocked:
                stats.deferred += 1
                continue
            if not self._still_mine(event):
                stats.lost_claims += 1
                blocked.add(event.aggregate)
                continue
            try:
                with span(
                    "outbox.publish", parent=event.traceparent, kind=SpanKind.PRODUCER,
                    event_id=event.event_id, event_type=event.event_type,
                    aggregate=f"{event.aggregate_type}:{event.aggregate_id}",
                ):
                    self.publisher.publish(event)
            except Exception as exc:  # noqa: BLE001 - any target error: retry this event later
                stats.failed += 1
                error = f"{type(exc).__name__}: {exc}"
                stats.errors.append(f"{event.event_id}: {error}")
                blocked.add(event.aggregate)
                log.warning("publishing %s failed: %s", event.event_id, exc)
                dead = self._failed(event, error)
                if dead is not None:
                    stats.dead_lettered += 1
                    log.error(
                        "outbox event %s (%s %s:%s) dead-lettered as %d after %d failures;"
                        " later events of its aggregate wait: `sekali outbox dead`, then"
                        " replay or discard it", event.event_id, event.event_type,
                        event.aggregate_type, event.aggregate_id, dead, self.max_failures,
                    )
                continue
            if self._mark_published(event):
                stats.published += 1
            else:
                stats.lost_claims += 1
                blocked.add(event.aggregate)
        if blocked:
            self._release(blocked)
        return stats

    def publish_pending(self, *, max_batches: int = 10) -> PublishStats:
        """Publish batches until nothing is claimable or ``max_batches`` were done."""
        total = PublishStats()
        for _ in range(max_batches):
            stats = self.publish_batch()
            total.add(stats)
            if stats.claimed == 0 or stats.published == 0:
                break
        return total

    def _still_mine(self, event: OutboxEvent) -> bool:
        """Extend the claim on the rest of our rows; False if this one was taken over.

        On Postgres under the claim lock, shared: a claim running at the same time would read
        this row's claim as expired (its snapshot predates the extension) and take the next
        row of the aggregate while this one is being published. Extensions do not wait for
        each other."""
        with self.db.sql_dialect.shared_section(self.db, _CLAIM_LOCK_ID) as conn:
            return self._extend(conn, event)

    def _extend(self, conn: Connection, event: OutboxEvent) -> bool:
        return bool(
            conn.execute(
                text(self._q["extend_claim"]),
                {"until": self.clock() + self.claim_seconds, "id": event.id, "me": self.owner},
            ).rowcount
        )

    def _failed(self, event: OutboxEvent, error: str) -> int | None:
        """Count a failed publication on the row (while still ours); at ``max_failures`` in a
        row, dead-letter it in the same transaction. Returns the dead letter's id, if any."""
        with self.db.transaction() as conn:
            failures = conn.execute(
                text(self._q["count_failure"]),
                {"error": error[:4000], "id": event.id, "me": self.owner},
            ).scalar()
            if failures is None or int(failures) < self.max_failures:
                return None
            return self.dead_letters.record(conn, event.id)

    def _mark_published(self, event: OutboxEvent) -> bool:
        with self.db.statement() as conn:
            return bool(
                conn.execute(
                    text(self._q["mark_published"]),
                    {"now": self.clock(), "id": event.id, "me": self.owner},
                ).rowcount
            )

    def _release(self, aggregates: set[tuple[str, str]]) -> None:
        with self.db.transaction() as conn:
            # as in _still_mine; also no deadlock with a claim's row locks
            self.db.sql_dialect.advisory_lock(conn, _CLAIM_LOCK_ID, shared=True)
            for aggregate_type, aggregate_id in aggregates:
                conn.execute(
                    text(self._q["release_aggregate"]),
                    {"me": self.owner, "t": aggregate_type, "a": aggregate_id},
                )


def unpublished_older_than(db: Database, seconds: float, *, now: float | None = None) -> list[int]:
    """Ids of live rows still unpublished ``seconds`` after they were written (a stuck
    publisher): neither dead-lettered nor waiting behind a dead-lettered event of their
    aggregate (those wait for an operator, :func:`held_by_dead_letters`)."""
    cutoff = (time.time() if now is None else now) - seconds
    with db.statement() as conn:
        return [
            int(r.id)
            for r in conn.execute(
                text(_Q[db.dialect]["unpublished_older_than"]), {"cutoff": cutoff}
            )
        ]


def held_by_dead_letters(db: Database) -> tuple[int, int]:
    """Unpublished rows that wait for an operator's replay or discard (`sekali outbox`): how
    many are dead-lettered, and how many later events of their aggregates wait behind them."""
    with db.statement() as conn:
        row = conn.execute(text(_Q[db.dialect]["held_by_dead_letters"])).one()
    return int(row[0]), int(row[1])
