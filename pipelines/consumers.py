"""The in-app consumers of the outbox: what sekali's own business does after a commit.

Today one: cache invalidation when an order is fulfilled (the cached order and fulfilment/stock
reports go stale). The outbox machinery itself (:mod:`resources.outbox`) knows no event type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from resources.outbox import Consumer, OutboxEvent

FULFILLED_EVENTS = frozenset({"order_fulfilled", "order.fulfilled", "order.shipped"})
REPORTS_CHANGED_BY_FULFILMENT = ("report:fulfilment_by_status:", "report:stock_levels:")


def order_report_keys(cache: Any, event: OutboxEvent) -> list[str]:
    """Cache keys an order's fulfilment makes stale: the order's own report key and the cached
    reports that count fulfilments or stock (found among the hot keys)."""
    keys = [f"report:order:{event.aggregate_id}"]
    keys += [k for k, _ in cache.hot_keys(100) if k.startswith(REPORTS_CHANGED_BY_FULFILMENT)]
    return keys


def cache_invalidation_consumer(
    cache: Any,
    *,
    name: str = "cache-invalidation",
    event_types: Iterable[str] = FULFILLED_EVENTS,
    keys_for: Callable[[Any, OutboxEvent], Sequence[str]] = order_report_keys,
) -> Consumer:
    """Invalidate the cache after the database committed (the outbox row proves it did).
    Invalidation is idempotent, so a redelivery that slips past the inbox does no harm."""

    def handle(_conn: Connection, event: OutboxEvent) -> None:
        for key in keys_for(cache, event):
            cache.invalidate(key)

    return Consumer(name, frozenset(event_types), handle)


def default_consumers(cache: Any | None) -> list[Consumer]:
    """The in-app consumers: cache invalidation when a cache is configured."""
    return [cache_invalidation_consumer(cache)] if cache is not None else []
