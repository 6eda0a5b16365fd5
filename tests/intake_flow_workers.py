"""Worker functions the intake flow tests run in other processes (spawn context).

Module-level so ``multiprocessing`` can import them; each opens its own database.
"""

from __future__ import annotations

import time
from typing import Any

from engine.requests import RequestStore
from pipelines.domain.consumers import report_rebuild_consumer
from resources.outbox import OutboxEvent
from resources.storage.db import Database


def ship_events(url: str, worker: int, count: int) -> int:
    """Deliver ``count`` ``order.shipped`` events to the report rebuild consumer, each in its own
    inbox-style transaction, as the outbox publisher does; returns how many were delivered."""
    db = Database.from_url(url)
    consumer = report_rebuild_consumer()
    try:
        for i in range(count):
            ident = worker * 100_000 + i
            event = OutboxEvent(
                id=ident,
                event_id=f"fulfil:o{ident}:shipped",
                aggregate_type="order",
                aggregate_id=f"o{ident}",
                event_type="order.shipped",
                payload={"order_id": f"o{ident}"},
                created_at=time.time(),
                attempts=0,
            )
            with db.transaction() as conn:
                consumer.handler(conn, event)
        return count
    finally:
        db.dispose()


def claim_at(url: str, now: float, limit: int, barrier: Any = None) -> list[int]:
    """One intake claim as a sensor tick at ``now`` would make it; returns the ids launched.
    With ``barrier``, every claimer connects first and they claim together."""
    db = Database.from_url(url)
    try:
        store = RequestStore(db, clock=lambda: now)
        store.get(1)  # connected before the start line
        if barrier is not None:
            barrier.wait(60)
        return [r.id for r in store.claim_for_launch(limit)]
    finally:
        db.dispose()
