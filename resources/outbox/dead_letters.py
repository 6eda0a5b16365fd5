"""Outbox dead letters: an event whose publication keeps failing stops being retried and is kept
here whole, shown, and replayed or discarded by an operator. This module owns the
``outbox_dead_letters`` table and the outbox's ``dead_letter_id`` mark.

Guarantees (on SQLite and Postgres alike):

- Nothing is lost: the dead letter holds the whole event (ids, aggregate, type, payload, trace
  context) with its failure count and last error, written in the transaction that takes the
  event out of publication (:meth:`OutboxDeadLetters.record`, called by the publisher).
- The ordering rule: events are published in order per aggregate. A dead event is not skipped:
  later events of **its own** aggregate wait behind it until it is replayed (it is then published
  first, and they follow in order) or discarded (its outbox row goes, the dead letter keeps it,
  and they go on). Events of **other** aggregates never wait for it.
- Replay (:meth:`OutboxDeadLetters.replay`) puts the event back for publication with its failure
  count at zero; if it fails ``max_failures`` times again, the same dead letter opens again
  (``deaths`` + 1). Replay and discard only act on an open dead letter, once.

Statuses: ``open`` -> ``replayed`` (the event is back in the outbox) | ``discarded`` (given up;
the dead letter is the only copy, kept).

Retention (:meth:`OutboxDeadLetters.expired`, purged by the reconciliation run with the DLQ's
retention): a closed dead letter goes once it has been closed that long; an open one never, nor
a replayed one whose event is still unpublished (if it dies again, it opens again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from resources.storage.db import Database
from resources.storage.queries import load_queries
from resources.storage.retention import Expiry

Clock = Callable[[], float]

DEFAULT_MAX_FAILURES = 5
"""Failed publications in a row after which an outbox event is dead-lettered."""


class DeadLetterStatus(StrEnum):
    OPEN = "open"
    REPLAYED = "replayed"
    DISCARDED = "discarded"


@dataclass(frozen=True)
class OutboxDeadLetter:
    """One dead outbox event, as stored."""

    id: int
    outbox_id: int
    event_id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    failures: int
    last_error: str | None
    deaths: int
    status: DeadLetterStatus
    detail: str | None
    created_at: float
    updated_at: float

    @classmethod
    def from_row(cls, row: Any) -> OutboxDeadLetter:
        m = row._mapping
        return cls(
            id=int(m["id"]),
            outbox_id=int(m["outbox_id"]),
            event_id=m["event_id"],
            aggregate_type=m["aggregate_type"],
            aggregate_id=m["aggregate_id"],
            event_type=m["event_type"],
            payload=json.loads(m["payload"]),
            failures=int(m["failures"]),
            last_error=m["last_error"],
            deaths=int(m["deaths"]),
            status=DeadLetterStatus(m["status"]),
            detail=m["detail"],
            created_at=float(m["created_at"]),
            updated_at=float(m["updated_at"]),
        )

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id, "outbox_id": self.outbox_id, "event_id": self.event_id,
            "aggregate_type": self.aggregate_type, "aggregate_id": self.aggregate_id,
            "event_type": self.event_type, "payload": self.payload, "failures": self.failures,
            "last_error": self.last_error, "deaths": self.deaths, "status": str(self.status),
            "detail": self.detail, "created_at": self.created_at, "updated_at": self.updated_at,
        }


_Q = load_queries(Path(__file__).with_suffix(".sql"))


class OutboxDeadLetters:
    """The dead letters of the outbox over one database."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock

    def record(self, conn: Connection, outbox_id: int) -> int:
        """In the caller's transaction: dead-letter the outbox row ``outbox_id`` (its failures
        and last error as the row holds them), take it out of publication; returns the dead
        letter's id."""
        conn.execute(text(_Q["record"]), {"id": outbox_id, "now": self.clock()})
        dead_id = int(
            conn.execute(text(_Q["dead_letter_of"]), {"id": outbox_id}).scalar_one()
        )
        conn.execute(text(_Q["mark_dead"]), {"dead": dead_id, "id": outbox_id})
        return dead_id

    def page(
        self,
        status: DeadLetterStatus | None = DeadLetterStatus.OPEN,
        *,
        after_id: int = 0,
        limit: int = 100,
    ) -> list[OutboxDeadLetter]:
        """Dead letters (``status``, or all with None) with ``id > after_id``, oldest first."""
        name = "page" if status is None else "page_of_status"
        with self.db.statement() as conn:
            rows = conn.execute(
                text(_Q[name]),
                {"after": after_id, "status": str(status), "limit": limit},
            ).all()
        return [OutboxDeadLetter.from_row(r) for r in rows]

    def get(self, dead_id: int) -> OutboxDeadLetter | None:
        with self.db.statement() as conn:
            row = conn.execute(
                text(_Q["by_id"]),
                {"id": dead_id},
            ).first()
        return None if row is None else OutboxDeadLetter.from_row(row)

    def expired(self, retention_seconds: float) -> Expiry:
        """Dead letters replayed or discarded more than ``retention_seconds`` ago, but for a
        replayed one whose event is still unpublished."""
        return Expiry.of(
            "outbox_dead_letters",
            "id",
            _Q["expired"],
            {"cutoff": self.clock() - retention_seconds},
            keep=[_Q["unpublished_event"]],
        )

    def replay(self, ids: Sequence[int], *, actor: str) -> list[int]:
        """Put the open dead letters ``ids`` back for publication (failures at zero, first of
        their aggregate again); returns the ids replayed (others were not open)."""
        return self._close(ids, DeadLetterStatus.REPLAYED, f"replayed by {actor}",
                           "republish")

    def discard(self, ids: Sequence[int], *, actor: str, reason: str) -> list[int]:
        """Give up on the open dead letters ``ids``: their outbox rows go (the dead letter is
        the copy kept), and the later events of their aggregates go on. Returns the ids
        discarded."""
        return self._close(
            ids, DeadLetterStatus.DISCARDED, f"discarded by {actor}: {reason}",
            "drop_discarded",
        )

    def _close(
        self, ids: Sequence[int], status: DeadLetterStatus, detail: str, then: str
    ) -> list[int]:
        """Close each open dead letter of ``ids`` and, in the same transaction, run the named
        query ``then`` on its outbox row."""
        done = []
        for dead_id in ids:
            with self.db.transaction() as conn:
                changed = conn.execute(
                    text(_Q["close"]),
                    {"status": str(status), "detail": detail[:2000], "now": self.clock(),
                     "id": dead_id},
                ).rowcount
                if changed:
                    conn.execute(text(_Q[then]), {"id": dead_id})
                    done.append(dead_id)
        return done
