"""Retention of the outbox and the inbox: published events and old inbox entries go; an event
that may still be delivered keeps its row and every consumer's inbox entry for it.

- ``outbox``: only rows published before the cutoff. An unpublished row is never deleted,
  whatever its age (the reconciliation's stale-outbox check publishes it).
- ``inbox``: entries processed before the cutoff, unless their event is still unpublished in
  the outbox: a publisher that died after the consumer committed and before marking the row
  delivers it again, and the inbox entry is what drops that redelivery.

Purge with ``expired_*(...).purge(db)``, count with ``.count(db)``
(:class:`resources.storage.retention.Expiry`).
"""

from __future__ import annotations

import time

from resources.outbox.events import QUERIES
from resources.storage.retention import Expiry


def expired_outbox(older_than: float, *, now: float | None = None) -> Expiry:
    """Outbox rows published more than ``older_than`` seconds before ``now``."""
    return Expiry.of(
        "outbox", "id", QUERIES["published_before"], _cutoff(older_than, now),
    )


def expired_inbox(older_than: float, *, now: float | None = None) -> Expiry:
    """Inbox entries processed more than ``older_than`` seconds before ``now`` whose event can
    no longer be delivered again."""
    return Expiry.of(
        "inbox",
        "consumer, event_id",
        QUERIES["processed_before"],
        _cutoff(older_than, now),
        keep=[QUERIES["event_unpublished"]],
    )


def _cutoff(older_than: float, now: float | None) -> dict[str, float]:
    return {"cutoff": (time.time() if now is None else now) - older_than}
