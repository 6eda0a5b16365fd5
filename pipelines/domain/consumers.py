"""The in-app consumers of the outbox: what sekali's own business does after a commit.

Cache invalidation when an order is fulfilled (the cached order and fulfilment/stock reports go
stale), and the report rebuilds an ``order.shipped`` asks for: one ``rebuild_report_cache``
request per event and report, debounced by the job type so a burst of shipments makes one
rebuild per report. The outbox machinery itself (:mod:`resources.outbox`) knows no event type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from engine.intake import enqueue
from resources.outbox import Consumer, OutboxEvent

FULFILLED_EVENTS = frozenset({"order_fulfilled", "order.fulfilled", "order.shipped"})
REPORTS_CHANGED_BY_FULFILMENT = ("report:fulfilment_by_status:", "report:stock_levels:")
SHIPPED_EVENTS = frozenset({"order.shipped"})
REPORTS_REBUILT_ON_SHIPMENT = ("fulfilment_by_status", "stock_levels")


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


def report_rebuild_consumer(
    *,
    name: str = "report-rebuild",
    event_types: Iterable[str] = SHIPPED_EVENTS,
    reports: Sequence[str] = REPORTS_REBUILT_ON_SHIPMENT,
) -> Consumer:
    """Ask for the reports a shipment changes, in the inbox's transaction (the request exists
    if and only if the event is marked consumed). Each event makes its own request (``as_of``
    ``shipped-<outbox id>``), so none is lost; the job type's debounce coalesces them."""

    def handle(conn: Connection, event: OutboxEvent) -> None:
        for report in reports:
            enqueue(
                "rebuild_report_cache",
                {"report": report, "as_of": f"shipped-{event.id}"},
                correlation_id=None,
                conn=conn,
                source="outbox",
            )

    return Consumer(name, frozenset(event_types), handle)


def default_consumers(cache: Any | None) -> list[Consumer]:
    """The in-app consumers when a cache is configured: cache invalidation, and the report
    rebuilds after shipments (the rebuild fills that cache)."""
    if cache is None:
        return []
    return [cache_invalidation_consumer(cache), report_rebuild_consumer()]
