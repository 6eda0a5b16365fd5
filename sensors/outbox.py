"""``outbox_publisher``: a sensor that publishes the transactional outbox every few seconds.

A sensor rather than a scheduled job: a tick costs no run (no run worker, no run history noise)
and runs every ``minimum_interval_seconds``. Each tick publishes up to ``MAX_BATCHES`` batches
through :class:`resources.outbox.publisher.OutboxPublisher` into the in-app consumers (cache
invalidation after commit, through the inbox), and reports what it did as its skip reason. An
event that fails ``max_failures`` times in a row is dead-lettered
(:mod:`resources.outbox.dead_letters`): its own aggregate waits behind it, others go on.
Several code locations or daemons running it at once is safe: claims keep one publisher per
aggregate at a time, and the inbox drops redeliveries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dagster as dg

from resources.outbox import Consumer, InAppPublisher, Inbox, OutboxPublisher

MAX_BATCHES = 10


def outbox_sensors(
    consumers: Callable[[Any], list[Consumer]], *, name: str = "outbox_publisher"
) -> list[dg.SensorDefinition]:
    """The publisher sensor, delivering into ``consumers(cache)`` (the code location's in-app
    consumers, given the ``cache`` resource's cache or None)."""

    @dg.sensor(
        name=name,
        minimum_interval_seconds=10,
        description="Publishes outbox events at least once, in order per aggregate; consumers "
        "dedupe through the inbox.",
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={"app_db", "cache"},
    )
    def outbox_publisher(context: dg.SensorEvaluationContext) -> dg.SkipReason:
        db = context.resources.app_db.get_database()
        inbox = InAppPublisher(Inbox(db), consumers(_cache(context.resources)))
        publisher = OutboxPublisher(db, inbox)
        stats = publisher.publish_pending(max_batches=MAX_BATCHES)
        if stats.errors:
            context.log.warning(f"outbox: {stats.failed} events failed: {stats.errors[:5]}")
        if stats.dead_lettered:
            context.log.error(
                f"outbox: {stats.dead_lettered} events dead-lettered (later events of their"
                " aggregates wait): see `sekali outbox dead`, then replay or discard them"
            )
        return dg.SkipReason(
            f"published {stats.published} of {stats.claimed} claimed; {stats.failed} failed, "
            f"{stats.dead_lettered} dead-lettered, {stats.deferred} deferred behind a failure"
        )

    return [outbox_publisher]


def _cache(resources: Any) -> Any:
    cache = getattr(resources, "cache", None)
    return cache.get_cache() if cache is not None else None
