"""The transactional outbox: events written in the same transaction as the business change.

Why: an event published after commit is lost if the worker dies in between; one published
before commit announces a change that may roll back. Writing the event as a row in the business
transaction makes both commit together; a publisher (added later in this module) delivers them
at least once, and consumers drop redeliveries through the ``inbox`` table keyed on event id.

This part holds only the writer. ``event_id`` may be given to make the write itself idempotent:
a replayed phase that writes the same event id again inserts nothing.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, text
from sqlalchemy.engine import Connection

from resources.storage.db import metadata
from resources.storage.json_text import to_text
from resources.storage.queries import load_queries
from resources.telemetry.tracing import inject

outbox = Table(
    "outbox",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", Text, nullable=False, unique=True),
    Column("aggregate_type", Text, nullable=False),
    Column("aggregate_id", Text, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("payload", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("published_at", Float),
    Column("claimed_by", Text),
    Column("claimed_until", Float),
    Column("attempts", Integer, nullable=False),
    Column("traceparent", Text),
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("last_error", Text),
    Column("dead_letter_id", BigInteger),
)

inbox = Table(
    "inbox",
    metadata,
    Column("consumer", Text, primary_key=True),
    Column("event_id", Text, primary_key=True),
    Column("processed_at", Float, nullable=False),
)

QUERIES = load_queries(Path(__file__).with_suffix(".sql"))
"""The statements and conditions of the outbox's writers and retention."""
_INSERT = text(QUERIES["write_event"])


def write_event(
    conn: Connection,
    *,
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    payload: Any,
    event_id: str | None = None,
    now: float | None = None,
) -> str:
    """Insert one event inside the caller's transaction ``conn``; returns its event id.

    With a deterministic ``event_id`` (e.g. ``f"{key}:shipped"``) writing twice is a no-op, so a
    phase resumed after a crash does not emit the event again. The current trace context goes
    with the row, so its publication joins the trace that wrote it.
    """
    event_id = event_id or uuid.uuid4().hex
    conn.execute(
        _INSERT,
        {
            "event_id": event_id,
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "event_type": event_type,
            "payload": to_text(payload),
            "now": time.time() if now is None else now,
            "traceparent": inject(),
        },
    )
    return event_id
